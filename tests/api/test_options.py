"""Options beyond the plain loss, against the float64 reference (tests/reference.py, which takes
PyTorch's own F.cross_entropy for the loss): per-class weights (F.cross_entropy's ``weight``),
the per-row predictions and per-token metrics, and int32 targets with an ``ignore_index``
outside the int32 range.

Each test runs on two paths: "kernels" (the Triton kernels: the GPU, or the interpreter on a
CPU) and "torch" (CPU tensors outside the interpreter: the chunked PyTorch path).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, DTYPES, assert_rel, make_inputs, tolerance
from reference import reference
from test_loss import check_grads, check_metrics, grad_output_for

N, H, V = 24, 40, 97


@pytest.fixture
def device(path):
    """The device of the path's tensors, on both paths (overrides conftest's fixture in this module)."""
    return path.device


def class_weights(v, device, seed=0):
    """Random class weights in [0.1, 3], some of them 0 (classes that do not count)."""
    weights = torch.rand(v, generator=torch.Generator().manual_seed(seed)) * 2.9 + 0.1
    weights[::7] = 0.0
    return weights.to(device)


# ---- class weights ------------------------------------------------------------------------------
# Each case: options, how the inputs are made, settings (``_settings.override``). Without label
# smoothing, mean and sum compute their gradients in the forward; with it, and with
# reduction "none" or lse, they are recomputed in the backward.
WEIGHT_CASES = {
    "mean": dict(ignore=0.2),
    "sum_bias_z_loss": dict(reduction="sum", bias=True, z_loss_scale=1e-2),
    "none": dict(reduction="none", ignore=0.2),
    "mean_smoothing": dict(label_smoothing=0.2, ignore=0.2),
    "sum_smoothing_softcap_lse": dict(reduction="sum", bias=True, label_smoothing=0.1, softcap=4.0, logit_scale=1.5,
                                      z_loss_scale=1e-3, return_lse=True),
    "none_smoothing_chunks": dict(reduction="none", label_smoothing=0.3, bias=True, settings=dict(chunk_rows=7)),
    "mean_chunks": dict(bias=True, ignore=0.2, settings=dict(chunk_rows=7)),
}


def _run_weighted(flce, tune, case, device, dtype):
    c = dict(WEIGHT_CASES[case])
    tune(**c.pop("settings", {}))
    make = {k: c.pop(k) for k in ("bias", "ignore") if k in c}
    return_lse = c.pop("return_lse", False)
    hidden, weight, targets, bias = make_inputs(N, H, V, dtype, seed=sum(map(ord, case)), device=device, **make)
    targets[1:3] = torch.tensor([7, 14])  # classes of weight 0
    weights = class_weights(V, device)
    out = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, class_weight=weights, return_metrics=True,
                                          return_lse=return_lse, **c)
    loss, metrics = out[:2]
    grad_output = grad_output_for(loss, 0.7)
    total = (loss * grad_output).sum()
    lse_grad = None
    if return_lse:
        lse_grad = torch.linspace(-0.5, 1.0, N)
        total = total + (out[2] * lse_grad.to(device)).sum()
    total.backward()
    ref = reference(hidden, weight, targets, bias, class_weight=weights, grad_output=grad_output.cpu(),
                    lse_grad=lse_grad, **c)
    return (hidden, weight, bias), targets, weights, loss, metrics, out, ref, c


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_class_weight_matches_pytorch(flce, tune, device, case):
    """F.cross_entropy(weight=...)'s loss (a mean divides by the sum of the non-ignored targets'
    weights; label smoothing weighted as PyTorch weights it), its gradients, and unweighted
    metrics; the z-loss of a row is weighted by its target's class weight."""
    tensors, targets, weights, loss, metrics, out, ref, c = _run_weighted(flce, tune, case, device,
                                                                           torch.float32)
    assert weights[targets[1:3]].eq(0).all() and weights[targets.clamp(0)].ne(0).any()
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    if len(out) == 3:
        assert_rel(out[2], ref.lse, tolerance(torch.float32, "loss"), "lse")
    check_metrics(metrics, ref, torch.float32, c.get("reduction", "mean"))
    check_grads(tensors, ref, torch.float32)


@pytest.mark.parametrize("dtype", [p for p in DTYPES if p.id != "fp32"])
@pytest.mark.parametrize("case", ["mean", "mean_smoothing"])
def test_class_weight_16_bit(flce, tune, case, dtype):
    """16-bit inputs on the kernels' two gradient paths (computed in the forward, recomputed)."""
    tensors, _, _, loss, metrics, _, ref, c = _run_weighted(flce, tune, case, DEVICE, dtype)
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    check_metrics(metrics, ref, dtype, c.get("reduction", "mean"))
    check_grads(tensors, ref, dtype)


def test_uniform_class_weight_is_no_weight(flce, device):
    """Weights all equal to c: a mean is the unweighted mean (the z-loss too, which is never
    weighted), with the same gradients, and without a z-loss each row's loss is c times the
    unweighted one."""
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=3, device=device, bias=True, ignore=0.2)
    for reduction, factor, z_loss_scale in (("mean", 1.0, 1e-2), ("none", 2.5, 0.0)):
        kwargs = dict(label_smoothing=0.1, z_loss_scale=z_loss_scale)
        results = []
        for weights in (None, torch.full((V,), 2.5, device=device)):
            for t in (hidden, weight, bias):
                t.grad = None
            loss = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction,
                                                   class_weight=weights, **kwargs)
            loss.sum().backward()
            results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()))
        unweighted, weighted = results
        for name, a, b in zip(("loss", "grad_hidden", "grad_weight", "grad_bias"), weighted, unweighted, strict=True):
            assert_rel(a, factor * b, tolerance(torch.float32, "loss"), name)


# ---- z-loss with class weights: Liger-Kernel's convention ------------------------------------------
def _weighted_ce_plus_z_loss(hidden, weight, targets, bias, class_weight, reduction, label_smoothing, z_loss_scale,
                             grad_output, lse_grad=None):
    """float64 loss and gradients (hidden, weight, bias) from the formula: PyTorch's class-weighted
    cross-entropy (label smoothing as PyTorch combines it) plus the z-loss k lse_i^2 unweighted,
    summed over the non-ignored rows, divided by their count for "mean"."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (hidden, weight, bias)]
    h, w, b = leaves
    logits = h @ w.T + b
    t = targets.cpu()
    valid = t != -100
    ce = F.cross_entropy(logits, t, weight=class_weight.cpu().double(), reduction=reduction,
                         label_smoothing=label_smoothing)
    lse = torch.logsumexp(logits, dim=1)
    z_loss = torch.where(valid, z_loss_scale * lse**2, 0.0)
    loss = {"none": ce + z_loss, "sum": ce + z_loss.sum(), "mean": ce + z_loss.sum() / valid.sum()}[reduction]
    out = (loss * grad_output.cpu().double()).sum()
    if lse_grad is not None:
        out = out + (lse * lse_grad.cpu().double()).sum()
    return loss.detach(), torch.autograd.grad(out, leaves)


Z_LOSS_CASES = {
    "mean": dict(reduction="mean"),  # (recomputed in the backward: the in-forward pass weights its z-loss term)
    "sum_lse": dict(reduction="sum", return_lse=True),
    "none": dict(reduction="none"),
    "mean_smoothing": dict(reduction="mean", label_smoothing=0.2),
}


@pytest.mark.parametrize("case", list(Z_LOSS_CASES))
def test_z_loss_is_not_class_weighted(flce, device, case):
    """With class weights the z-loss k lse_i^2 is unweighted, as Liger-Kernel's fused linear
    cross-entropy adds it: "mean" is sum_i w_ti CE_i / sum_i w_ti + k sum_i lse_i^2 / n_valid. Rows
    of weight-0 classes (rows 1 and 2) have no cross-entropy but their z-loss and its gradient."""
    c = dict(Z_LOSS_CASES[case])
    return_lse = c.pop("return_lse", False)
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=31, device=device, bias=True, ignore=0.2)
    targets[1:3] = torch.tensor([7, 14])  # classes of weight 0
    weights = class_weights(V, device)
    z_loss_scale = 0.05  # a z-loss of about a quarter of the cross-entropy (lse ~ 5): weighting it shows
    out = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, class_weight=weights,
                                          z_loss_scale=z_loss_scale, return_lse=return_lse, **c)
    loss = out[0] if return_lse else out
    grad_output = grad_output_for(loss, 0.7)
    total = (loss * grad_output).sum()
    lse_grad = torch.linspace(-0.5, 1.0, N) if return_lse else None
    if return_lse:
        total = total + (out[1] * lse_grad.to(device)).sum()
    total.backward()
    expected, grads = _weighted_ce_plus_z_loss(hidden, weight, targets, bias, weights, c["reduction"],
                                               c.get("label_smoothing", 0.0), z_loss_scale, grad_output, lse_grad)
    assert_rel(loss, expected, tolerance(torch.float32, "loss"), "loss")
    for name, tensor, grad in zip(("hidden", "weight", "bias"), (hidden, weight, bias), grads, strict=True):
        assert_rel(tensor.grad, grad, tolerance(torch.float32, "grad"), f"grad_{name}")


# ---- predictions and per-token metrics -----------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_predictions_and_per_token_metrics(flce, tune, device, reduction):
    """``predictions``: the argmax of each row (-1 on ignored rows), int64 of the targets' shape;
    with reduction "none" also the correct-token mask and the entropy per row, which sum to
    the metrics' sums. Several chunks of rows; (B, T) leading dims."""
    tune(chunk_rows=5)
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=8, device=device, lead=(3, 8), ignore=0.3)
    # some rows right: their target is their argmax
    logits = hidden.detach().double() @ weight.detach().double().T
    targets = torch.where(torch.arange(24, device=device).reshape(3, 8) % 3 == 0, logits.argmax(-1), targets)
    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction=reduction, return_metrics=True)
    ref = reference(hidden, weight, targets, reduction=reduction)
    assert ref.num_correct >= 5 and ref.predictions.shape == (3, 8)
    check_metrics(metrics, ref, torch.float32, reduction)
    if reduction == "none":
        assert int(metrics["correct_tokens"].sum()) == int(metrics["num_correct_tokens"])
        assert_rel(metrics["entropy"].sum(), metrics["entropy_sum"], 1e-6, "entropy sums")
        ignored = targets == -100
        assert not metrics["correct_tokens"][ignored].any() and torch.all(metrics["entropy"][ignored] == 0)


def test_predictions_of_a_vocabulary_of_one(flce, device):
    hidden, weight, targets, _ = make_inputs(4, H, 1, torch.float32, seed=2, device=device)
    _, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)
    assert torch.equal(metrics["predictions"].cpu(), torch.zeros(4, dtype=torch.int64))


# ---- int32 targets and an ignore_index outside their range ------------------------------------
@pytest.mark.parametrize("ignore_index", [2**32, -(2**31) - 1, 2**40 + 7])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_int32_targets_with_ignore_index_beyond_int32(flce, device, ignore_index, reduction):
    """No int32 target can equal such an ignore_index: nothing is ignored (it is compared in
    int64, not wrapped to an int32 value such as 0 or -1, which would ignore real targets), and
    int32 targets give exactly what int64 targets give."""
    results = []
    for target_dtype in (torch.int64, torch.int32):
        hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=4, device=device,
                                                 target_dtype=target_dtype)
        targets[:4] = 0  # 2**32 wraps to 0 in int32
        targets[4] = V - 1  # -2**31 - 1 wraps to 2**31 - 1
        loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index,
                                                        reduction=reduction, return_metrics=True)
        loss.sum().backward()
        results.append((loss.detach(), metrics["num_correct_tokens"], hidden.grad, weight.grad))
    ref = reference(hidden, weight, targets, ignore_index=ignore_index, reduction=reduction,
                    grad_output=torch.ones(loss.shape))
    assert_rel(results[1][0], ref.loss, tolerance(torch.float32, "loss"), "loss")
    assert_rel(results[1][2], ref.grad_hidden, tolerance(torch.float32, "grad"), "grad_hidden")
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("ignore_index", [2**32, -(2**31) - 1])
def test_int32_targets_with_shift_and_ignore_index_beyond_int32(flce, device, ignore_index):
    """``shift`` pads the last position's target with ignore_index: int32 targets are taken to
    int64 before that (an int32 pad of 2**32 overflowed), and give the loss and gradient of the
    explicitly shifted targets, with none of the last positions' hidden gradient."""
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=9, device=device, lead=(2, 12),
                                             target_dtype=torch.int32)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, shift=1)
    loss.backward()
    kept_hidden = hidden.detach()[:, :-1].clone().requires_grad_()
    ref = reference(kept_hidden, weight, targets[:, 1:].long(), ignore_index=ignore_index,
                    grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    assert_rel(hidden.grad[:, :-1], ref.grad_hidden, tolerance(torch.float32, "grad"), "grad_hidden")
    assert torch.equal(hidden.grad[:, -1], torch.zeros_like(hidden.grad[:, -1]))
