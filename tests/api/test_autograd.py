"""Autograd beyond one backward: float64 gradcheck of every option, second-order uses (a clear
error, never a silently wrong gradient), in-place changes between the forward and the backward
(PyTorch's F.linear + F.cross_entropy is the oracle), and the torch.func transforms.

Each test runs on two paths: "kernels" (the Triton kernels: the GPU, or the interpreter on a
CPU) and "torch" (CPU tensors outside the interpreter: the chunked PyTorch path).
"""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_rel, make_inputs, tolerance
from reference import reference

N, H, V = 5, 4, 7
def _interpreted(path) -> bool:
    return path == ("kernels", "cpu")


def _class_weight(v, device, dtype=torch.float64, seed=3):
    """Random class weights in [0.2, 2], one of them 0 (a class that does not count)."""
    weights = torch.rand(v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 1.8 + 0.2
    weights[1] = 0.0
    return weights.to(device, dtype)


# ---- float64 gradcheck --------------------------------------------------------------------------
# Each case: options, whether a bias is used, rows of ignore_index, and whether lse is returned
# (its gradient then flows too).
GRADCHECK_CASES = {
    "mean": dict(),
    "sum_bias": dict(reduction="sum", bias=True),
    "none_bias_ignored": dict(reduction="none", bias=True, ignore=0.3),
    "softcap_logit_scale": dict(bias=True, softcap=2.0, logit_scale=0.7),
    "label_smoothing": dict(reduction="sum", label_smoothing=0.2, ignore=0.3),
    "z_loss": dict(bias=True, z_loss_scale=0.05),
    "return_lse": dict(reduction="none", bias=True, return_lse=True, label_smoothing=0.1),
    "class_weight": dict(bias=True, class_weight=True, ignore=0.3),
    "class_weight_smoothing_zloss_softcap": dict(bias=True, class_weight=True, label_smoothing=0.3,
                                                 z_loss_scale=0.02, softcap=3.0, return_lse=True),
}


def _gradcheck_problem(case, device, seed=0):
    c = dict(GRADCHECK_CASES[case])
    bias, ignore, return_lse = c.pop("bias", False), c.pop("ignore", 0.0), c.pop("return_lse", False)
    if c.pop("class_weight", False):
        c["class_weight"] = _class_weight(V, device)
    hidden, weight, targets, b = make_inputs(N, H, V, torch.float64, seed=seed, device=device, bias=bias,
                                             ignore=ignore, scale=2.0)
    inputs = tuple(t for t in (hidden, weight, b) if t is not None)

    def loss_fn(flce):
        def fn(*tensors):
            h, w, *rest = tensors
            out = flce.fused_linear_cross_entropy(h, w, targets, rest[0] if rest else None, return_lse=return_lse,
                                                  **c)
            return out
        return fn

    return loss_fn, inputs


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck(flce, path, case):
    """The analytical gradients (the backward, recomputed in float64) against finite differences of
    the float64 forward, for hidden, weight and bias. The interpreter is slow: there gradcheck's
    fast mode (a random projection of the Jacobian) instead of the whole Jacobian."""
    loss_fn, inputs = _gradcheck_problem(case, path[1])
    assert torch.autograd.gradcheck(loss_fn(flce), inputs, fast_mode=_interpreted(path))


@pytest.mark.parametrize("case", ["mean", "return_lse", "class_weight_smoothing_zloss_softcap"])
def test_gradgradcheck_raises_a_clear_error(flce, path, case):
    loss_fn, inputs = _gradcheck_problem(case, path[1])
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.gradgradcheck(loss_fn(flce), inputs, fast_mode=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float64_matches_reference(flce, path, reduction):
    """float64 in, float64 out: loss, lse, metrics and gradients at float64 accuracy. (The Triton
    kernels take their scalar options, here logit_scale and label smoothing, in float32: a
    relative 6e-8 on the logits and smoothing terms.)"""
    _, device = path
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float64, seed=5, device=device, bias=True,
                                                ignore=0.3)
    kwargs = dict(reduction=reduction, logit_scale=0.9, label_smoothing=0.1, z_loss_scale=1e-2)
    loss, metrics, lse = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True,
                                                         return_lse=True, **kwargs)
    grad_output = torch.linspace(-1, 1, loss.numel(), dtype=torch.float64).reshape(loss.shape)
    (loss * grad_output.to(device)).sum().backward()
    ref = reference(hidden, weight, targets, bias, grad_output=grad_output, **kwargs)
    assert loss.dtype == lse.dtype == metrics["entropy_sum"].dtype == torch.float64
    assert hidden.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.float64
    tol = 1e-6 if path[0] == "kernels" else 1e-12
    assert_rel(loss, ref.loss, tol, "loss")
    assert_rel(lse, ref.lse, tol, "lse")
    assert_rel(metrics["entropy_sum"], ref.entropy_sum, tol, "entropy_sum")
    assert int(metrics["num_correct_tokens"]) == ref.num_correct and not ref.ambiguous.any()
    for name, t, expected in (("hidden", hidden, ref.grad_hidden), ("weight", weight, ref.grad_weight),
                              ("bias", bias, ref.grad_bias)):
        assert_rel(t.grad, expected, tol, f"grad_{name}")


def test_float64_stays_float64_under_autocast(flce, path):
    """As F.linear's: autocast leaves float64 inputs as they are."""
    _, device = path
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float64, seed=6, device=device)
    with torch.autocast(device, dtype=torch.bfloat16 if device == "cuda" else torch.float16):
        assert F.linear(hidden, weight).dtype == torch.float64
        loss = flce.fused_linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    assert loss.dtype == hidden.grad.dtype == torch.float64
    ref = reference(hidden, weight, targets, grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, 1e-12, "loss")
    assert_rel(hidden.grad, ref.grad_hidden, 1e-12, "grad_hidden")


# ---- second order: a clear error on every path --------------------------------------------------
# reduction / lse / class weights with smoothing pick the gradient path: computed in the forward
# ("mean", "sum") or recomputed in the backward (the others).
ORDER_CASES = {
    "mean_in_forward": dict(),
    "sum_in_forward": dict(reduction="sum"),
    "none_recomputed": dict(reduction="none"),
    "lse_recomputed": dict(return_lse=True),
    "class_weight_smoothing_recomputed": dict(class_weight=True, label_smoothing=0.1),
}


def _order_problem(case, device):
    c = dict(ORDER_CASES[case])
    if c.pop("class_weight", False):
        c["class_weight"] = _class_weight(V, device, torch.float32)
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=11, device=device, bias=True)
    return hidden, weight, targets, bias, c


def _loss(flce, hidden, weight, targets, bias, options):
    out = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, **options)
    return (out[0] + out[1].sum()) if options.get("return_lse") else out.sum()


def _reference_objective(hidden, weight, targets, bias, options):
    """The same objective from materialised logits, with PyTorch's own ops."""
    logits = F.linear(hidden, weight, bias)
    kwargs = {k: v for k, v in options.items() if k in ("reduction", "label_smoothing")}
    if "class_weight" in options:
        kwargs["weight"] = options["class_weight"]
    loss = F.cross_entropy(logits, targets, **kwargs).sum()
    return loss + torch.logsumexp(logits, -1).sum() if options.get("return_lse") else loss


@pytest.mark.parametrize("case", list(ORDER_CASES))
def test_gradient_penalty_raises_a_clear_error(flce, path, case):
    """A backward with create_graph=True (here a gradient penalty's) raises, naming the
    limitation and what to use instead, rather than returning gradients that autograd would
    take for constants (PyTorch's own loss gives the penalty a second term)."""
    hidden, weight, targets, bias, options = _order_problem(case, path[1])
    loss = _loss(flce, hidden, weight, targets, bias, options)
    with pytest.raises(RuntimeError, match="does not support double backward.*F.linear \\+ F.cross_entropy"):
        (grad_hidden,) = torch.autograd.grad(loss, hidden, create_graph=True)
        (loss + grad_hidden.pow(2).sum()).backward()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("case", ["mean_in_forward", "none_recomputed"])
def test_backward_with_create_graph_raises(flce, path, case):
    hidden, weight, targets, bias, options = _order_problem(case, path[1])
    loss = _loss(flce, hidden, weight, targets, bias, options)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        loss.backward(create_graph=True)
    loss.backward()  # the graph is intact: a plain backward still gives the gradients
    grad_output = torch.ones(N) if options.get("reduction") == "none" else torch.tensor(1.0)
    ref = reference(hidden, weight, targets, bias, grad_output=grad_output, **options)
    for name, t, expected in (("hidden", hidden, ref.grad_hidden), ("weight", weight, ref.grad_weight),
                              ("bias", bias, ref.grad_bias)):
        assert_rel(t.grad, expected, tolerance(torch.float32, "grad"), f"grad_{name}")


# ---- in-place changes between the forward and the backward ---------------------------------------
def _modify(name, hidden, weight, targets, bias, class_weight):
    with torch.no_grad():
        if name == "hidden":
            hidden.mul_(3)
        elif name == "weight":
            weight.add_(1)
        elif name == "targets":
            targets[0] = (targets[0] + 1) % V
        elif name == "class_weight":
            class_weight.mul_(2)
        else:
            bias.add_(1)


@pytest.mark.parametrize("modified", ["hidden", "weight", "targets", "class_weight", "bias"])
@pytest.mark.parametrize("case", ["mean_in_forward", "none_recomputed", "lse_recomputed"])
def test_in_place_change_before_backward_as_pytorch(flce, path, case, modified):
    """The oracle is PyTorch's F.linear + F.cross_entropy (with class weights) on the same inputs
    and change: where it raises its version-counter error, so does the loss; where it does not
    (the bias: F.linear does not save it), the gradients are those of the forward-time values,
    as PyTorch's."""
    device = path[1]
    hidden, weight, targets, bias, options = _order_problem(case, device)
    options["class_weight"] = _class_weight(V, device, torch.float32)
    loss = _loss(flce, hidden, weight, targets, bias, options)

    copies = [t.detach().cpu().requires_grad_() for t in (hidden, weight, bias)]
    ref_targets = targets.cpu().clone()
    ref_options = {k: v.cpu().clone() if torch.is_tensor(v) else v for k, v in options.items()}
    ref_loss = _reference_objective(copies[0], copies[1], ref_targets, copies[2], ref_options)
    _modify(modified, *copies[:2], ref_targets, copies[2], ref_options["class_weight"])
    try:
        ref_loss.backward()
        pytorch_raises = False
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
        pytorch_raises = True
    assert pytorch_raises == (modified != "bias")  # what the oracle does, stated

    _modify(modified, hidden, weight, targets, bias, options["class_weight"])
    if pytorch_raises:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        return
    loss.backward()
    for name, t, expected in zip(("hidden", "weight", "bias"), (hidden, weight, bias), copies, strict=True):
        assert_rel(t.grad, expected.grad, tolerance(torch.float32, "grad"), f"grad_{name}")


# ---- torch.func ---------------------------------------------------------------------------------
def _func_problem(device, seed=21, ignore=0.3):
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=seed, device=device, bias=True,
                                                ignore=ignore, requires_grad=False)
    return hidden, weight, targets, bias


FUNC_OPTIONS = dict(softcap=3.0, label_smoothing=0.1, z_loss_scale=1e-2)


def _reference_loss(hidden, weight, targets, bias, reduction="mean", class_weight=None):
    """PyTorch's loss of the same options from materialised logits (z-loss added by hand, not
    class-weighted: a mean divides it by the count of non-ignored rows)."""
    z = 3.0 * torch.tanh(F.linear(hidden, weight, bias) / 3.0)
    valid = targets != -100
    lse = torch.logsumexp(z, -1)
    z_loss = torch.where(valid, 1e-2 * lse * lse, 0.0)
    ce = F.cross_entropy(z, targets, weight=class_weight, reduction=reduction, label_smoothing=0.1)
    if reduction == "none":
        return ce + z_loss
    return ce + (z_loss.sum() / valid.sum() if reduction == "mean" else z_loss.sum())


def _assert_all_close(actual, expected, what):
    actual = actual if isinstance(actual, tuple) else (actual,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_rel(a, e, tolerance(torch.float32, "grad"), f"{what}[{i}]")


@pytest.mark.parametrize("argnums", [0, 1, 2, (0, 1, 2)])
def test_func_grad(flce, path, argnums):
    hidden, weight, targets, bias = _func_problem(path[1])
    class_weight = _class_weight(V, path[1], torch.float32)

    def loss(h, w, b):
        return flce.fused_linear_cross_entropy(h, w, targets, b, class_weight=class_weight, **FUNC_OPTIONS)

    def expected(h, w, b):
        return _reference_loss(h, w, targets.cpu(), b, class_weight=class_weight.cpu())

    got = torch.func.grad(loss, argnums=argnums)(hidden, weight, bias)
    want = torch.func.grad(expected, argnums=argnums)(*(t.cpu() for t in (hidden, weight, bias)))
    _assert_all_close(got, want, "grad")


def test_func_vjp_jacrev_and_has_aux(flce, path):
    """vjp and jacrev (a vmap over the backward) of the per-row loss; grad_and_value with the
    metrics as aux."""
    hidden, weight, targets, bias = _func_problem(path[1])
    cpu = [t.cpu() for t in (hidden, weight, bias)]

    def per_row(h, w, b):
        return flce.fused_linear_cross_entropy(h, w, targets, b, reduction="none", **FUNC_OPTIONS)

    def expected(h, w, b):
        return _reference_loss(h, w, targets.cpu(), b, reduction="none")

    cotangent = torch.linspace(-1, 1, N)
    value, vjp_fn = torch.func.vjp(per_row, hidden, weight, bias)
    ref_value, ref_vjp_fn = torch.func.vjp(expected, *cpu)
    assert_rel(value, ref_value, tolerance(torch.float32, "loss"), "loss")
    _assert_all_close(vjp_fn(cotangent.to(path[1])), ref_vjp_fn(cotangent), "vjp")
    _assert_all_close(torch.func.jacrev(per_row, argnums=(0, 2))(hidden, weight, bias),
                      torch.func.jacrev(expected, argnums=(0, 2))(*cpu), "jacrev")

    def with_metrics(w):
        loss, metrics = flce.fused_linear_cross_entropy(hidden, w, targets, bias, return_metrics=True,
                                                        **FUNC_OPTIONS)
        return loss, metrics

    grad, (loss, metrics) = torch.func.grad_and_value(with_metrics, has_aux=True)(weight)
    expected_grad = torch.func.grad(lambda w: _reference_loss(cpu[0], w, targets.cpu(), cpu[2]))(cpu[1])
    assert_rel(grad, expected_grad, tolerance(torch.float32, "grad"), "grad_weight")
    ref = reference(hidden, weight, targets, bias, **FUNC_OPTIONS)
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    assert int(metrics["num_correct_tokens"]) == ref.num_correct and not ref.ambiguous.any()


def test_func_per_sample_gradients(flce, path):
    """vmap(grad): one weight gradient per row, as DP-SGD computes them."""
    hidden, weight, targets, bias = _func_problem(path[1], ignore=0.0)

    def one_row(w, h, t):
        return flce.fused_linear_cross_entropy(h[None], w, t[None], bias, **FUNC_OPTIONS)

    def expected(w, h, t):
        return _reference_loss(h[None], w, t[None], bias.cpu())

    got = torch.vmap(torch.func.grad(one_row), in_dims=(None, 0, 0))(weight, hidden, targets)
    want = torch.vmap(torch.func.grad(expected), in_dims=(None, 0, 0))(weight.cpu(), hidden.cpu(), targets.cpu())
    assert got.shape == (N, V, H)
    _assert_all_close(got, want, "per-sample grad_weight")


def test_vmap_forward_over_batched_targets(flce, path):
    """vmap of the forward over (hidden, targets) batches: the range check, a data-dependent
    branch, is skipped for batched targets (as under torch.compile), so an out-of-range target
    gives NaN for its sample only."""
    _, device = path
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, N, H, generator=gen).to(device)
    weight = torch.randn(V, H, generator=gen).to(device)
    targets = torch.randint(0, V, (3, N), generator=gen).to(device)
    got = torch.vmap(lambda h, t: flce.fused_linear_cross_entropy(h, weight, t))(hidden, targets)
    want = torch.stack([F.cross_entropy(h @ weight.cpu().T, t) for h, t in zip(hidden.cpu(), targets.cpu(),
                                                                                strict=True)])
    assert_rel(got, want, tolerance(torch.float32, "loss"), "loss")
    targets[1, 2] = V  # out of range
    got = torch.vmap(lambda h, t: flce.fused_linear_cross_entropy(h, weight, t))(hidden, targets)
    assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2]]).all()


# PyTorch's forward-AD machinery scripts its decompositions when first used (its own deprecation).
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_func_unsupported_transforms_raise_clear_errors(flce, path):
    hidden, weight, targets, bias = _func_problem(path[1])

    def loss(h):
        return flce.fused_linear_cross_entropy(h, weight, targets, bias)

    for transform in (torch.func.jacfwd, torch.func.hessian):
        with pytest.raises(RuntimeError, match="does not support forward-mode AD"):
            transform(loss)(hidden)
    with pytest.raises(RuntimeError, match="does not support forward-mode AD"):
        torch.func.jvp(loss, (hidden,), (torch.ones_like(hidden),))
    with torch.autograd.forward_ad.dual_level():  # the tangent would be dropped: refused
        dual = torch.autograd.forward_ad.make_dual(hidden, torch.ones_like(hidden))
        with pytest.raises(RuntimeError, match="does not support forward-mode AD"):
            loss(dual)
    # torch.func.grad always runs the backward with a graph: a grad of the grad raises, whichever
    # input either one differentiates
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.func.grad(lambda h: torch.func.grad(loss)(h).sum())(hidden)

    def weight_grad_norm(h, b):
        grad = torch.func.grad(lambda w: flce.fused_linear_cross_entropy(h, w, targets, b))(weight)
        return grad.pow(2).sum()

    for argnums in (0, 1):
        with pytest.raises(RuntimeError, match="does not support double backward"):
            torch.func.grad(weight_grad_norm, argnums=argnums)(hidden, bias)
    with pytest.raises(RuntimeError, match="process_group under torch.func"):
        torch.func.grad(lambda h: flce.fused_linear_cross_entropy(h, weight, targets, process_group=object()))(hidden)
