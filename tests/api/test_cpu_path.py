"""Plain CPU tensors outside the Triton interpreter take the chunked PyTorch path (the backend is
chosen per call): random problems with every option match the float64 reference there, its
chunks keep the fp32 logits and their one temporary within the buffer's MiB, and a few training
steps of a tiny model with the fused causal-LM loss give the same losses, metrics, gradients and
weights on that path, on the interpreter path, and with the model's own logits-based loss."""

import copy

import pytest
import torch
from _tiny import assert_grads_close, grads, logits_metrics, tiny_batch, tiny_causal_lm
from conftest import assert_rel, env, submodule, tolerance
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference


@st.composite
def problems(draw):
    v = draw(st.integers(1, 150))
    return dict(
        n=draw(st.integers(1, 40)), h=draw(st.integers(1, 48)), v=v, seed=draw(st.integers(0, 2**31 - 1)),
        dtype=draw(st.sampled_from([torch.float32, torch.float16])), bias=draw(st.booleans()),
        minus_inf_bias=draw(st.booleans()), ignore=draw(st.sampled_from([0.0, 0.3, 1.0])),
        chunk_rows=draw(st.one_of(st.none(), st.integers(1, 16))), return_lse=draw(st.booleans()),
        options=dict(
            reduction=draw(st.sampled_from(["mean", "sum", "none"])),
            logit_scale=draw(st.sampled_from([1.0, 0.25, -0.8])),
            softcap=draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
            label_smoothing=draw(st.sampled_from([0.0, 0.2])),
            z_loss_scale=draw(st.sampled_from([0.0, 1e-2])),
            return_metrics=draw(st.booleans()),
        ),
    )


@settings(max_examples=60, deadline=None)
@given(problems())
def test_torch_path_matches_reference(flce, p):
    """The PyTorch path (exponentials and grad logits made in place in the chunk buffer) against
    the float64 reference, on both gradient paths (in the forward; recomputed for "none" or lse)."""
    n, h, v, dtype, opts = p["n"], p["h"], p["v"], p["dtype"], p["options"]
    gen = torch.Generator().manual_seed(p["seed"])
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) / h**0.5
    bias = torch.randn(v, generator=gen) if p["bias"] else None
    targets = torch.randint(0, v, (n,), generator=gen)
    # a column of probability 0, never a target (a negative logit_scale would make it +inf)
    if bias is not None and p["minus_inf_bias"] and v > 1 and opts["logit_scale"] > 0:
        bias[v // 2] = float("-inf")
        targets[targets == v // 2] = 0
    targets[torch.rand(n, generator=gen) < p["ignore"]] = -100
    hidden, weight, bias = (None if t is None else t.to(dtype).requires_grad_() for t in (hidden, weight, bias))
    with env(TRITON_INTERPRET=0), submodule(flce, "_settings").override(chunk_rows=p["chunk_rows"]):
        out = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_lse=p["return_lse"], **opts)
        out = out if isinstance(out, tuple) else (out,)
        loss = out[0]
        grad_output = torch.randn(loss.shape, generator=gen) if loss.dim() else torch.tensor(0.9)
        lse_grad = torch.randn(n, generator=gen) if p["return_lse"] else None
        total = (loss * grad_output).sum() + (0 if lse_grad is None else (out[-1] * lse_grad).sum())
        total.backward()
    num_valid = int((targets != -100).sum())
    nan_mean = opts["reduction"] == "mean" and num_valid == 0  # NaN loss, zero gradient (PyTorch: NaN)
    ref = reference(hidden, weight, targets, bias, grad_output=None if nan_mean else grad_output, lse_grad=lse_grad,
                    **{k: val for k, val in opts.items() if k != "return_metrics"})
    # Error scales as in test_properties.py: rounding relative to the logits, and to one grad logit.
    finite = ref.logits[ref.logits.isfinite()]
    z_max = 1.0 + (finite.abs().max().item() if finite.numel() else 0.0)
    z_loss_factor = 1.0 + 2.0 * opts["z_loss_scale"] * z_max
    tol, grad_tol = tolerance(dtype, "loss"), tolerance(dtype, "grad")
    rows = num_valid if opts["reduction"] == "sum" else 1
    assert_rel(loss, ref.loss, tol, "loss", floor=rows * z_max * z_loss_factor)
    if p["return_lse"]:
        assert_rel(out[-1], ref.lse, tol, "lse", floor=z_max)
    if opts["return_metrics"]:
        metrics = out[1]
        assert int(metrics["num_valid_tokens"]) == num_valid
        assert_rel(metrics["entropy_sum"], ref.entropy_sum, tol, "entropy_sum", floor=max(num_valid, 1) * z_max)
        correct = int(metrics["num_correct_tokens"])
        assert ref.num_correct_unambiguous <= correct <= ref.num_correct_unambiguous + ref.num_ambiguous
    if nan_mean and lse_grad is None:
        assert all(t is None or torch.count_nonzero(t.grad) == 0 for t in (hidden, weight, bias))
        return
    row_grad = 0.0 if nan_mean else grad_output.abs().max().item() / (num_valid if opts["reduction"] == "mean" else 1)
    row_grad += 0.0 if lse_grad is None else lse_grad.abs().max().item()
    g = abs(opts["logit_scale"]) * row_grad * z_loss_factor
    for name, t, expected, other in (("hidden", hidden, ref.grad_hidden, weight),
                                     ("weight", weight, ref.grad_weight, hidden), ("bias", bias, ref.grad_bias, None)):
        if t is not None:
            floor = g * (1.0 if other is None else other.detach().abs().max().item())
            assert t.grad.dtype == dtype and torch.isfinite(t.grad).all()
            assert_rel(t.grad, expected, grad_tol, f"grad_{name}", floor=max(floor, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [97, 32000, 128256])
def test_torch_path_chunks_fit_the_buffer_size(flce, tune, dtype, vocab_size):
    """Rows per chunk: the fp32 logits, one fp32 temporary of their size and (16-bit inputs) the
    grad logits in that dtype fit in ``buffer_mib``, with as many rows as fit (at least one)."""
    plan = submodule(flce, "_plan")
    per_row = vocab_size * (8 + (dtype.itemsize if dtype.itemsize < 4 else 0))
    for mib in (4, 256):
        tune(buffer_mib=mib, chunk_rows=None)
        rows = plan.chunk_rows("torch", 10**6, vocab_size, dtype, True)
        assert rows * per_row <= mib * 2**20
        assert rows == 4096 or (rows + 1) * per_row > mib * 2**20  # as many as fit, up to chunk_rows' 4096
        assert plan.chunk_rows("torch", 2, vocab_size, dtype, True) == 2  # never more rows than there are
    tune(buffer_mib=0)
    assert plan.chunk_rows("torch", 10**6, vocab_size, dtype, True) == 1


pytest.importorskip("transformers")


def test_cpu_training_loop_matches_interpreter_and_model_loss(flce, monkeypatch):
    base = tiny_causal_lm("gemma2-softcap")
    batches = [tiny_batch(base, seed=seed) for seed in range(3)]
    runs = {  # name -> (TRITON_INTERPRET, model)
        "own loss": (None, copy.deepcopy(base)),
        "interpreter": ("1", flce.patch_forward(copy.deepcopy(base))),
        "torch": ("0", flce.patch_forward(copy.deepcopy(base))),
    }
    if torch.cuda.is_available():  # the kernels were decorated for the GPU: no interpreter here
        del runs["interpreter"]
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.5) for name, (_, model) in runs.items()}

    for batch in batches:
        step = {}
        for name, (interpret, model) in runs.items():
            if interpret is not None:
                monkeypatch.setenv("TRITON_INTERPRET", interpret)
            optimizers[name].zero_grad()
            out = model(**batch) if interpret is None else model(**batch, return_metrics=True)
            out.loss.backward()
            metrics = logits_metrics(out.logits.detach(), batch["labels"]) if interpret is None else out.metrics
            step[name] = (out.loss.detach(), grads(model), metrics)
            optimizers[name].step()

        ref_loss, ref_grads, ref_metrics = step["own loss"]
        for name in [n for n in ("interpreter", "torch") if n in step]:
            loss, _, metrics = step[name]
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
            assert_grads_close(runs[name][1], ref_grads)
            assert int(metrics["num_correct_tokens"]) == ref_metrics["num_correct_tokens"]
            assert int(metrics["num_valid_tokens"]) == ref_metrics["num_valid_tokens"]
            assert float(metrics["entropy_sum"]) == pytest.approx(ref_metrics["entropy_sum"], rel=1e-5)
        # the two fused paths agree more tightly with each other than with the logits
        if "interpreter" in step:
            torch.testing.assert_close(step["torch"][0], step["interpreter"][0], rtol=2e-6, atol=0)

    own = dict(runs["own loss"][1].named_parameters())
    assert any(not torch.equal(p, dict(base.named_parameters())[n]) for n, p in own.items())  # it trained
    for name in [n for n in ("interpreter", "torch") if n in runs]:
        for param_name, p in runs[name][1].named_parameters():
            torch.testing.assert_close(p, own[param_name], rtol=1e-5, atol=1e-6)
