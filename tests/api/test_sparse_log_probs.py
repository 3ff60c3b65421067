"""``fused_linear_log_probs`` with (..., K) targets, K ids a row: the log-probs (..., K) and the
per-row entropy, log_sum_sq_probs and mean_logits against a float64 reference on the full
log-softmax, and their gradients under random upstream gradients against float64 autograd, on
both paths (the Triton kernels, in the interpreter on a CPU, and the PyTorch path)."""

import pytest
import torch
from conftest import DEVICE, DTYPES, assert_rel, submodule, tolerance

IGNORE = -100


def make_sparse_inputs(n, h, v, k, dtype, *, seed, device, bias=False, lead=None):
    """Seeded hidden (*lead or n, h), weight (v, h), bias (v,) or None, and ids (*lead, k): a
    repeated id in the first row, one ignored id in the second, a row of ignored ids only (the
    third, with K > 1), and the first id of the last row ignored (its second is the sweep's)."""
    gen = torch.Generator().manual_seed(seed)
    lead = (n,) if lead is None else tuple(lead)
    hidden = torch.randn(*lead, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    b = torch.randn(v, generator=gen) * 0.5 if bias else None
    ids = torch.randint(0, v, (*lead, k), generator=gen)
    flat = ids.view(-1, k)
    if k > 1 and flat.shape[0] >= 4:
        flat[0, 1] = flat[0, 0]
        flat[1, -1] = IGNORE
        flat[2, :] = IGNORE
        flat[-1, 0] = IGNORE
    elif flat.shape[0] >= 2:
        flat[1, 0] = IGNORE
    tensors = [None if t is None else t.to(device=device, dtype=dtype).requires_grad_() for t in (hidden, weight, b)]
    return tensors[0], tensors[1], ids.to(device), tensors[2]


def reference(hidden, weight, ids, bias=None, temperature=1.0, logit_scale=1.0, softcap=None):
    """float64 log-probs at the ids (0 where ignored) and the per-row outputs (0 on rows without
    an id) from the materialised full log-softmax."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    valid = ids != IGNORE
    rows = valid.any(-1)
    picked = log_p.gather(-1, torch.where(valid, ids, 0))
    per_row = dict(entropy=-(log_p.exp() * log_p).sum(-1), log_sum_sq_probs=torch.logsumexp(2 * log_p, dim=-1),
                   mean_logits=z.mean(-1))
    out = {name: torch.where(rows, value, 0.0) for name, value in per_row.items()}
    out["log_probs"] = torch.where(valid, picked, 0.0)
    return out


OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    "softcap-temperature": {"softcap": 3.0, "temperature": 0.7, "logit_scale": 1.5},
    "bias-softcap": {"bias": True, "softcap": 2.0, "temperature": 1.3},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_values_and_gradients(flce, path, dtype, k, option):
    """Outputs and the gradients of sum(g * log_probs) + sum(e * entropy), g and e random, to
    hidden, weight and bias, against float64 autograd on the full log-softmax."""
    options = dict(OPTIONS[option])
    hidden, weight, ids, bias = make_sparse_inputs(12, 16, 37, k, dtype, seed=k, device=path.device,
                                                   bias=options.pop("bias", False))
    gen = torch.Generator().manual_seed(100 + k)
    log_prob_weight = torch.randn(12, k, generator=gen, dtype=torch.float64).to(path.device)
    entropy_weight = torch.randn(12, generator=gen, dtype=torch.float64).to(path.device)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")
    got = flce.fused_linear_log_probs(hidden, weight, ids, bias, outputs=outputs, **options)
    ((got.log_probs.double() * log_prob_weight).sum() + (got.entropy.double() * entropy_weight).sum()).backward()
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    expected = reference(*leaves64[:2], ids, leaves64[2] if bias is not None else None, **options)
    ((expected["log_probs"] * log_prob_weight).sum() + (expected["entropy"] * entropy_weight).sum()).backward()
    assert got.is_top1 is None and got.log_probs.shape == ids.shape and got.entropy.shape == ids.shape[:1]
    assert torch.equal(got.log_probs[ids == IGNORE], torch.zeros_like(got.log_probs[ids == IGNORE]))
    for name in outputs:
        # log-probs and logits are of the logits' scale (a few units)
        assert_rel(getattr(got, name), expected[name], tolerance(dtype, "loss"), name, floor=1.0)
    for name, leaf, leaf64 in zip(("grad_hidden", "grad_weight", "grad_bias"), leaves, leaves64, strict=False):
        assert_rel(leaf.grad, leaf64.grad, tolerance(dtype, "grad"), name)


def test_leading_shape_int32_and_log_probs_only(flce, path):
    """(B, T, K) int32 ids with hidden (B, T, H), only log_probs upstream: shapes, values, grads."""
    hidden, weight, ids, _ = make_sparse_inputs(0, 8, 29, 3, torch.float32, seed=7, device=path.device, lead=(2, 3))
    got = flce.fused_linear_log_probs(hidden, weight, ids.int())
    assert got.entropy is None and got.log_probs.shape == (2, 3, 3)
    upstream = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(path.device)
    (got.log_probs.double() * upstream).sum().backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    expected = reference(h64, w64, ids)["log_probs"]
    (expected * upstream).sum().backward()
    assert_rel(got.log_probs, expected, tolerance(torch.float32, "loss"), "log_probs", floor=1.0)
    assert_rel(hidden.grad, h64.grad, tolerance(torch.float32, "grad"), "grad_hidden")
    assert_rel(weight.grad, w64.grad, tolerance(torch.float32, "grad"), "grad_weight")


def test_one_id_a_row_is_the_per_token_call(flce, path):
    """K = 1 goes through the per-token sweep and backward alone: the same values and gradients,
    bit for bit, as the (N,) targets."""
    hidden, weight, ids, _ = make_sparse_inputs(10, 16, 37, 1, torch.float32, seed=9, device=path.device)
    upstream = torch.randn(10, generator=torch.Generator().manual_seed(10)).to(path.device)
    results = []
    for targets in (ids, ids[:, 0]):
        hidden.grad = weight.grad = None
        out = flce.fused_linear_log_probs(hidden, weight, targets, outputs=("log_probs", "entropy"))
        (out.log_probs.reshape(-1) * upstream).sum().add(out.entropy.sum()).backward()
        results.append((out.log_probs.reshape(-1), out.entropy, hidden.grad.clone(), weight.grad.clone()))
    for got, expected in zip(*results, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("budget", ["recomputed", "kept-whole", "kept-counted"])
def test_rows_whose_gradient_is_the_other_ids_alone(flce, path, tune, budget):
    """An upstream of 0 at a row's first id and opposite values at two others: the row's lse and
    loss coefficients are 0, yet its grad logits are not. Such rows (the even ones; the odd ones
    have an lse gradient) must not be left out of a backward of several chunks, kept or not; rows
    3 (kept) and 8 (recomputed) have no upstream at all, and a grad_hidden of exactly 0 whether the
    kept backward takes every computed row (``whole``) or counts those with a gradient."""
    tune(chunk_rows=2, keep_mib=0 if budget == "recomputed" else 1, keep_rows=None if budget == "recomputed" else 5)
    submodule(flce, "_kept").SPECULATION.found("log_probs", budget == "kept-whole")
    hidden, weight, _, _ = make_sparse_inputs(12, 16, 37, 3, torch.float32, seed=13, device=path.device)
    gen = torch.Generator().manual_seed(14)
    ids = torch.stack([torch.randperm(37, generator=gen)[:3] for _ in range(12)]).to(path.device)
    a = torch.rand(12, generator=gen, dtype=torch.float64) + 0.5
    upstream = torch.stack([torch.zeros_like(a), a, -a], dim=1)
    upstream[1::2, 2] *= 0.5
    upstream[[3, 8]] = 0.0
    upstream = upstream.to(path.device)
    got = flce.fused_linear_log_probs(hidden, weight, ids)
    (got.log_probs.double() * upstream).sum().backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    (reference(h64, w64, ids)["log_probs"] * upstream).sum().backward()
    assert torch.equal(hidden.grad[[3, 8]], torch.zeros_like(hidden.grad[[3, 8]]))
    assert_rel(hidden.grad, h64.grad, tolerance(torch.float32, "grad"), "grad_hidden")
    assert_rel(weight.grad, w64.grad, tolerance(torch.float32, "grad"), "grad_weight")


def test_empty_batch(flce, path):
    hidden, weight, ids, _ = make_sparse_inputs(0, 8, 29, 4, torch.float32, seed=11, device=path.device)
    got = flce.fused_linear_log_probs(hidden, weight, ids, outputs=("log_probs", "entropy"))
    assert got.log_probs.shape == (0, 4) and got.entropy.shape == (0,)
    (got.log_probs.sum() + got.entropy.sum()).backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_refused(flce):
    hidden, weight, ids, _ = make_sparse_inputs(4, 8, 29, 2, torch.float32, seed=12, device=DEVICE)
    with pytest.raises(ValueError, match="is_top1 is not available"):
        flce.fused_linear_log_probs(hidden, weight, ids, outputs=("log_probs", "is_top1"))
    with pytest.raises(ValueError, match="K >= 1"):
        flce.fused_linear_log_probs(hidden, weight, ids[:, :0])
    with pytest.raises(ValueError, match=r"\(\.\.\., K\) targets must have shape"):
        flce.fused_linear_log_probs(hidden, weight, ids[:3])
    with pytest.raises(ValueError, match="targets must be in"):
        flce.fused_linear_log_probs(hidden, weight, torch.where(ids == IGNORE, 0, ids + 29))


@pytest.mark.parametrize("add_tail", [True, False], ids=["tail", "no-tail"])
def test_compiled_sparse_kl_matches_eager(flce, path, add_tail):
    """torch.compile(fullgraph=True) through the sparse KL (the (N, K) log-probs, or the K logits
    alone without the tail): one graph
    (the custom operators' fake implementations and autograd), the same loss and gradients. On
    the CPU through dynamo and AOTAutograd ("aot_eager"), Inductor on CUDA."""
    from torch._dynamo.testing import CompileCounterWithBackend

    hidden, weight, ids, bias = make_sparse_inputs(12, 16, 37, 4, torch.float32, seed=13, device=path.device,
                                                   bias=True)
    teacher = torch.log_softmax(torch.randn(12, 37, generator=torch.Generator().manual_seed(14)), -1)
    teacher = teacher.to(path.device).gather(-1, torch.where(ids == IGNORE, 0, ids))

    def loss(h, w, b):
        return flce.fused_linear_sparse_kl(h, w, ids, teacher, b, temperature=0.8, softcap=3.0, add_tail=add_tail)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor" if DEVICE == "cuda" else "aot_eager")
    results = []
    for fn in (torch.compile(loss, fullgraph=True, backend=counter), loss):
        for t in (hidden, weight, bias):
            t.grad = None
        value = fn(hidden, weight, bias)
        value.backward()
        results.append([value.detach(), hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()])
    torch._dynamo.reset()
    assert counter.frame_count == 1
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
