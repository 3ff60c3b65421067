"""Numerical edge cases that used to give silently wrong results: a huge softcap (the kernels'
tanh), the recomputed gradient of a row that follows an ignored one at large logits, predictions
of rows with NaN logits, and bf16 in Triton's interpreter.

"kernels": the Triton kernels (the GPU, or the interpreter on a CPU); "torch": CPU tensors
outside the interpreter (the chunked PyTorch path).
"""

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, HAS_CUDA, assert_rel, make_inputs, submodule, tolerance
from reference import reference


@pytest.fixture
def device(path):
    """The device of the path's tensors, on both paths (overrides conftest's fixture in this module)."""
    return path.device


# ---- tanh of the softcap ------------------------------------------------------------------------
@triton.jit
def _apply_kernel(x_ptr, out_ptr, n, fn: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = fn(x[i]) for a @triton.jit elementwise ``fn``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, fn(tl.load(x_ptr + offs, mask=mask, other=0.0)), mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_kernel_tanh_is_accurate_for_every_x(flce, dtype):
    """The kernels' tanh against float64 torch.tanh of the same inputs, relative: within 4
    roundings of the dtype for |x| from 1e-30 to 30, on both sides of the polynomial's bound (the
    method gives about 2; the fp64 reference adds its own rounding), and exact at 0, +-inf, NaN.
    The former 1 - 2 / (exp(2x) + 1) was off by a rounding of 1, i.e. 1e-3 relative at x = 1e-4
    and a 100% error below 6e-8."""
    magnitudes = torch.cat([torch.logspace(-30, 1.5, 3000, dtype=torch.float64),
                            torch.linspace(0.55, 0.7, 301, dtype=torch.float64)])
    x = torch.cat([magnitudes, -magnitudes]).to(dtype)
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)])
    x = x.to(DEVICE)
    out = torch.empty_like(x)
    kernels = submodule(flce, "_kernel_math")
    _apply_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), fn=kernels._tanh, BLOCK=256)
    expected = torch.tanh(x.double()).cpu()
    out = out.double().cpu()
    special = ~torch.isfinite(x.cpu()) | (x.cpu() == 0)
    assert torch.equal(out[special].nan_to_num(7.0), expected[special].nan_to_num(7.0))
    rounding = 2.0 ** -(24 if dtype == torch.float32 else 53)
    error = ((out - expected).abs() / expected.abs())[~special]
    assert error.max().item() <= 4 * rounding, f"max relative error {error.max().item():.3g}"


@pytest.mark.parametrize("softcap", [1e6, 1e30])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_huge_softcap_is_no_softcap(flce, device, softcap, reduction):
    """A softcap far above the logits changes them by less than a rounding: the loss and
    gradients of fp32 inputs match the float64 reference at fp32 tolerance, on both gradient paths
    (in the forward for "mean", recomputed for "none"). The kernels' former tanh put an error of
    about softcap x 6e-8 on every logit (6.6e-3 on the loss at 1e6) and made 1e30's uniform."""
    hidden, weight, targets, bias = make_inputs(16, 32, 70, torch.float32, seed=11, device=device, bias=True,
                                                scale=3.0)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, softcap=softcap, reduction=reduction)
    grad_output = torch.linspace(-1.0, 1.0, 16) if reduction == "none" else torch.tensor(0.8)
    (loss * grad_output.to(device)).sum().backward()
    ref = reference(hidden, weight, targets, bias, softcap=softcap, reduction=reduction, grad_output=grad_output)
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    for name, tensor, expected in (("hidden", hidden, ref.grad_hidden), ("weight", weight, ref.grad_weight),
                                   ("bias", bias, ref.grad_bias)):
        assert_rel(tensor.grad, expected, tolerance(torch.float32, "grad"), f"grad_{name}")


# ---- the recomputed gradient of large logits ----------------------------------------------------
@pytest.mark.parametrize("scale", [1e4, 1e5])
def test_recomputed_gradient_after_an_ignored_row(flce, monkeypatch, scale):
    """reduction "none" recomputes the logits in the backward, every row in place, where the
    forward gathered the rows with a loss (and plans its chunks otherwise). BLAS rounds a row's
    logits differently in another shape or row position, and at |z| ~ 1e4 a rounding is 1e-3: a
    softmax normalised by the forward's lse carried it into the gradient (3.5e-4 relative at 1e4,
    1.1e-2 at 3.6e5, where "sum", which takes its gradient from the forward's own logits, gives
    6e-8). Every row's top two logits are more than 20 apart, so p is 0 or 1 to within e^-20 and
    the fp32 tolerance holds whatever the rounding of z."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the PyTorch path
    n = 10
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, 64, generator=gen).requires_grad_()
    weight = (torch.randn(97, 64, generator=gen) * (scale / 8)).requires_grad_()
    targets = torch.randint(0, 97, (n,), generator=gen)
    targets[3] = -100
    top2 = (hidden.detach().double() @ weight.detach().double().T).topk(2, dim=1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 20, "the seed gives near-ties: p depends on the rounding of z"
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    grad_output = torch.linspace(0.5, 1.5, n)
    (loss * grad_output).sum().backward()
    ref = reference(hidden, weight, targets, reduction="none", grad_output=grad_output)
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    assert_rel(hidden.grad, ref.grad_hidden, tolerance(torch.float32, "grad"), "grad_hidden")
    assert_rel(weight.grad, ref.grad_weight, tolerance(torch.float32, "grad"), "grad_weight")


# ---- predictions of NaN logits ------------------------------------------------------------------
def _nan_cases(hidden, weight, bias):
    """(name, hidden, weight, bias) with NaN logits: a NaN column in a later vocabulary tile than
    the rows' max (BLOCK_V is 32 in the interpreter), two NaN columns (the first one wins), rows
    all NaN, and a row of +-inf with one NaN (0 x inf) among them."""
    later = bias.clone()
    later[70] = float("nan")
    two = bias.clone()
    two[[40, 5]] = float("nan")
    all_nan = hidden.clone()
    all_nan[[2, 5]] = float("nan")
    inf_row, zero_column = hidden.clone(), weight.clone()
    inf_row[1, 0] = float("inf")
    zero_column[77, 0] = 0.0  # row 1: +-inf everywhere, NaN at column 77
    return [("column_in_a_later_tile", hidden, weight, later), ("two_columns", hidden, weight, two),
            ("all_nan_rows", all_nan, weight, bias), ("nan_among_infinities", inf_row, zero_column, bias)]


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's tl.max
def test_predictions_of_nan_logits_are_torch_argmax(flce, device, path):
    """predictions equal torch.argmax of the logits: the first NaN of a row where it has one, else
    the first max. The kernels' tile argmax used to skip a NaN column and give an all-NaN row the
    prediction V (a padding column of the last tile). The kernels' sweep takes a NaN for +inf (one
    select a logit, where telling the two apart would cost a second reduction): a row with +inf
    and NaN logits, whose loss is NaN, predicts its first +inf or NaN column."""
    hidden, weight, targets, bias = make_inputs(6, 16, 100, torch.float32, seed=5, device=device, bias=True,
                                                requires_grad=False)
    kernels = path.name == "kernels"
    for name, h, w, b in _nan_cases(hidden, weight, bias):
        _, metrics = flce.fused_linear_cross_entropy(h, w, targets, b, return_metrics=True)
        logits = h.cpu().double() @ w.cpu().double().T + b.cpu().double()
        assert logits.isnan().any(), name
        expected = logits.argmax(dim=1)
        if kernels:
            special = logits.isnan() | (logits == float("inf"))
            expected = torch.where(special.any(dim=1), special.to(torch.int8).argmax(dim=1), expected)
        assert torch.equal(metrics["predictions"].cpu(), expected), name


# ---- bf16 in Triton's interpreter ---------------------------------------------------------------
@pytest.mark.skipif(HAS_CUDA, reason="the kernels run in the interpreter only where there is no CUDA (conftest)")
def test_bf16_in_the_interpreter_raises(flce, monkeypatch):
    """Triton's interpreter gets bf16 tl.dot wrong (a loss of 3.7e9 for 4.0): refused with the
    way out, and the PyTorch path (TRITON_INTERPRET unset) takes the same call."""
    hidden, weight, targets, _ = make_inputs(8, 16, 40, torch.bfloat16, seed=1, requires_grad=False)
    with pytest.raises(ValueError, match=r"hidden is bfloat16, which cannot run in Triton's interpreter .*unset "
                                         r"TRITON_INTERPRET"):
        flce.fused_linear_cross_entropy(hidden, weight, targets)
    monkeypatch.delenv("TRITON_INTERPRET")
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets)
    # bf16 inputs, fp32 products and softmax: the reference takes the same rounded inputs
    assert_rel(loss, reference(hidden, weight, targets).loss, 1e-5, "loss")
