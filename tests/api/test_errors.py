"""Argument errors (type and the argument's name: meta tensors, ``outputs=None`` too), unchecked
targets, empty inputs, the documented limitation of the in-forward gradients, and the package's
public names."""

import numpy as np
import pytest
import torch
from conftest import DEVICE, assert_rel, make_inputs, submodule, tolerance
from reference import reference

N, H, V = 6, 8, 11


@pytest.fixture
def inputs():
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=0, bias=True)
    return dict(hidden=hidden, weight=weight, targets=targets, bias=bias)


def _with(inputs, **changes):
    return {**inputs, **changes}


# (what is wrong, a function of the valid inputs giving the call's arguments, exception, argument named)
BAD_ARGUMENTS = [
    ("hidden_not_tensor", lambda a: _with(a, hidden=a["hidden"].tolist()), TypeError, "hidden"),
    ("weight_not_tensor", lambda a: _with(a, weight=None), TypeError, "weight"),
    ("targets_not_tensor", lambda a: _with(a, targets=[1] * N), TypeError, "targets"),
    ("bias_not_tensor", lambda a: _with(a, bias=[0.0] * V), TypeError, "bias"),
    ("hidden_int", lambda a: _with(a, hidden=a["hidden"].long()), TypeError, "hidden"),
    ("hidden_complex", lambda a: _with(a, hidden=a["hidden"].cfloat()), TypeError, "hidden"),
    ("weight_float64_hidden_float32", lambda a: _with(a, weight=a["weight"].double()), TypeError, "weight"),
    ("weight_other_dtype", lambda a: _with(a, weight=a["weight"].half()), TypeError, "weight"),
    ("bias_other_dtype", lambda a: _with(a, bias=a["bias"].half()), TypeError, "bias"),
    ("targets_float", lambda a: _with(a, targets=a["targets"].float()), TypeError, "targets"),
    ("targets_int16", lambda a: _with(a, targets=a["targets"].short()), TypeError, "targets"),
    ("hidden_0d", lambda a: _with(a, hidden=a["hidden"][0, 0]), ValueError, "hidden"),
    ("weight_1d", lambda a: _with(a, weight=a["weight"][0]), ValueError, "weight"),
    ("weight_other_h", lambda a: _with(a, weight=a["weight"][:, :-1]), ValueError, "weight"),
    ("weight_no_rows", lambda a: _with(a, weight=a["weight"][:0], bias=None), ValueError, "weight"),
    ("targets_other_shape", lambda a: _with(a, targets=a["targets"][:-1]), ValueError, "targets"),
    ("targets_2d", lambda a: _with(a, targets=a["targets"][:, None]), ValueError, "targets"),
    ("bias_other_shape", lambda a: _with(a, bias=a["bias"][:-1]), ValueError, "bias"),
    ("weight_other_device", lambda a: _with(a, weight=a["weight"].to("meta")), ValueError, "weight"),
    ("targets_other_device", lambda a: _with(a, targets=a["targets"].to("meta")), ValueError, "targets"),
    ("bias_other_device", lambda a: _with(a, bias=a["bias"].to("meta")), ValueError, "bias"),
    ("reduction_unknown", lambda a: _with(a, reduction="avg"), ValueError, "reduction"),
    ("logit_scale_nan", lambda a: _with(a, logit_scale=float("nan")), ValueError, "logit_scale"),
    ("logit_scale_inf", lambda a: _with(a, logit_scale=float("inf")), ValueError, "logit_scale"),
    ("softcap_zero", lambda a: _with(a, softcap=0.0), ValueError, "softcap"),
    ("softcap_negative", lambda a: _with(a, softcap=-5.0), ValueError, "softcap"),
    ("softcap_inf", lambda a: _with(a, softcap=float("inf")), ValueError, "softcap"),
    ("label_smoothing_negative", lambda a: _with(a, label_smoothing=-0.1), ValueError, "label_smoothing"),
    ("label_smoothing_above_1", lambda a: _with(a, label_smoothing=1.5), ValueError, "label_smoothing"),
    ("z_loss_scale_negative", lambda a: _with(a, z_loss_scale=-1e-4), ValueError, "z_loss_scale"),
    ("z_loss_scale_nan", lambda a: _with(a, z_loss_scale=float("nan")), ValueError, "z_loss_scale"),
    ("ignore_index_float", lambda a: _with(a, ignore_index=-100.0), ValueError, "ignore_index"),
    ("ignore_index_beyond_int64", lambda a: _with(a, ignore_index=2**63), ValueError, "ignore_index"),
    ("class_weight_not_tensor", lambda a: _with(a, class_weight=[1.0] * V), TypeError, "class_weight"),
    ("class_weight_other_shape", lambda a: _with(a, class_weight=a["hidden"].new_ones(V - 1)), ValueError,
     "class_weight"),
    ("class_weight_2d", lambda a: _with(a, class_weight=a["hidden"].new_ones(1, V)), ValueError, "class_weight"),
    ("class_weight_int", lambda a: _with(a, class_weight=a["hidden"].new_ones(V, dtype=torch.int64)), TypeError,
     "class_weight"),
    ("class_weight_other_device", lambda a: _with(a, class_weight=torch.ones(V, device="meta")), ValueError,
     "class_weight"),
    ("class_weight_requires_grad", lambda a: _with(a, class_weight=a["hidden"].new_ones(V).requires_grad_()),
     ValueError, "class_weight"),
    ("target_equal_to_v", lambda a: _with(a, targets=_set_first(a["targets"], V)), ValueError, "targets"),
    ("target_negative", lambda a: _with(a, targets=_set_first(a["targets"], -1)), ValueError, "targets"),
    ("target_huge", lambda a: _with(a, targets=_set_first(a["targets"], 2**40)), ValueError, "targets"),
    ("target_is_default_ignore_index_but_another_is_set",
     lambda a: _with(a, targets=_set_first(a["targets"], -100), ignore_index=-1), ValueError, "targets"),
    # flags are bools: a truthy string or an int is a mistake, not a yes
    ("return_metrics_str", lambda a: _with(a, return_metrics="yes"), TypeError, "return_metrics"),
    ("return_metrics_int", lambda a: _with(a, return_metrics=1), TypeError, "return_metrics"),
    ("return_lse_str", lambda a: _with(a, return_lse="no"), TypeError, "return_lse"),
    # a numpy bool is a bool; a numpy int is not, and the message names its type as numpy does
    ("return_metrics_numpy_int", lambda a: _with(a, return_metrics=np.int64(1)), TypeError,
     "return_metrics must be a bool, got numpy.int64"),
    ("return_lse_numpy_float", lambda a: _with(a, return_lse=np.float32(0)), TypeError,
     "return_lse must be a bool, got numpy.float32"),
    # a group's name (or anything else) is not a group, whether or not torch.distributed is initialised
    ("process_group_str", lambda a: _with(a, process_group="x"), TypeError,
     "process_group must be a torch.distributed.ProcessGroup or None, got str 'x'"),
    ("process_group_int", lambda a: _with(a, process_group=0), TypeError, "process_group must be a torch.distributed"),
    # float options: numbers or 0-d tensors without gradient; not bools
    ("softcap_1d_tensor", lambda a: _with(a, softcap=torch.tensor([30.0])), ValueError, "softcap"),
    ("softcap_tensor_requiring_grad", lambda a: _with(a, softcap=torch.tensor(30.0, requires_grad=True)),
     ValueError, "softcap"),
    ("softcap_0d_tensor_zero", lambda a: _with(a, softcap=torch.tensor(0.0)), ValueError, "softcap"),
    ("logit_scale_bool", lambda a: _with(a, logit_scale=True), TypeError, "logit_scale"),
    ("label_smoothing_str", lambda a: _with(a, label_smoothing="0.1"), ValueError, "label_smoothing"),
    ("shift_negative", lambda a: _with(a, shift=-1), ValueError, "shift"),
    ("shift_float", lambda a: _with(a, shift=1.0), TypeError, "shift"),
    ("shift_bool", lambda a: _with(a, shift=True), TypeError, "shift"),
    ("shift_without_sequence", lambda a: _with(a, hidden=a["hidden"][0], targets=a["targets"][0], shift=1),
     ValueError, "shift"),
]


def _set_first(targets, value):
    targets = targets.clone()
    targets[0] = value
    return targets


@pytest.mark.parametrize(("make", "error", "name"), [b[1:] for b in BAD_ARGUMENTS], ids=[b[0] for b in BAD_ARGUMENTS])
def test_bad_argument_raises_naming_it(flce, inputs, make, error, name):
    with pytest.raises(error, match=name):
        flce.fused_linear_cross_entropy(**make(inputs))


def test_numpy_bools_are_bools(flce, inputs):
    """return_metrics and return_lse take numpy's bools as Python's: the same outputs."""
    for flags in (dict(return_metrics=True, return_lse=False), dict(return_metrics=False, return_lse=True)):
        plain = flce.fused_linear_cross_entropy(**inputs, **flags)
        numpy_flags = flce.fused_linear_cross_entropy(**inputs, **{k: np.bool_(v) for k, v in flags.items()})
        assert len(numpy_flags) == len(plain) == 2
        assert torch.equal(numpy_flags[0], plain[0])
        if flags["return_lse"]:
            assert torch.equal(numpy_flags[1], plain[1])
        else:
            assert numpy_flags[1].keys() == plain[1].keys()
            assert all(torch.equal(numpy_flags[1][k], plain[1][k]) for k in plain[1])


def test_valid_edge_values_are_accepted(flce, inputs):
    """The bounds themselves are valid: label_smoothing 0 and 1, z_loss_scale 0, a tiny softcap,
    logit_scale 0 or negative, int32 targets, an ignore_index inside [0, V)."""
    for kwargs in (dict(label_smoothing=1.0), dict(label_smoothing=0.0, z_loss_scale=0.0), dict(softcap=1e-3),
                   dict(logit_scale=0), dict(logit_scale=-2.0), dict(ignore_index=3)):
        loss = flce.fused_linear_cross_entropy(**inputs, **kwargs)
        expected = reference(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["bias"], **kwargs).loss
        assert_rel(loss, expected, tolerance(torch.float32, "loss"), str(kwargs))
    targets32 = inputs["targets"].int()
    assert torch.isfinite(flce.fused_linear_cross_entropy(**_with(inputs, targets=targets32)))


def test_zero_dim_tensor_options_equal_their_values(flce, inputs):
    """softcap, logit_scale, label_smoothing and z_loss_scale as 0-d tensors (on the inputs' device,
    read once on the host) give exactly the loss and gradients of the same values as floats."""
    values = dict(softcap=torch.tensor(3.0), logit_scale=torch.tensor(0.7), label_smoothing=torch.tensor(0.1),
                  z_loss_scale=torch.tensor(1e-3, dtype=torch.float64))
    results = []
    for options in ({k: v.to(DEVICE) for k, v in values.items()}, {k: float(v) for k, v in values.items()}):
        hidden, weight, bias = (inputs[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        loss = flce.fused_linear_cross_entropy(hidden, weight, inputs["targets"], bias, **options)
        loss.backward()
        results.append((loss.detach(), hidden.grad, weight.grad, bias.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    expected = reference(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["bias"],
                         **{k: float(v) for k, v in values.items()}).loss
    assert_rel(results[0][0], expected, tolerance(torch.float32, "loss"), "loss")


# ---- targets out of range with the check disabled -----------------------------------------------
# V itself lands in the padding of the last vocabulary tile: it must not match a masked column.
@pytest.mark.parametrize("bad_target", [V, -1, 10**6])
def test_unchecked_out_of_range_target_gives_nan(flce, tune, inputs, bad_target):
    """No target check (``check_targets`` off, as under torch.compile or CUDA-graph capture): no error, no crash,
    a NaN loss for that row (and so for the mean); the other rows are unaffected."""
    tune(check_targets=False)
    targets = _set_first(inputs["targets"], bad_target)
    loss = flce.fused_linear_cross_entropy(**_with(inputs, targets=targets))
    assert torch.isnan(loss)
    loss.backward()  # the in-forward gradient path does not crash either

    per_row = flce.fused_linear_cross_entropy(**_with(inputs, targets=targets), reduction="none")
    assert torch.isnan(per_row[0])
    good = reference(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["bias"], reduction="none").loss
    assert_rel(per_row[1:], good[1:], tolerance(torch.float32, "loss"), "other rows")
    if DEVICE == "cuda":
        torch.cuda.synchronize()  # an illegal memory access would surface here


# ---- empty inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_rows(flce, reduction):
    """N = 0, like PyTorch: sum is 0, mean is NaN, none is empty; gradients are zero (weight,
    bias) or empty (hidden)."""
    hidden, weight, targets, bias = make_inputs(1, H, V, torch.float32, seed=1, bias=True)
    hidden = hidden.detach()[:0].requires_grad_()
    targets = targets[:0]
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction)
    expected = torch.nn.functional.cross_entropy(torch.zeros(0, V), targets.cpu(), reduction=reduction)
    assert loss.shape == expected.shape and loss.dtype == torch.float32
    if reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(expected)
    elif reduction == "sum":
        assert loss.item() == 0.0 == expected.item()
    loss.sum().backward()
    assert hidden.grad.shape == (0, H)
    assert torch.count_nonzero(weight.grad) == 0 and torch.count_nonzero(bias.grad) == 0


def test_no_rows_with_leading_dims(flce):
    hidden, weight, targets, _ = make_inputs(1, H, V, torch.float32, seed=2, lead=(2, 0), requires_grad=False)
    loss, lse = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none", return_lse=True)
    assert loss.shape == (2, 0) and lse.shape == (2, 0)


# ---- documented limitation -------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_second_backward_of_in_forward_gradients_raises(flce, reduction):
    """Mean/sum with gradients: computed in the forward and scaled in place by the backward,
    so a second backward through the same graph (retain_graph=True) is refused."""
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=3)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction=reduction)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


def test_second_backward_of_recomputing_path_works(flce):
    """Reduction "none" recomputes in the backward: two backwards accumulate twice the gradient."""
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=4)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    loss.sum().backward(retain_graph=True)
    once = hidden.grad.clone()
    loss.sum().backward()
    assert_rel(hidden.grad, 2 * once, 1e-6, "accumulated grad_hidden")
    ref = reference(hidden, weight, targets, reduction="none", grad_output=torch.ones(N))
    assert_rel(once, ref.grad_hidden, tolerance(torch.float32, "grad"), "grad_hidden")


def test_target_check_is_skipped_under_torch_compile(flce, inputs):
    """Compiled (the ops are opaque to the compiler), the range check would need a host sync and
    is skipped: an out-of-range target gives NaN instead of an error; valid targets give the
    reference loss and gradients."""
    compiled = torch.compile(flce.fused_linear_cross_entropy, backend="aot_eager", fullgraph=True)
    bad = _set_first(inputs["targets"], 10**6)
    with pytest.raises(ValueError, match="targets"):
        flce.fused_linear_cross_entropy(**_with(inputs, targets=bad))
    assert torch.isnan(compiled(**_with(inputs, targets=bad)))

    loss = compiled(**inputs)
    loss.backward()
    ref = reference(**inputs, grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    assert_rel(inputs["weight"].grad, ref.grad_weight, tolerance(torch.float32, "grad"), "grad_weight")


# ---- the range check's kernel -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_targets_out_of_range_flag_finds_any_bad_target(flce, dtype):
    """The CUDA range check's one kernel (``targets_out_of_range``): its flag is 1 exactly when
    some target is neither in [0, V) nor ignore_index, wherever that target sits (the first
    row, inside, the last of a partial block) and whatever ignore_index is (-100, or inside
    [0, V), where the -100 rows become bad ones), against the comparison in PyTorch."""
    backend = submodule(flce, "_triton_backend")
    gen = torch.Generator().manual_seed(11)
    n_rows, vocab = 150, 40  # past two blocks of the interpreter's 64
    cases = [(-100, None, None), (7, None, None)]  # (ignore_index, bad row, bad value); ignore 7: -100 is bad
    cases += [(-100, row, value) for row in (0, 77, n_rows - 1) for value in (vocab, -1, 10**6)]
    cases += [(7, row, 7) for row in (0, n_rows - 1)]
    outcomes = []
    for ignore_index, row, value in cases:
        targets = torch.randint(0, vocab, (n_rows,), generator=gen)
        if ignore_index == -100:
            targets[torch.rand(n_rows, generator=gen) < 0.1] = -100
        if row is not None:
            targets[row] = value
        expected = bool((((targets < 0) | (targets >= vocab)) & (targets != ignore_index)).any())
        flag = backend.targets_out_of_range(targets.to(dtype).to(DEVICE), vocab, ignore_index)
        assert flag.dtype == torch.int32 and int(flag) == int(expected), (ignore_index, row, value)
        outcomes.append(expected)
    assert outcomes == [False, False] + [True] * 9 + [False, False]

@pytest.mark.parametrize("meta", ["hidden", "weight", "all"])
@pytest.mark.parametrize("function", ["fused_linear_cross_entropy", "fused_linear_log_probs"])
def test_meta_tensors_are_refused_by_name(flce, function, meta):
    """A model built under torch.device("meta") and not loaded: the shared checks say which input is
    a meta tensor (not an internal error of autocast's dispatch)."""
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    targets = torch.tensor([1, 2, 3, 4])
    if meta in ("hidden", "all"):
        hidden = hidden.to("meta")
    if meta in ("weight", "all"):
        weight = weight.to("meta")
    if meta == "all":
        targets = targets.to("meta")
    name = "weight" if meta == "weight" else "hidden"
    with pytest.raises(ValueError, match=f"^{name} is a meta tensor, which holds no data: materialise it"):
        getattr(flce, function)(hidden, weight, targets)


@pytest.mark.parametrize("outputs", [None, 3, "entropy", ("entropy", None)])
def test_outputs_that_are_no_names_are_refused_naming_outputs(flce, outputs):
    hidden, weight, targets = torch.randn(4, 8), torch.randn(16, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(TypeError, match=r"^outputs must be a tuple of names among \('log_probs', 'entropy'"):
        flce.fused_linear_log_probs(hidden, weight, targets, outputs=outputs)


def test_outputs_take_any_iterable_of_names(flce):
    """A list or a generator of names is read as the tuple of them: the same outputs, bit for bit."""
    hidden, weight, targets = torch.randn(4, 8), torch.randn(16, 8), torch.tensor([1, 2, 3, 4])
    as_tuple = flce.fused_linear_log_probs(hidden, weight, targets, outputs=("entropy",))
    as_generator = flce.fused_linear_log_probs(hidden, weight, targets, outputs=(n for n in ["entropy"]))
    assert torch.equal(as_tuple.entropy, as_generator.entropy) and as_generator.is_top1 is None
    logits = hidden.double() @ weight.double().T
    expected = -(torch.log_softmax(logits, -1).exp() * torch.log_softmax(logits, -1)).sum(-1)
    # entropy = lse - sum_j p_j z_j: its fp32 error is relative to the logits' size, not to the entropy's
    # (a peaked row has an entropy near 0 from terms near max |z|)
    assert_rel(as_tuple.entropy, expected, tolerance(torch.float32, "loss"), "entropy", floor=logits.abs().max().item())


def test_the_package_shows_no_helper_modules(flce):
    """dir(flce) holds the public API and the package's own submodules, not the standard library's
    importlib (which the lazy ``trl`` submodule needs)."""
    public = [name for name in dir(flce) if not name.startswith("_")]
    assert "importlib" not in public
    assert set(flce.__all__) <= set(public)
    assert flce.trl.__name__ == f"{flce.__name__}.trl"  # still imported on first use
