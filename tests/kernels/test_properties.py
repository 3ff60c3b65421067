"""Property-based tests: random problems against the float64 reference, and properties that
hold whatever the inputs (shift invariance, extreme logits, logit_scale 0, determinism)."""

import math
import os

import pytest
import torch
from conftest import DEVICE, DTYPES, HAS_CUDA, assert_rel, submodule, tolerance
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference

# The interpreter takes about a second per forward + backward: few examples on the CPU.
# FLCE_TEST_EXAMPLES=k multiplies them (a longer hunt for counterexamples).
_FACTOR = float(os.environ.get("FLCE_TEST_EXAMPLES", "1"))
# On the GPU every new shape class and flag set compiles kernels (about a second each): the
# long random campaign there is scripts/gpu_robustness.py.
EXAMPLES = int((60 if HAS_CUDA else 40) * _FACTOR)
FEW_EXAMPLES = int((20 if HAS_CUDA else 8) * _FACTOR)

dtypes = st.sampled_from([torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else []))
# (On a GPU conftest's kernel launches one logit kernel configuration: no autotuning per (H, V)
# of every example.)


def _to(device_dtype, *tensors):
    device, dtype = device_dtype
    return [None if t is None else t.to(device, dtype).requires_grad_() for t in tensors]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- random problems against the reference -------------------------------------------------------
@st.composite
def problems(draw):
    n = draw(st.integers(1, 40))
    v = draw(st.integers(1, 150))
    ignore = draw(st.sampled_from([0.0, 0.0, 0.3, 0.7, 1.0]))
    return dict(
        n=n, h=draw(st.integers(1, 48)), v=v, dtype=draw(dtypes), seed=draw(st.integers(0, 2**31 - 1)),
        bias=draw(st.booleans()), ignore=ignore, edge_targets=draw(st.booleans()),
        weight_scale=draw(st.sampled_from([0.5, 1.0, 4.0])),
        chunk_rows=draw(st.one_of(st.none(), st.integers(1, 16))),
        return_lse=draw(st.booleans()),
        options=dict(
            reduction=draw(st.sampled_from(["mean", "sum", "none"])),
            logit_scale=draw(st.sampled_from([1.0, 0.25, 1.7, -0.8])),
            softcap=draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
            label_smoothing=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
            z_loss_scale=draw(st.one_of(st.just(0.0), st.floats(1e-4, 0.1))),
        ),
    )


@settings(max_examples=EXAMPLES, deadline=None)
@given(problems())
def test_random_problems_match_reference(flce, p):
    n, h, v, dtype, opts = p["n"], p["h"], p["v"], p["dtype"], p["options"]
    gen = _gen(p["seed"])
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (p["weight_scale"] / h**0.5)
    bias = torch.randn(v, generator=gen) if p["bias"] else None
    targets = torch.randint(0, v, (n,), generator=gen)
    if p["edge_targets"]:  # the first and last vocabulary entries
        targets[0], targets[-1] = 0, v - 1
    ignored = torch.rand(n, generator=gen) < p["ignore"]
    targets[ignored] = -100
    hidden, weight, bias = _to((DEVICE, dtype), hidden, weight, bias)
    targets = targets.to(DEVICE)

    with submodule(flce, "_settings").override(chunk_rows=p["chunk_rows"]):
        out = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True,
                                              return_lse=p["return_lse"], **opts)
        loss, metrics = out[:2]
        grad_output = torch.randn(loss.shape, generator=gen) if loss.dim() else torch.tensor(0.9)
        total = (loss * grad_output.to(DEVICE)).sum()
        lse_grad = None
        if p["return_lse"]:
            lse_grad = torch.randn(n, generator=gen)
            total = total + (out[2] * lse_grad.to(DEVICE)).sum()
        total.backward()
    valid = targets.cpu() != -100
    num_valid = int(valid.sum())
    # All rows ignored with mean: a NaN loss whose gradient is 0 (PyTorch's would be NaN).
    nan_mean = opts["reduction"] == "mean" and num_valid == 0
    ref = reference(hidden, weight, targets, bias, grad_output=None if nan_mean else grad_output,
                    lse_grad=lse_grad, **opts)
    # Scales of the errors: fp32 rounding is relative to the logits (and lse), not to a loss or
    # an entropy that can be much smaller than them; a gradient's to that of one grad logit of 1.
    z_max = 1.0 + ref.logits.abs().max().item()
    z_loss_factor = 1.0 + 2.0 * opts["z_loss_scale"] * z_max  # d (lse + k lse^2) / d lse
    rows = num_valid if opts["reduction"] == "sum" else 1
    tol, grad_tol = tolerance(dtype, "loss"), tolerance(dtype, "grad")
    assert_rel(loss, ref.loss, tol, "loss", floor=rows * z_max * z_loss_factor)
    assert_rel(metrics["entropy_sum"], ref.entropy_sum, tol, "entropy_sum", floor=max(num_valid, 1) * z_max)
    if p["return_lse"]:
        assert_rel(out[2], ref.lse, tol, "lse", floor=z_max)
    # Exact where no rounding of the logits can change an argmax; bounded where one could.
    correct = int(metrics["num_correct_tokens"])
    assert ref.num_correct_unambiguous <= correct <= ref.num_correct_unambiguous + ref.num_ambiguous

    if nan_mean and lse_grad is None:
        for t in (hidden, weight, bias):
            assert t is None or torch.count_nonzero(t.grad) == 0
        return
    row_grad = 0.0 if nan_mean else grad_output.abs().max().item() / (num_valid if opts["reduction"] == "mean" else 1)
    if lse_grad is not None:
        row_grad += lse_grad.abs().max().item()
    g = abs(opts["logit_scale"]) * row_grad * z_loss_factor
    for name, t, expected, other in (("hidden", hidden, ref.grad_hidden, weight),
                                     ("weight", weight, ref.grad_weight, hidden), ("bias", bias, ref.grad_bias, None)):
        if t is not None:
            floor = g * (1.0 if other is None else other.detach().abs().max().item())
            assert t.grad.dtype == dtype
            assert_rel(t.grad, expected, grad_tol, f"grad_{name}", floor=max(floor, 1e-6))


# ---- the causal-LM shift -------------------------------------------------------------------------
@settings(max_examples=FEW_EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lead=st.sampled_from([(13,), (2, 7), (2, 2, 5)]), h=st.integers(1, 24),
       v=st.integers(2, 100), dtype=dtypes, shift=st.integers(1, 3), reduction=st.sampled_from(["mean", "sum", "none"]),
       softcap=st.sampled_from([None, 4.0]), return_lse=st.booleans(), ignore=st.sampled_from([0.0, 0.4]),
       chunk_rows=st.one_of(st.none(), st.integers(1, 8)))
def test_shift_equals_explicitly_shifted_inputs(flce, seed, lead, h, v, dtype, shift, reduction, softcap, return_lse,
                                                ignore, chunk_rows):
    """``shift=k`` scores position i against ``targets[..., i + k]``: the loss, lse and metrics of
    ``hidden[..., :-k, :]`` against ``targets[..., k:]`` (float64 reference), their gradients, and
    exactly zero gradient at the last k positions of hidden."""
    gen = _gen(seed)
    hidden = torch.randn(*lead, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    targets = torch.randint(0, v, lead, generator=gen)
    targets[torch.rand(lead, generator=gen) < ignore] = -100
    targets[..., -1] = v - 1  # at least one position with a loss, whatever k
    hidden, weight = _to((DEVICE, dtype), hidden, weight)
    targets = targets.to(DEVICE)
    with submodule(flce, "_settings").override(chunk_rows=chunk_rows):
        loss, metrics, *lse = flce.fused_linear_cross_entropy(hidden, weight, targets, softcap=softcap,
                                                              reduction=reduction, return_metrics=True,
                                                              return_lse=return_lse, shift=shift)
        grad_output = torch.randn(loss.shape, generator=gen) if loss.dim() else torch.tensor(0.7)
        (loss * grad_output.to(DEVICE)).sum().backward()

    kept_hidden, kept_targets = hidden[..., :-shift, :], targets[..., shift:]
    ref = reference(kept_hidden, weight, kept_targets, softcap=softcap, reduction=reduction, grad_output=grad_output)
    num_valid = int((kept_targets != -100).sum())
    assert loss.shape == ref.loss.shape and int(metrics["num_valid_tokens"]) == num_valid
    # Error scales as in test_random_problems_match_reference.
    z_max = 1.0 + ref.logits.abs().max().item()
    tol, grad_tol = tolerance(dtype, "loss"), tolerance(dtype, "grad")
    assert_rel(loss, ref.loss, tol, "loss", floor=(num_valid if reduction == "sum" else 1) * z_max)
    if return_lse:
        assert lse[0].shape == kept_targets.shape
        assert_rel(lse[0], ref.lse, tol, "lse", floor=z_max)
    assert_rel(metrics["entropy_sum"], ref.entropy_sum, tol, "entropy_sum", floor=num_valid * z_max)
    correct = int(metrics["num_correct_tokens"])
    assert ref.num_correct_unambiguous <= correct <= ref.num_correct_unambiguous + ref.num_ambiguous

    row_grad = grad_output.abs().max().item() / (num_valid if reduction == "mean" else 1)
    assert_rel(hidden.grad[..., :-shift, :], ref.grad_hidden, grad_tol, "grad_hidden",
               floor=max(row_grad * weight.detach().abs().max().item(), 1e-6))
    assert torch.count_nonzero(hidden.grad[..., -shift:, :]) == 0
    assert_rel(weight.grad, ref.grad_weight, grad_tol, "grad_weight",
               floor=max(row_grad * hidden.detach().abs().max().item(), 1e-6))


# ---- shift invariance -----------------------------------------------------------------------
def _integer_problem(seed, n, h, v, low=-3, high=4):
    """Small-integer inputs: every logit (sums of small integer products) is exact in fp32."""
    gen = _gen(seed)
    hidden = torch.randint(low, high, (n, h), generator=gen).float()
    weight = torch.randint(low, high, (v, h), generator=gen).float()
    bias = torch.randint(-8, 9, (v,), generator=gen).float()
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, bias, targets


@settings(max_examples=FEW_EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 30), h=st.integers(1, 24), v=st.integers(2, 120),
       dtype=dtypes, shift=st.sampled_from([-37.0, 5.0, 200.0]), logit_scale=st.sampled_from([1.0, 0.5]),
       label_smoothing=st.sampled_from([0.0, 0.3]), reduction=st.sampled_from(["mean", "sum", "none"]))
def test_bias_shift_invariance(flce, seed, n, h, v, dtype, shift, logit_scale, label_smoothing, reduction):
    """Adding a constant to the bias adds it to every logit of a row: the softmax, the loss,
    the gradients and the metrics do not change."""
    hidden, weight, bias, targets = _integer_problem(seed, n, h, v)
    targets = targets.to(DEVICE)
    results = []
    for b in (bias, bias + shift):
        hi, w, bb = _to((DEVICE, dtype), hidden, weight, b)
        loss, metrics = flce.fused_linear_cross_entropy(hi, w, targets, bb, logit_scale=logit_scale,
                                                        label_smoothing=label_smoothing, reduction=reduction,
                                                        return_metrics=True)
        loss.sum().backward()
        results.append((loss.detach(), metrics, hi.grad, w.grad, bb.grad))
    (loss0, m0, *grads0), (loss1, m1, *grads1) = results
    # The shift moves lse and the logits by |shift * s|: their fp32 rounding at the shifted
    # magnitude is the only difference. The softmax is computed in fp32 whatever the inputs'
    # dtype, so an ulp of |z| + |shift * s| in fp32 bounds the error of lse and of each z - lse.
    z_max = (hidden.abs().sum(1).max() * weight.abs().max() + 8).item() * logit_scale
    shifted_scale = z_max + abs(shift * logit_scale)
    ulps = 8 * 2.0**-23 * shifted_scale
    rows = n if reduction == "sum" else 1
    assert_rel(loss1, loss0, tolerance(dtype, "loss") + ulps, "loss", floor=rows * shifted_scale)
    assert int(m1["num_correct_tokens"]) == int(m0["num_correct_tokens"])  # exact logits: exact ties
    assert_rel(m1["entropy_sum"], m0["entropy_sum"], tolerance(dtype, "loss") + ulps, "entropy", floor=n * z_max)
    # The gradients: those few ulps are absolute errors in log p, hence relative errors in every
    # p_ij of a row, so the grad logits of a row (p - onehot, times d loss / d loss_i) err by at
    # most ulps * sum_j p_ij = ulps per row, however small they are (a confident row's p - onehot
    # can be far below an ulp of the shifted logits). grad_hidden sums a row's grad logits times
    # weight rows, grad_weight and grad_bias sum them over the rows.
    row_grad = logit_scale / (n if reduction == "mean" else 1)
    shift_error = {"hidden": ulps * row_grad * weight.abs().max().item(),
                   "weight": ulps * row_grad * n * hidden.abs().max().item(),
                   "bias": ulps * row_grad * n}
    for name, g1, g0 in zip(("hidden", "weight", "bias"), grads1, grads0, strict=True):
        err = (g1.double() - g0.double()).abs().max().item()
        bound = tolerance(dtype, "grad") * max(g0.abs().max().item(), 1e-3) + 2 * shift_error[name]
        assert err <= bound, f"grad_{name}: max error {err:.3g} > {bound:.3g}"


# ---- extreme logits -------------------------------------------------------------------------
EXTREME = {
    # fp32 logits beyond +-1e4: integers |h| <= 30, |w| <= 100, H = 32, exact in fp32.
    "fp32_1e4": (torch.float32, 30, 100),
    # fp16 inputs whose logits (up to 32 * 64 * 256 = 524288) are far beyond fp16's 65504:
    # only the fp32 accumulator holds them; the buffered z - tile_max overflows to -inf where
    # the probability is 0 anyway.
    "fp16_beyond_range": (torch.float16, 64, 256),
}


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("case", list(EXTREME))
def test_extreme_logits(flce, case, reduction):
    dtype, h_max, w_max = EXTREME[case]
    gen = _gen(21)
    n, h, v = 20, 32, 90
    hidden = torch.randint(-h_max, h_max + 1, (n, h), generator=gen).float()
    weight = torch.randint(-w_max, w_max + 1, (v, h), generator=gen).float()
    targets = torch.randint(0, v, (n,), generator=gen).to(DEVICE)
    hidden, weight = _to((DEVICE, dtype), hidden, weight)
    # mean: the in-forward path (buffered logits); none with lse: the recomputing path.
    out = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction=reduction, return_metrics=True,
                                          return_lse=reduction == "none")
    loss, metrics = out[:2]
    grad_output = torch.full(loss.shape, 0.5)
    loss.backward(grad_output.to(DEVICE))
    ref = reference(hidden, weight, targets, reduction=reduction, grad_output=grad_output)
    z_max = ref.logits.abs().max().item()
    assert z_max > (6.6e4 if dtype == torch.float16 else 1e4)
    assert ref.num_ambiguous == 0  # integer logits: exact ties or gaps >= 1
    assert torch.isfinite(loss).all()
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss", floor=z_max)
    if reduction == "none":
        assert_rel(out[2], ref.lse, tolerance(torch.float32, "loss"), "lse")
    assert int(metrics["num_correct_tokens"]) == ref.num_correct
    assert_rel(metrics["entropy_sum"], ref.entropy_sum, 1e-5, "entropy_sum", floor=1.0)
    # Softmax is one-hot (or split exactly between tied maxima): the gradient is exact up to
    # the 16-bit rounding of the gradient products.
    for name, t, expected in (("hidden", hidden, ref.grad_hidden), ("weight", weight, ref.grad_weight)):
        assert torch.isfinite(t.grad).all()
        assert_rel(t.grad, expected, tolerance(dtype, "grad"), f"grad_{name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["in_forward", "recompute"])
def test_minus_inf_bias_entries(flce, tune, dtype, path):
    """-inf bias entries, among them a whole vocabulary tile: probability 0, exactly zero
    gradient in their weight rows and bias entries, no NaN anywhere."""
    tune(block_v=16)
    tune(chunk_rows=9)
    gen = _gen(22)
    n, h, v = 20, 24, 75
    masked = torch.zeros(v, dtype=torch.bool)
    masked[[2, 40, 74]] = True
    masked[16:32] = True  # the second tile entirely
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    bias = torch.randn(v, generator=gen).masked_fill(masked, float("-inf"))
    allowed = (~masked).nonzero()[:, 0]
    targets = allowed[torch.randint(0, len(allowed), (n,), generator=gen)].to(DEVICE)
    hidden, weight, bias = _to((DEVICE, dtype), hidden, weight, bias)
    reduction = "sum" if path == "in_forward" else "none"
    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction,
                                                    return_metrics=True, logit_scale=0.9, z_loss_scale=1e-3)
    loss.sum().backward()
    ref = reference(hidden, weight, targets, bias, reduction=reduction, logit_scale=0.9, z_loss_scale=1e-3,
                    grad_output=torch.ones(loss.shape))
    assert torch.isfinite(loss).all()
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    assert int(metrics["num_correct_tokens"]) == ref.num_correct and ref.num_ambiguous == 0
    assert_rel(metrics["entropy_sum"], ref.entropy_sum, tolerance(dtype, "loss"), "entropy_sum")
    for name, t, expected in (("hidden", hidden, ref.grad_hidden), ("weight", weight, ref.grad_weight),
                              ("bias", bias, ref.grad_bias)):
        assert torch.isfinite(t.grad).all(), f"grad_{name} not finite"
        assert_rel(t.grad, expected, tolerance(dtype, "grad"), f"grad_{name}")
    masked = masked.to(DEVICE)
    assert torch.count_nonzero(weight.grad[masked]) == 0 and torch.count_nonzero(bias.grad[masked]) == 0


# ---- logit_scale = 0 ----------------------------------------------------------------------------
@settings(max_examples=FEW_EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), h=st.integers(1, 48), v=st.integers(1, 150),
       dtype=dtypes, label_smoothing=st.sampled_from([0.0, 0.5]), z_loss_scale=st.sampled_from([0.0, 0.1]),
       reduction=st.sampled_from(["mean", "sum", "none"]))
def test_logit_scale_zero_is_uniform(flce, seed, n, h, v, dtype, label_smoothing, z_loss_scale, reduction):
    """All logits 0: uniform softmax, loss = lse = entropy = log V per row (plus k log(V)^2),
    argmax 0 (the first of V ties), and no gradient."""
    gen = _gen(seed)
    hidden, weight, bias = _to((DEVICE, dtype), torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen),
                               torch.randn(v, generator=gen))
    targets = torch.randint(0, min(v, 3), (n,), generator=gen)  # often 0, the argmax
    targets[0] = 0
    targets = targets.to(DEVICE)
    loss, metrics, lse = flce.fused_linear_cross_entropy(
        hidden, weight, targets, bias, logit_scale=0.0, reduction=reduction, label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale, return_metrics=True, return_lse=True)
    loss.sum().backward()
    log_v = math.log(v)
    row_loss = log_v + z_loss_scale * log_v**2
    expected = {"mean": torch.tensor(row_loss), "sum": torch.tensor(n * row_loss),
                "none": torch.full((n,), row_loss)}[reduction]
    tol = tolerance(torch.float32, "loss")  # no rounding but that of log V: any dtype
    assert_rel(loss, expected, tol, "loss", floor=1.0)
    assert_rel(lse, torch.full((n,), log_v), tol, "lse", floor=1.0)
    assert_rel(metrics["entropy_sum"], torch.tensor(n * log_v), tol, "entropy", floor=1.0)
    assert int(metrics["num_correct_tokens"]) == int((targets == 0).sum())
    for t in (hidden, weight, bias):
        assert torch.count_nonzero(t.grad) == 0


# ---- first and last vocabulary entries ----------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1, 64, 97])
def test_targets_first_and_last_entries(flce, dtype, v):
    """Targets 0 and V - 1 (the last, possibly partial, vocabulary tile), each row's loss."""
    gen = _gen(v)
    n, h = 12, 20
    hidden, weight, bias = _to((DEVICE, dtype), torch.randn(n, h, generator=gen),
                               torch.randn(v, h, generator=gen) / h**0.5, torch.randn(v, generator=gen))
    targets = torch.tensor([0, v - 1] * (n // 2), device=DEVICE)
    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="none",
                                                    return_metrics=True)
    grad_output = torch.linspace(-1, 1, n)
    loss.backward(grad_output.to(DEVICE))
    ref = reference(hidden, weight, targets, bias, reduction="none", grad_output=grad_output)
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss", floor=1.0)
    assert int(metrics["num_correct_tokens"]) == ref.num_correct and ref.num_ambiguous == 0
    for name, t, expected in (("hidden", hidden, ref.grad_hidden), ("weight", weight, ref.grad_weight),
                              ("bias", bias, ref.grad_bias)):
        assert_rel(t.grad, expected, tolerance(dtype, "grad"), f"grad_{name}", floor=1e-3)


# ---- determinism ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_two_calls_are_bitwise_equal(flce, tune, dtype, reduction):
    tune(chunk_rows=11)
    gen = _gen(23)
    inputs = (torch.randn(30, 40, generator=gen), torch.randn(97, 40, generator=gen) / 6,
              torch.randn(97, generator=gen))
    targets = torch.randint(0, 97, (30,), generator=gen).to(DEVICE)
    results = []
    for _ in range(2):
        hidden, weight, bias = _to((DEVICE, dtype), *inputs)
        # mean: gradients in the forward; none with lse: recomputed in the backward.
        loss, metrics, *lse = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction,
                                                              label_smoothing=0.1, return_metrics=True,
                                                              return_lse=reduction == "none")
        loss.sum().backward()
        results.append((loss.detach(), *metrics.values(), hidden.grad, weight.grad, bias.grad,
                        *(t.detach() for t in lse)))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


NON_FINITE = {  # where the bad value goes -> the rows whose loss PyTorch makes NaN
    "nan_in_hidden_row": "hidden",
    "inf_in_hidden_row": "hidden_inf",
    "nan_in_weight_row": "weight",
    "inf_in_bias": "bias",
}


@pytest.mark.parametrize("case", list(NON_FINITE))
def test_non_finite_inputs_give_nan_where_pytorch_does(flce, case):
    """NaN/inf in hidden, weight or bias: the per-row loss is NaN exactly where PyTorch's
    logits-based loss is, the other rows keep their values, and the rows of grad_hidden that
    PyTorch keeps finite are finite and equal; an ignored bad row costs nothing."""
    gen = _gen(41)
    n, h, v = 12, 24, 70
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    bias = torch.randn(v, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[7] = -100
    where = NON_FINITE[case]
    if where == "hidden":
        hidden[3, 5] = float("nan")
        hidden[7, 0] = float("nan")  # an ignored row: loss 0, no gradient anywhere from it
    elif where == "hidden_inf":
        hidden[4, 2] = float("inf")
    elif where == "weight":
        weight[9, 1] = float("nan")
    else:
        bias[11] = float("inf")
    hidden, weight, bias = _to((DEVICE, torch.float32), hidden, weight, bias)
    targets = targets.to(DEVICE)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="none")
    loss.backward(torch.ones_like(loss))

    h64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (hidden, weight, bias))
    ref = torch.nn.functional.cross_entropy(h64 @ w64.T + b64, targets.cpu(), reduction="none")
    ref.backward(torch.ones_like(ref))
    got = loss.detach().double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), (got, ref)
    finite = ~torch.isnan(ref)
    torch.testing.assert_close(got[finite], ref.detach()[finite], rtol=1e-5, atol=1e-5)
    # Ignored rows get exactly zero gradient here, even next to non-finite logits (PyTorch's
    # log_softmax backward gives them 0 * NaN = NaN); the other rows follow PyTorch.
    ignored = (targets == -100).cpu()
    if where != "weight":  # (0 @ a NaN weight is NaN: that is the matrix product, not the loss)
        assert torch.equal(hidden.grad.cpu()[ignored], torch.zeros_like(hidden.grad.cpu()[ignored]))
    rows_ok = torch.isfinite(h64.grad).all(dim=1) & ~ignored
    assert torch.equal(torch.isfinite(hidden.grad.cpu()).all(dim=1) & ~ignored, rows_ok)
    torch.testing.assert_close(hidden.grad.double().cpu()[rows_ok], h64.grad[rows_ok], rtol=1e-4, atol=1e-6)
