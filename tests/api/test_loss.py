"""fused_linear_cross_entropy against the float64 reference: loss, gradients, metrics, lse,
over the options, shapes, layouts and code paths (chunks, TMA/pointer loads, gradient paths)."""

import pytest
import torch
from conftest import BF16_ON_CPU, DEVICE, DTYPES, DTYPES_16, assert_rel, make_inputs, submodule, tolerance
from reference import reference

# Default sizes: V prime (partial last tile), H not a multiple of the K tile, N > BLOCK_N.
N, H, V = 24, 40, 97


def grad_output_for(loss, value):
    """d out / d loss: a scalar for mean/sum, a seeded random tensor for reduction "none"."""
    if loss.dim() == 0:
        return torch.tensor(value, dtype=torch.float32, device=loss.device)
    gen = torch.Generator().manual_seed(123)
    return torch.randn(loss.shape, generator=gen).to(loss.device)


def check_grads(tensors, ref, dtype):
    """Each input's .grad against the reference: present (in the input's dtype) exactly when
    the input requires grad."""
    for name, t, expected in zip(("hidden", "weight", "bias"), tensors, (ref.grad_hidden, ref.grad_weight,
                                                                      ref.grad_bias), strict=True):
        if t is None:
            continue
        if not t.requires_grad:
            assert t.grad is None, f"{name} does not require grad but got one"
            continue
        assert t.grad is not None, f"no gradient for {name}"
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape, f"grad_{name}: {t.grad.dtype} {t.grad.shape}"
        assert_rel(t.grad, expected, tolerance(dtype, "grad"), f"grad_{name}")


def check_metrics(metrics, ref, dtype, reduction="mean"):
    """The sums, the per-row predictions and, with reduction "none", the per-row metrics."""
    per_row = {"correct_tokens", "entropy"} if reduction == "none" else set()
    assert set(metrics) == {"num_correct_tokens", "entropy_sum", "num_valid_tokens", "predictions"} | per_row
    correct, entropy = metrics["num_correct_tokens"], metrics["entropy_sum"]
    assert correct.dtype == torch.int64 and correct.dim() == 0
    assert metrics["num_valid_tokens"].dtype == torch.int64 and int(metrics["num_valid_tokens"]) == ref.num_valid
    assert entropy.dtype == torch.float32 and entropy.dim() == 0
    # Random inputs: no two logits of a row within a rounding of each other at the top,
    # so the count is exact (an assertion, not a skip, if the seed ever made one).
    assert ref.num_ambiguous == 0 and not ref.ambiguous.any(), "test inputs have near-ties at the argmax"
    assert int(correct) == ref.num_correct
    assert_rel(entropy, ref.entropy_sum, tolerance(dtype, "loss"), "entropy_sum")
    predictions = metrics["predictions"]
    assert predictions.dtype == torch.int64 and predictions.shape == ref.predictions.shape
    assert torch.equal(predictions.cpu(), ref.predictions)  # -1 on ignored rows
    if reduction == "none":
        correct_tokens, row_entropy = metrics["correct_tokens"], metrics["entropy"]
        assert correct_tokens.dtype == torch.bool and torch.equal(correct_tokens.cpu(), ref.correct)
        assert row_entropy.dtype == torch.float32 and row_entropy.shape == ref.entropy.shape
        assert_rel(row_entropy, ref.entropy, tolerance(dtype, "loss"), "entropy")
        assert torch.all(row_entropy.cpu()[ref.entropy == 0] == 0)  # exactly 0 at ignored rows


# Each case: sizes, options, how the inputs are made, settings (``_settings.override``); "go" is
# d out / d loss for mean/sum.
CASES = {
    "mean": dict(),
    "mean_grad_output_0.37": dict(go=0.37),
    "sum_grad_output_-2": dict(reduction="sum", go=-2.0),
    "none_per_token_grad": dict(reduction="none"),
    "ignore_some_mean": dict(ignore=0.3),
    "ignore_some_none": dict(ignore=0.3, reduction="none"),
    "ignore_index_7": dict(ignore=0.3, ignore_index=7, reduction="sum"),
    "logit_scale_and_bias": dict(logit_scale=0.37, bias=True),
    "softcap_saturating": dict(logit_scale=1.5, softcap=3.0, scale=3.0),
    "label_smoothing": dict(label_smoothing=0.2, ignore=0.25),
    "z_loss": dict(z_loss_scale=1e-2, bias=True, go=0.5),
    "everything_sum": dict(reduction="sum", bias=True, logit_scale=1.5, softcap=5.0, label_smoothing=0.1,
                           z_loss_scale=1e-3, ignore=0.2),
    "everything_none": dict(reduction="none", bias=True, logit_scale=1.5, softcap=5.0, label_smoothing=0.1,
                            z_loss_scale=1e-3, ignore=0.2),
    "n_1": dict(n=1),
    "n_1_none": dict(n=1, reduction="none"),
    "v_131_h_24": dict(v=131, h=24),
    "v_5_smaller_than_tile": dict(v=5, bias=True),
    "h_3": dict(h=3),
    "chunks_mean": dict(n=37, settings=dict(chunk_rows=8), bias=True, ignore=0.2),
    "chunks_none": dict(n=37, settings=dict(chunk_rows=8), bias=True, reduction="none"),
    "chunks_of_1_sum": dict(n=5, settings=dict(chunk_rows=1), bias=True, reduction="sum", label_smoothing=0.1),
    "block_v_16": dict(settings=dict(block_v=16), bias=True),
    # The logit kernel's tiles in groups of 32 rows (two of the interpreter's row blocks; the last
    # group has one), persistent programs striding over the groups.
    "grouped_tiles": dict(n=37, settings=dict(group_rows=32, persistent=True), bias=True, ignore=0.2),
    # H a multiple of 128: the pointer path's unmasked K loop (EVEN_K).
    "h_128_even_k": dict(n=9, h=128, v=40, settings=dict(tma=False), bias=True),
    "b_t_h_hidden": dict(lead=(3, 7), ignore=0.2),
    "b_t_h_hidden_none": dict(lead=(3, 7), reduction="none"),
    "int32_targets": dict(target_dtype=torch.int32, ignore=0.2),
    # The factored gradient (bf16/fp32 without bias, softcap, smoothing, z-loss) over chunks,
    # with ignored rows skipped; then rows whose max passes their sampled reference by more
    # than the gap (logits ~ N(0, 30^2), a one-row sample); then the grad-pass path and every
    # row computed, on the same kind of inputs.
    "factored_chunks_ignored": dict(n=37, settings=dict(chunk_rows=8), ignore=0.3, logit_scale=0.7),
    "factored_moved_rows": dict(n=37, settings=dict(chunk_rows=8), scale=30.0, ignore=0.2),
    # Every target entry in the products (rare_target -1: no take-out flags, no target terms).
    "factored_entries_in": dict(n=37, settings=dict(chunk_rows=8, rare_target=-1), ignore=0.3),
    "grad_pass_path": dict(n=37, settings=dict(chunk_rows=8, factored=False), ignore=0.3, logit_scale=0.7),
    "ignored_rows_computed": dict(n=37, settings=dict(chunk_rows=8, skip_ignored=False), ignore=0.3),
    # A 16-bit grad_weight over many chunks, summed in groups of two into an fp32 sum (the
    # small head's fp32 accumulator switched off), with and without the factored gradient.
    "grouped_weight_sum": dict(n=37, settings=dict(chunk_rows=4, weight_group=2, weight_fp32_mib=0),
                               ignore=0.2),
    "grouped_weight_sum_bias": dict(n=37, settings=dict(chunk_rows=4, weight_group=3, weight_fp32_mib=0),
                                    bias=True, reduction="sum"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(flce, tune, case, dtype):
    c = dict(CASES[case])
    tune(**c.pop("settings", {}))
    go = c.pop("go", 1.0)
    make = {k: c.pop(k) for k in ("bias", "lead", "ignore", "target_dtype", "scale") if k in c}
    if "ignore_index" in c:
        make["ignore_index"] = c["ignore_index"]
    n, h, v = c.pop("n", N), c.pop("h", H), c.pop("v", V)
    hidden, weight, targets, bias = make_inputs(n, h, v, dtype, seed=sum(map(ord, case)), **make)

    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True, **c)
    grad_output = grad_output_for(loss, go)
    (loss * grad_output).sum().backward()
    ref = reference(hidden, weight, targets, bias, grad_output=grad_output.cpu(), **c)

    assert loss.dtype == torch.float32
    expected_shape = targets.shape if c.get("reduction") == "none" else ()
    assert loss.shape == expected_shape
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    if c.get("reduction") == "none":  # ignored rows are exactly 0
        ignored = targets == c.get("ignore_index", -100)
        assert torch.all(loss.detach()[ignored] == 0)
    check_metrics(metrics, ref, dtype, c.get("reduction", "mean"))
    check_grads((hidden, weight, bias), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES_16)
@pytest.mark.parametrize("return_lse", [False, True], ids=["step", "recompute"])
def test_a_step_of_grown_chunks_keeps_no_fp32_sum(flce, monkeypatch, tune, dtype, return_lse):
    """``buffer_mib`` 0 plans 128-row chunks, so 300 rows with groups of two chunks
    (``weight_group`` 2; the small head's fp32 accumulator off) would take three chunks and an
    fp32 sum of grad_weight (V x H x 4 = 196608 bytes). They take two instead, of half the rows
    in whole row blocks (256, or 192 in the Gluon sweep's tiles), whose buffer is smaller than
    that sum: no fp32 sum is made, and the gradients match float64's. ``return_lse`` takes the
    recomputing backward, which plans its chunks the same way."""
    tune(buffer_mib=0, weight_group=2, weight_fp32_mib=0, chunk_rows=None)
    chunked = submodule(flce, "_chunked")
    sums, original = [], chunked.Gradients._add_weight_chunk

    def spy(self, lhs, rhs):  # (the chunk's rows, whether an fp32 sum exists once it is added)
        original(self, lhs, rhs)
        sums.append((lhs.shape[1], self.weight_sum is not None))

    monkeypatch.setattr(chunked.Gradients, "_add_weight_chunk", spy)
    hidden, weight, targets, _ = make_inputs(300, 192, 256, dtype, seed=300, ignore=0.1)
    out = flce.fused_linear_cross_entropy(hidden, weight, targets, return_lse=return_lse)
    loss = out[0] if return_lse else out
    loss.backward()
    ref = reference(hidden, weight, targets, None, grad_output=torch.tensor(1.0))
    assert len(sums) == 2 and not any(has_sum for _, has_sum in sums), sums
    assert sums[0][0] in (192, 256)
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    check_grads((hidden, weight, None), ref, dtype)
    tune(grow_chunks=False)  # the plan without growth: three chunks, an fp32 sum
    sums.clear()
    hidden.grad = weight.grad = None
    out = flce.fused_linear_cross_entropy(hidden, weight, targets, return_lse=return_lse)
    (out[0] if return_lse else out).backward()
    assert len(sums) == 3 and sums[-1][1], sums
    check_grads((hidden, weight, None), ref, dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(flce, reduction):
    """Like PyTorch: mean is NaN (0 / 0), sum is 0, none is zeros; the gradients are exactly 0."""
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=1, bias=True)
    targets = torch.full_like(targets, -100)
    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction,
                                                    return_metrics=True)
    loss.sum().backward()
    if reduction == "mean":
        assert torch.isnan(loss)
    else:
        assert torch.equal(loss.detach().cpu(), torch.zeros(loss.shape))
    assert int(metrics["num_correct_tokens"]) == 0 and float(metrics["entropy_sum"]) == 0.0
    for t in (hidden, weight, bias):
        assert torch.count_nonzero(t.grad) == 0


# ---- lse ------------------------------------------------------------------------------------
LSE_CASES = {
    "mean": dict(),
    "sum_bias_softcap": dict(reduction="sum", bias=True, softcap=4.0, logit_scale=2.0),
    "none_smoothing_zloss": dict(reduction="none", label_smoothing=0.1, z_loss_scale=1e-2, ignore=0.3),
    "mean_chunks": dict(settings=dict(chunk_rows=7), bias=True, ignore=0.3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(LSE_CASES), ids=list(LSE_CASES))
def test_return_lse_with_gradient(flce, tune, case, dtype):
    """(loss, metrics, lse), and the gradient of loss * g + sum(lse * g') (the recomputing path)."""
    c = dict(LSE_CASES[case])
    tune(**c.pop("settings", {}))
    make = {k: c.pop(k) for k in ("bias", "ignore") if k in c}
    hidden, weight, targets, bias = make_inputs(N, H, V, dtype, seed=7, **make)
    out = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True, return_lse=True, **c)
    assert isinstance(out, tuple) and len(out) == 3
    loss, metrics, lse = out
    assert lse.dtype == torch.float32 and lse.shape == targets.shape and lse.requires_grad
    grad_output = grad_output_for(loss, 0.7)
    lse_grad = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5)).to(lse.device)
    ((loss * grad_output).sum() + (lse * lse_grad).sum()).backward()
    ref = reference(hidden, weight, targets, bias, grad_output=grad_output.cpu(), lse_grad=lse_grad.cpu(), **c)
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    assert_rel(lse, ref.lse, tolerance(dtype, "loss"), "lse")
    check_metrics(metrics, ref, dtype, c.get("reduction", "mean"))
    check_grads((hidden, weight, bias), ref, dtype)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradient_through_lse_only(flce, reduction):
    """Only the returned lse is used: the loss receives no gradient."""
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=8, bias=True, ignore=0.2)
    loss, lse = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction, return_lse=True)
    (lse * 0.5).sum().backward()
    ref = reference(hidden, weight, targets, bias, reduction=reduction, lse_grad=torch.full(lse.shape, 0.5))
    assert_rel(lse, ref.lse, tolerance(torch.float32, "loss"), "lse")
    check_grads((hidden, weight, bias), ref, torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradient_of_lse_sum(flce, reduction):
    """The plainest use of the returned lse: lse.sum() (or .mean()) in the objective, whose
    gradient autograd hands over as an expanded (stride 0) tensor."""
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=10)
    loss, lse = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction=reduction, return_lse=True)
    (loss.sum() + lse.sum()).backward()
    ref = reference(hidden, weight, targets, reduction=reduction, grad_output=torch.ones(loss.shape),
                    lse_grad=torch.ones(N))
    check_grads((hidden, weight, None), ref, torch.float32)


def test_return_lse_tuple_without_metrics(flce):
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=9, requires_grad=False)
    out = flce.fused_linear_cross_entropy(hidden, weight, targets, return_lse=True)
    assert isinstance(out, tuple) and len(out) == 2
    ref = reference(hidden, weight, targets)
    assert_rel(out[0], ref.loss, tolerance(torch.float32, "loss"), "loss")
    assert_rel(out[1], ref.lse, tolerance(torch.float32, "loss"), "lse")


# ---- layouts and load paths -------------------------------------------------------------------
def _layout(kind, n, h, v, dtype, seed):
    """hidden and weight (leaves requiring grad) with the memory layout ``kind``."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(DEVICE, dtype)
    if kind == "hidden_row_stride":  # every other row of a (2n, h) tensor
        big = torch.randn(2 * n, h, generator=gen).to(DEVICE, dtype)
        hidden = big[::2]
    elif kind == "hidden_column_stride":  # every other column of an (n, 2h) tensor
        hidden = torch.randn(n, 2 * h, generator=gen).to(DEVICE, dtype)[:, ::2]
    elif kind == "hidden_offset_aligned":  # starts one row into its storage
        hidden = torch.randn(n + 1, h, generator=gen).to(DEVICE, dtype)[1:]
    elif kind == "hidden_offset_misaligned":  # starts one element into its storage
        hidden = torch.randn(n * h + 1, generator=gen).to(DEVICE, dtype)[1:].view(n, h)
    elif kind == "weight_transposed":  # a transposed view of an (h, v) tensor
        weight = (torch.randn(h, v, generator=gen) / h**0.5).to(DEVICE, dtype).t()
    elif kind == "weight_column_slice":  # the first h columns of a (v, h + 8) tensor: rows h + 8 apart
        weight = (torch.randn(v, h + 8, generator=gen) / h**0.5).to(DEVICE, dtype)[:, :h]
    return hidden.detach().requires_grad_(), weight.detach().requires_grad_()


def _tma_available():
    return DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9


def _spy_tma(monkeypatch, flce):
    """Records each decision of the Triton backend between the TMA and pointer load paths."""
    backend = submodule(flce, "_triton_backend")
    decisions, original = [], backend._tma_ok

    def spy(*tensors):
        decision = original(*tensors)
        if len(tensors) == 2:  # the loads of (hidden, weight); a single tensor is the buffer's store
            decisions.append(decision)
        return decision

    monkeypatch.setattr(backend, "_tma_ok", spy)
    return decisions


# (layout, whether TMA descriptors can describe it: rows 16-byte aligned; a tensor whose columns
# are not adjacent is copied once a call, and one whose rows are not H apart once a chunk, before the
# logit kernels, which read contiguous rows)
LAYOUTS = {
    "contiguous": True,
    "hidden_row_stride": True,
    "hidden_offset_aligned": True,
    "hidden_column_stride": True,
    "hidden_offset_misaligned": False,
    "weight_transposed": True,
    "weight_column_slice": True,
}


@pytest.mark.parametrize("tma", ["0", "1"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_and_load_paths(flce, tune, monkeypatch, layout, tma):
    tune(tma=tma == "1")
    # Rows taken in place (skipping ignored rows gathers them into contiguous copies).
    tune(skip_ignored=False)
    decisions = _spy_tma(monkeypatch, flce)
    dtype = torch.float32
    hidden, weight = _layout(layout, 21, H, V, dtype, seed=len(layout))
    assert hidden.is_contiguous() == (layout in ("contiguous", "hidden_offset_aligned", "weight_transposed",
                                                  "hidden_offset_misaligned", "weight_column_slice"))
    targets = torch.randint(0, V, (21,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)
    loss.backward()
    ref = reference(hidden, weight, targets, grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    check_metrics(metrics, ref, dtype)
    check_grads((hidden, weight, None), ref, dtype)
    expected = tma == "1" and LAYOUTS[layout] and _tma_available()
    assert decisions and all(d == expected for d in decisions), decisions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tma", ["0", "1"])
def test_tma_and_pointer_paths_agree(flce, tune, monkeypatch, dtype, tma):
    """Both load paths on 16-bit and fp32 inputs, forward (with the stored logits) and recompute backward."""
    tune(tma=tma == "1")
    decisions = _spy_tma(monkeypatch, flce)
    hidden, weight, targets, bias = make_inputs(30, 24, 70, dtype, seed=11, bias=True, ignore=0.2)
    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True,
                                                    reduction="none", softcap=6.0)
    grad_output = grad_output_for(loss, 1.0)
    (loss * grad_output).sum().backward()
    ref = reference(hidden, weight, targets, bias, reduction="none", softcap=6.0, grad_output=grad_output.cpu())
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    check_metrics(metrics, ref, dtype, "none")
    check_grads((hidden, weight, bias), ref, dtype)
    assert decisions and all(d == (tma == "1" and _tma_available()) for d in decisions), decisions


def test_strided_targets(flce):
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=19)
    every_other = torch.stack([targets, torch.zeros_like(targets)], dim=1).reshape(-1)[::2]
    assert torch.equal(every_other, targets) and every_other.stride() == (2,)
    loss = flce.fused_linear_cross_entropy(hidden, weight, every_other)
    loss.backward()
    ref = reference(hidden, weight, targets, grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    check_grads((hidden, weight, None), ref, torch.float32)


def test_strided_bias(flce):
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=20, bias=True)
    every_other = torch.stack([bias.detach(), torch.zeros_like(bias)], dim=1).reshape(-1)[::2]
    every_other.requires_grad_()
    assert every_other.stride() == (2,)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, every_other)
    loss.backward()
    ref = reference(hidden, weight, targets, every_other, grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    check_grads((hidden, weight, every_other), ref, torch.float32)


# ---- which inputs require grad ------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("wanted, with_bias", [("hidden", True), ("weight", True), ("bias", True),
                                               ("hidden+bias", True), ("hidden", False), ("weight", False)])
def test_only_some_inputs_require_grad(flce, tune, wanted, with_bias, reduction):
    """E.g. a frozen lm_head (only hidden), or a frozen trunk (only weight); without a bias, mean
    takes the factored gradient, here over chunks with ignored rows skipped (gathered rows)."""
    tune(chunk_rows=8)
    hidden, weight, targets, bias = make_inputs(37, H, V, torch.float32, seed=12, bias=with_bias, ignore=0.3,
                                                requires_grad=False)
    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None:
            t.requires_grad_(name in wanted.split("+"))
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction)
    grad_output = grad_output_for(loss, 0.8)
    (loss * grad_output).sum().backward()
    ref = reference(hidden, weight, targets, bias, reduction=reduction, grad_output=grad_output.cpu())
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    check_grads((hidden, weight, bias), ref, torch.float32)


def test_no_grad_forward(flce):
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=13, bias=True)
    with torch.no_grad():
        loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True)
    assert loss.grad_fn is None and not loss.requires_grad
    ref = reference(hidden, weight, targets, bias)
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    check_metrics(metrics, ref, torch.float32)


def test_no_input_requires_grad(flce):
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=14, requires_grad=False)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="sum")
    assert not loss.requires_grad
    assert_rel(loss, reference(hidden, weight, targets, reduction="sum").loss, tolerance(torch.float32, "loss"),
               "loss")


# ---- metrics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_ties_take_the_first_index(flce, tune, dtype):
    """Integer inputs make every logit exact, so ties are exact; copies of weight rows in other
    vocabulary tiles tie with the original, and only the first index counts as correct."""
    tune(block_v=16)
    gen = torch.Generator().manual_seed(15)
    v, h, n = 70, 8, 32
    weight = torch.randint(-2, 3, (v, h), generator=gen).float()
    hidden = torch.randint(-2, 3, (n, h), generator=gen).float()
    weight[3] = 2.0  # w_j . w_3 <= 2 * 2h = |w_3|^2, equal only for copies of w_3
    weight[40] = weight[3]  # a later tile
    weight[69] = weight[3]  # the last, partial tile
    weight[5] = weight[3]  # the same tile
    hidden[: n // 2] = weight[3]  # these rows peak at 3, 5, 40 and 69
    hidden, weight = hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype)
    z = hidden.double() @ weight.double().T
    first = z.argmax(dim=1)  # PyTorch's rule: the first index of the max
    tied = (z == z.max(dim=1, keepdim=True).values).sum(dim=1)
    assert (tied[: n // 2] == 4).all() and first[: n // 2].eq(3).all()
    # Targets: the first max for some rows, a later tied index for others, anything elsewhere.
    targets = first.clone()
    targets[1: n // 2: 2] = torch.tensor([5, 40, 69, 40, 5, 69, 40, 5])
    targets[n // 2 + 1:: 3] = 0
    expected = int((targets == first).sum())
    assert 0 < expected < n
    _, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets.to(DEVICE), return_metrics=True)
    assert int(metrics["num_correct_tokens"]) == expected
    assert torch.equal(metrics["predictions"].cpu(), first.cpu())


def test_more_vocabulary_tiles_than_one_merge_block(flce, tune):
    """More than 128 vocabulary tiles (a real vocabulary on a GPU: V > 16384 at BLOCK_V 128): the
    tile statistics are merged in several blocks, argmax ties across blocks included."""
    tune(block_v=16)
    v, h = 2100, 8  # 132 tiles of 16
    gen = torch.Generator().manual_seed(24)
    weight = torch.randint(-1, 2, (v, h), generator=gen).float()  # w . 1 <= 8 for these rows
    weight[50] = 3.0  # tile 3: ties with tile 130 for hidden rows of ones (logit 24)
    weight[2090] = 3.0
    weight[2099] = -3.0  # the last tile: the unique max for hidden rows of -1
    hidden = torch.tensor([[1.0] * h, [1.0] * h, [-1.0] * h, [0.5] * h])
    targets = torch.tensor([50, 2090, 2099, 7])
    hidden, weight = hidden.to(DEVICE), weight.to(DEVICE)
    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets.to(DEVICE), reduction="none",
                                                    return_metrics=True)
    ref = reference(hidden, weight, targets, reduction="none")
    assert ref.logits.argmax(-1)[:3].tolist() == [50, 50, 2099]
    assert int(metrics["num_correct_tokens"]) == ref.num_correct == 2
    assert torch.equal(metrics["predictions"].cpu(), ref.predictions)
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    assert_rel(metrics["entropy_sum"], ref.entropy_sum, tolerance(torch.float32, "loss"), "entropy_sum")


def test_return_metrics_changes_nothing_bitwise(flce, tune):
    """return_metrics=True leaves loss and every gradient bit-identical, on both gradient paths."""
    tune(chunk_rows=10)
    for reduction in ("mean", "none"):
        results = []
        for return_metrics in (False, True):
            hidden, weight, targets, bias = make_inputs(N, H, V, torch.float16, seed=16, bias=True, ignore=0.2)
            out = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction,
                                                  label_smoothing=0.1, softcap=8.0, return_metrics=return_metrics)
            loss = out[0] if return_metrics else out
            (loss * grad_output_for(loss, 0.3)).sum().backward()
            results.append((loss.detach(), hidden.grad, weight.grad, bias.grad))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), reduction


# ---- backends ---------------------------------------------------------------------------------
def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("dtype", [p for p in DTYPES if p.id != "fp16"])
def test_training_skips_ignored_rows_and_factors_the_gradient(flce, tune, monkeypatch, dtype):
    """A training step without bias, softcap, smoothing or z-loss: the logit sweep sees only
    the rows with a loss, and the gradient is factored, also for rows whose max passes their
    reference (the target's logit) by more than the gap; results as the reference. The
    references come from one row_reference call for every row of the step's order, its rows read
    in place."""
    tune(chunk_rows=8)
    backend = submodule(flce, "_triton_backend")
    gap = float(submodule(flce, "_kernel_math").REFERENCE_GAP.value)
    swept_rows, references, row_maxes = [], [], []
    row_reference, factored_rows = backend.row_reference, backend.factored_rows

    def recording_row_reference(*args, **kwargs):
        row_ref, target_logit = row_reference(*args, **kwargs)
        references.append(row_ref.clone())
        return row_ref, target_logit

    def recording_factored_rows(sweep, hidden, *args, **kwargs):
        swept_rows.append(hidden.shape[0])
        stats, row_factor, target_grad = factored_rows(sweep, hidden, *args, **kwargs)
        row_maxes.append(stats.row_max.clone())
        return stats, row_factor, target_grad

    monkeypatch.setattr(backend, "row_reference", recording_row_reference)
    monkeypatch.setattr(backend, "factored_rows", recording_factored_rows)
    hidden, weight, targets, bias = make_inputs(37, H, V, dtype, seed=77, ignore=0.3, scale=30.0)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    ref = reference(hidden, weight, targets, grad_output=torch.tensor(1.0))
    # one call for the 37 rows of the order, the ignored ones last
    assert len(references) == 1 and references[0].shape == (37,)
    references = list(references[0][:sum(swept_rows)].split(swept_rows))
    assert len(references) == len(swept_rows) > 1
    moved_rows = [int((m > r + gap).sum()) for m, r in zip(row_maxes, references, strict=True)]
    num_valid = int((targets != -100).sum())
    assert sum(swept_rows) == num_valid < 37
    assert len(moved_rows) == len(swept_rows) and sum(moved_rows) > 0
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    check_grads((hidden, weight, None), ref, dtype)


def test_training_loss_is_the_forwards(flce, tune):
    """The factored training step takes each target's logit from a tensor-core product that sums
    in the logit kernel's order (``row_reference``), so that the product's rounding cancels in
    lse - z_t: its loss equals the forward's (which takes it from the same product) to fp32
    rounding. On a GPU the products run in TF32 here (10-bit mantissas), so a target logit from
    an exact fp32 dot product would put TF32's error, about 1e-3 of a logit, into the training
    loss."""
    tune(chunk_rows=16)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        hidden, weight, targets, _ = make_inputs(48, 256, V, torch.float32, seed=21, ignore=0.2, scale=10.0)
        with torch.no_grad():
            forward_loss = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="sum")
        training_loss = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="sum")
        training_loss.backward()
    finally:
        torch.set_float32_matmul_precision(precision)
    # The two sweeps may sum the 256 products of a logit in different orders (their own tile
    # configurations): fp32 rounding, about 2^-24 * 256 * 0.6 (the products' size) a logit and
    # sqrt(rows) of that over the sum; 6e-4 is ten times that. TF32's error is about a hundred.
    assert_rel(training_loss, forward_loss, 6e-4 / float(forward_loss.abs()), "training loss")
    ref = reference(hidden, weight, targets, reduction="sum")
    # Against the exact loss: TF32 rounds each input to 2^-11 on the GPU (the interpreter's
    # products are fp32).
    assert_rel(training_loss, ref.loss, 1e-3 if DEVICE == "cuda" else tolerance(torch.float32, "loss"), "loss")


def test_row_factors_keep_or_take_out_each_target_entry(flce):
    """row_factors on a bf16 buffer of exponentials exp(z - B), B each row's target logit, with
    the even rows' target entries taken out of the products (OUT_ALWAYS), and the odd rows' where
    p_t is below RARE_PROBABILITY (OUT_IF_IMPROBABLE; row 13, flagged 0, keeps it in though its
    p_t is as small as row 15's): G = diag(r) E' + diag(c) T is
    s g (p - onehot) either way. Taken out, the buffer holds 0 at the target and c = s g (p_t - 1)
    to fp32; kept, c = 0 and r E'_it = s g (p_t - 1) to fp32 (r takes the target entry's bf16
    rounding, so that a small p_t's 1 - 1/p_t, far from 16 bits' grid, costs nothing). Every
    other entry carries its exponential's rounding times one factor per row, within a rounding
    of 1 (the share of the kept target's rounding). Built by hand, no product: bf16 runs under
    the interpreter. Row 5 has no gradient (r = c = 0); row 9's target is in another rank's
    slice (no target entry here: c = 0, r = s g exp(B - lse) unchanged)."""
    backend, options = submodule(flce, "_triton_backend"), submodule(flce, "_options")
    gen = torch.Generator().manual_seed(43)
    rows, vocab, block_v, logit_scale = 16, 256, 64, 0.5
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)  # p_t from 9e-4 to 0.01
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[9] = vocab + 3
    loss_grad = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
    loss_grad[5] = 0.0
    local = targets < vocab
    columns = torch.where(local, targets, 0)
    # rows 13 and 15 give their target little probability (p_t < 2^-10)
    logits[[13, 15], columns[[13, 15]]] -= 3.0
    # even rows: OUT_ALWAYS; odd rows OUT_IF_IMPROBABLE, but row 13: 0 (stays in, improbable or not)
    kernels = submodule(flce, "_kernel_math")
    take_out = torch.where(torch.arange(rows) % 2 == 0, kernels.OUT_ALWAYS.value, kernels.OUT_IF_IMPROBABLE.value)
    take_out[13] = 0
    take_out = take_out.to(torch.int8)
    row_ref = logits.gather(1, columns[:, None])[:, 0]
    lse = torch.logsumexp(logits, dim=1)
    assert bool((logits.amax(1) < row_ref + 40.0).all())  # no row moves to its max: B stays the reference
    exponentials = torch.exp(logits - row_ref[:, None])
    buffer = exponentials.to(device=DEVICE, dtype=torch.bfloat16)
    stored_rounding = buffer.cpu().double() / exponentials  # each entry's bf16 rounding, 1 +- 2^-8
    f32 = dict(device=DEVICE, dtype=torch.float32)
    state = type("State", (), dict(tile_max=logits.view(rows, -1, block_v).amax(2).to(**f32), block_v=block_v))()
    opts = options.LossOptions(logit_scale=logit_scale)
    row_factor, target_grad = backend.row_factors(buffer, state, logits.amax(1).to(**f32), row_ref.to(**f32),
                                                  lse.to(**f32), loss_grad.to(**f32), targets.to(DEVICE), opts,
                                                  take_out.to(DEVICE))
    onehot = (torch.nn.functional.one_hot(columns, vocab) * local[:, None]).bool()
    at_target = local & (loss_grad != 0)
    # taken out: OUT_ALWAYS, and OUT_IF_IMPROBABLE where p_t is below the kernels' RARE_PROBABILITY
    p_target = torch.softmax(logits, dim=1).gather(1, columns[:, None])[:, 0]
    improbable = p_target < kernels.RARE_PROBABILITY.value
    assert bool(improbable[13]) and bool(improbable[15]) and int(improbable.sum()) == 2
    out = at_target & ((take_out == kernels.OUT_ALWAYS.value)
                       | ((take_out == kernels.OUT_IF_IMPROBABLE.value) & improbable))
    kept = at_target & ~out
    assert int(out.sum()) >= 4 and int(kept.sum()) >= 4 and bool(out[15]) and bool(kept[13])
    grad = row_factor.cpu().double()[:, None] * buffer.cpu().double()
    grad[onehot] += target_grad.cpu().double()[onehot.any(1)]
    expected = logit_scale * loss_grad[:, None] * (torch.softmax(logits, dim=1) - onehot.double())
    assert torch.equal(grad[5], torch.zeros(vocab, dtype=torch.float64))
    assert bool((buffer.cpu()[out].gather(1, columns[out][:, None]) == 0).all())
    assert bool((target_grad.cpu()[~out] == 0).all())
    # The target entries (in c, or in r E'_it): fp32's rounding of lse and exp(lse - B) (a few
    # ulps), and of r or c.
    torch.testing.assert_close(grad[at_target].gather(1, columns[at_target][:, None]),
                               expected[at_target].gather(1, columns[at_target][:, None]), rtol=2e-6, atol=0.0)
    # The others: grad / (expected * rounding) is one factor per row to fp32 (1e-6), the share of
    # the kept target's rounding: 1 within bf16's relative rounding, 2^-8 to nearest on a GPU; the
    # interpreter's conversion truncates, 2^-7. Rows without a target entry in the products (row
    # 9, and those taken out) keep r (1e-6).
    share = torch.where(onehot, float("nan"), grad / (expected * stored_rounding))
    row_share = share.nanmean(1, keepdim=True)
    others = ~onehot & (loss_grad != 0)[:, None]
    torch.testing.assert_close(share[others], row_share.expand(-1, vocab)[others], rtol=1e-6, atol=0.0)
    bound = 2.0 ** -8 if DEVICE == "cuda" else 2.0 ** -7
    assert float((row_share[loss_grad != 0] - 1).abs().max()) <= bound
    assert float((row_share[out | ~local] - 1).abs().max()) <= 1e-6


@pytest.mark.parametrize("backend_name", ["_triton_backend", "_torch_backend"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_zeroes_the_given_rows_only(flce, backend_name, dtype):
    """zero_rows writes exact zeros to the given rows (unordered, a partial block of 16 rows and
    of the columns) of a strided view and leaves every other entry, and the columns past the
    view's, as they were (compared bit for bit: nothing is computed)."""
    device = DEVICE if backend_name == "_triton_backend" else "cpu"
    gen = torch.Generator().manual_seed(9)
    full = (torch.rand(50, 300, generator=gen) + 0.5).to(dtype).to(device)
    dst = full[:, :290]  # a row stride past the columns
    rows = torch.randperm(50, generator=gen)[:21].to(device)
    expected = full.clone()
    expected[rows.cpu().tolist(), :290] = 0
    submodule(flce, backend_name).zero_rows(dst, rows)
    assert torch.equal(full, expected)


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_rows", [False, True])
@pytest.mark.parametrize("n_rows,vocab", [(40, 12), (300, 40000)], ids=["int16-keys", "int32-keys-strided"])
def test_add_target_rows_sums_each_targets_rows_once(flce, acc_dtype, with_rows, n_rows, vocab):
    """grad_weight's target terms: acc[t] += sum of c_i h_i over the rows with target t, with
    repeated targets (a frequent token; nine and eight rows), targets out of range (ignored, in another rank's
    slice, or 2^16 + 3, which int16 keys would wrap onto 3: no term), rows without a term (c = 0)
    and rows of hidden picked by an order; against float64, in one rounding to acc's dtype (fp16:
    2^-11 of the entry, and the fp32 sum's 2^-24 per term; fp32: the sum's), and bitwise the same
    on a second call (a fixed order of summation). V < 2^15 sorts int16 keys, 40000 int32 ones;
    300 rows are more blocks of 4 positions than the interpreter's programs (a grid-stride loop)."""
    backend = submodule(flce, "_triton_backend")
    gen = torch.Generator().manual_seed(5)
    hidden_size = 48
    hidden = torch.randn(n_rows + 7, hidden_size, generator=gen).to(DEVICE)
    targets = torch.randint(0, vocab, (n_rows,), generator=gen)
    targets[:9] = 3  # nine rows share a target (segments of several steps)
    targets[20:28] = vocab - 1  # eight
    targets[10], targets[11], targets[12] = -100, vocab + 2, 2**16 + 3
    target_grad = torch.randn(n_rows, generator=gen)
    target_grad[30:33] = 0.0  # rows without a term
    hidden_rows = torch.randperm(n_rows + 7, generator=gen)[:n_rows] if with_rows else None
    acc = torch.randn(vocab, hidden_size, generator=gen).to(device=DEVICE, dtype=acc_dtype)
    rows_of_hidden = hidden_rows if with_rows else torch.arange(n_rows)
    expected = acc.cpu().double().clone()
    for i in range(n_rows):
        if 0 <= targets[i] < vocab:
            expected[targets[i]] += target_grad[i].double() * hidden[rows_of_hidden[i]].cpu().double()
    outputs = []
    for _ in range(2):
        out = acc.clone()
        backend.add_target_rows(out, target_grad.to(DEVICE), targets.to(DEVICE), hidden,
                                None if hidden_rows is None else hidden_rows.to(DEVICE))
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    rounding = 2.0 ** -11 if acc_dtype == torch.float16 else 0.0
    bound = rounding * expected.abs() + 16 * 2.0 ** -24 * (expected.abs() + 10.0)
    assert bool(((outputs[0].cpu().double() - expected).abs() <= bound).all())
    untouched = torch.ones(vocab, dtype=torch.bool)
    untouched[targets[(targets >= 0) & (targets < vocab)]] = False
    assert torch.equal(outputs[0].cpu()[untouched], acc.cpu()[untouched])


@pytest.mark.skipif(DEVICE != "cuda", reason="a 4.3 GB grad_weight: on the GPU only")
def test_add_target_rows_reaches_entries_past_2_31(flce):
    """A grad_weight whose V * H passes 2^31 (H = 8192 and a 262k vocabulary; under int32 offsets
    the last rows wrap to addresses before the tensor): the terms land in their rows, in bf16's
    one rounding of the fp32 sum (2^-8 relative), and nowhere else."""
    backend = submodule(flce, "_triton_backend")
    gen = torch.Generator().manual_seed(6)
    hidden_size = 8192
    vocab = 2**31 // hidden_size + 8
    hidden = torch.randn(3, hidden_size, generator=gen)
    targets = torch.tensor([vocab - 1, 5, vocab - 1])
    target_grad = torch.randn(3, generator=gen)
    acc = torch.zeros(vocab, hidden_size, device=DEVICE, dtype=torch.bfloat16)
    backend.add_target_rows(acc, target_grad.to(DEVICE), targets.to(DEVICE), hidden.to(DEVICE))
    terms = target_grad.double()[:, None] * hidden.double()
    for row, expected in ((vocab - 1, terms[0] + terms[2]), (5, terms[1])):
        assert bool(((acc[row].cpu().double() - expected).abs() <= 2.0 ** -8 * expected.abs() + 1e-30).all())
    assert int(acc.count_nonzero()) == int(terms[1].count_nonzero() + (terms[0] + terms[2]).count_nonzero())


@pytest.mark.parametrize("options", [dict(), dict(bias=True), dict(softcap=4.0)], ids=["plain", "bias", "softcap"])
def test_forward_sweep_leaves_the_target_logit_to_the_product(flce, tune, monkeypatch, options):
    """A statistics sweep does not pick the target logit in its tiles (no target_logit for it: a compare
    and a select a logit fewer) but takes it from the tensor-core product of ``picked_logits``,
    with the tiles' bias, scale and softcap; the tiles pick it where ``_target_logit_by_product``
    says no (fp64 inputs; forced here). The per-row losses of both are equal to fp32 rounding, and
    the reference's. Chunks of 8 rows with 20% ignored: the target logits of every chunk land in
    their rows."""
    backend = submodule(flce, "_triton_backend")
    picks = []
    launch = backend._launch_tiles

    def recording_launch(kernel, hidden, weight, out, pointers, *args):
        if kernel is backend.K._tile_stats_kernel:  # its target_logit: None where it picks no target
            picks.append(pointers[8] is not None)
        return launch(kernel, hidden, weight, out, pointers, *args)

    monkeypatch.setattr(backend, "_launch_tiles", recording_launch)
    tune(chunk_rows=8)
    hidden, weight, targets, bias = make_inputs(37, H, V, torch.float32, seed=43, bias=options.get("bias", False),
                                                ignore=0.2, scale=3.0)
    softcap = options.get("softcap")
    losses = {}
    by_product = backend._target_logit_by_product
    for tile_target in ("1", "0"):
        monkeypatch.setattr(backend, "_target_logit_by_product", by_product if tile_target == "1" else lambda h: False)
        picks.clear()
        with torch.no_grad():
            losses[tile_target] = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="none",
                                                                  logit_scale=0.5, softcap=softcap)
        assert picks and all(pick == (tile_target == "0") for pick in picks), picks
    # The same H = 40 products in the same order (the interpreter: fp32 dots of 16-wide K steps
    # both), then the same operations: a few fp32 roundings of logits of size about 3.
    torch.testing.assert_close(losses["1"], losses["0"], rtol=0.0, atol=1e-5)
    ref = reference(hidden, weight, targets, bias, reduction="none", logit_scale=0.5, softcap=softcap)
    assert_rel(losses["1"], ref.loss, tolerance(torch.float32, "loss"), "loss")


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training_with_bias"])
def test_unfactored_sweeps_take_every_target_logit_in_one_launch(flce, tune, monkeypatch, training):
    """Without the factored gradient (a forward, or training with a bias), every row's target
    logit comes from one ``picked_logits`` call before the chunks, the rows of the step's order
    read in place (all of them, the ignored ones last), over several chunks (a forward's: at
    least 128 rows). The losses and gradients are the reference's."""
    target_kernels = submodule(flce, "_target_kernels")
    picked_rows = []
    picked_logits = target_kernels.picked_logits

    def recording_picked_logits(hidden, weight, targets, opts, bias=None, rows=None):
        picked_rows.append(targets.shape[0])
        return picked_logits(hidden, weight, targets, opts, bias, rows=rows)

    monkeypatch.setattr(target_kernels, "picked_logits", recording_picked_logits)
    n_rows, chunk = (37, 8) if training else (300, 128)
    tune(chunk_rows=chunk)
    hidden, weight, targets, bias = make_inputs(n_rows, H, V, torch.float32, seed=53, bias=training, ignore=0.2,
                                                scale=3.0)
    num_valid = int((targets != -100).sum())
    grad_output = None
    if training:  # (a reduced loss: gradients in the forward's sweep, where "none" recomputes them)
        loss = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="sum")
        grad_output = torch.tensor(0.4)
        (loss * grad_output).backward()
    else:
        with torch.no_grad():
            loss = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    assert num_valid > chunk and picked_rows == [n_rows], (picked_rows, num_valid)
    ref = reference(hidden, weight, targets, bias, reduction="sum" if training else "none", grad_output=grad_output)
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    if training:
        check_grads((hidden, weight, bias), ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES_16)
def test_product_target_logit_is_the_tiles_bit_for_bit(flce, monkeypatch, dtype):
    """On a GPU the target logit of _picked_logit_dot_kernel (a 64-row product on wgmma, N = 64)
    is the logit kernel's tile value bit for bit
    (m64n256k16 there): each wgmma output sums its own K terms in the same k16 steps, whatever N.
    So the per-row losses of a forward that picks z_t in its tiles (as for fp64 inputs; forced
    here) and of one that takes it from the product are equal. The interpreter's products are numpy's fp32
    matrix products, whose order of summation depends on the shapes: there, fp32 rounding of
    logits of size about 3 over H = 256 terms (1e-5)."""
    hidden, weight, targets, _ = make_inputs(200, 256, 512, dtype, seed=47, ignore=0.1, scale=3.0)
    backend = submodule(flce, "_triton_backend")
    by_product = backend._target_logit_by_product
    losses = {}
    for tile_target in ("0", "1"):
        monkeypatch.setattr(backend, "_target_logit_by_product", by_product if tile_target == "1" else lambda h: False)
        with torch.no_grad():
            losses[tile_target] = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    if DEVICE == "cuda":
        assert torch.equal(losses["1"], losses["0"])
    else:
        torch.testing.assert_close(losses["1"], losses["0"], rtol=0.0, atol=1e-5)
    ref = reference(hidden, weight, targets, reduction="none")
    assert_rel(losses["1"], ref.loss, tolerance(dtype, "loss"), "loss")


def test_row_reference_picks_each_rows_target_logit(flce):
    """row_reference's B and target logit (a tensor-core product) against float64: s * h_i . w_t,
    column 0's where the target is not
    a column of this weight (an ignored row, a target in another rank's slice), where the target
    logit is NaN. 37 rows: a partial last block of rows; H = 40: a partial K step."""
    hidden, weight, targets, _ = make_inputs(37, H, V, torch.float32, seed=31, scale=5.0)
    targets[3], targets[20] = -100, V + 5
    opts = submodule(flce, "_options").LossOptions(logit_scale=0.5)
    row_ref, target_logit = submodule(flce, "_triton_backend").row_reference(hidden.detach(), weight.detach(),
                                                                             targets, opts)
    local = (targets >= 0) & (targets < V)
    columns = torch.where(local, targets, 0).cpu()
    expected = 0.5 * (hidden.detach().cpu().double() * weight.detach().cpu().double()[columns]).sum(1)
    # fp32 products and sums of 40 terms of size about 5 / sqrt(40) each.
    torch.testing.assert_close(row_ref.cpu().double(), expected, rtol=1e-5, atol=1e-5)
    expected_target = torch.where(local.cpu(), expected, float("nan"))
    torch.testing.assert_close(target_logit.cpu().double(), expected_target, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("n_rows", [1000, 20000, 200000])
@pytest.mark.parametrize("backend_name", ["_triton_backend", "_torch_backend"])
@pytest.mark.parametrize("mean", [True, False])
def test_order_rows_is_a_stable_partition(flce, backend_name, mean, n_rows):
    """order_rows puts the rows with a loss first, each group in row order, with the ordered
    targets, their count and d loss / d loss_i (1, or 1 / count for a mean; 0 after the count).
    On a GPU 1000 rows are one program of the kernel, 20000 twenty (five when interpreting) and
    200000 forty-nine of the largest block, 4096 rows at 8 warps (also when interpreting)."""
    gen = torch.Generator().manual_seed(5)
    targets = torch.randint(0, 50, (n_rows,), generator=gen)
    targets[torch.rand(n_rows, generator=gen) < 0.3] = 7  # ignore_index 7, also a valid class id elsewhere
    device = DEVICE if backend_name == "_triton_backend" else "cpu"
    order, ordered, count, loss_grad = submodule(flce, backend_name).order_rows(targets.to(device), 7, mean)
    has_loss = targets != 7
    expected = torch.cat([torch.nonzero(has_loss)[:, 0], torch.nonzero(~has_loss)[:, 0]])
    assert torch.equal(order.cpu(), expected)
    assert torch.equal(ordered.cpu(), targets[expected])
    num = int(has_loss.sum())
    assert int(count) == num
    # 1 / count rounded as PyTorch's fp32 division, bit for bit: a trainer's mean over these rows
    # gives each the same weight, which the per-token backward compares exactly
    row_grad = torch.ones((), dtype=torch.float32) / num if mean else torch.ones((), dtype=torch.float32)
    expected_grad = torch.where(torch.arange(n_rows) < num, row_grad, 0.0)
    assert torch.equal(loss_grad.cpu(), expected_grad)


def test_device_tensors_use_the_triton_backend(flce, monkeypatch):
    """CUDA tensors, and CPU tensors under TRITON_INTERPRET=1, run the Triton kernels (this
    step's chunks are factored: one ``factored_sweep`` each)."""
    triton_calls = _count_calls(monkeypatch, submodule(flce, "_triton_backend"), "factored_sweep")
    torch_calls = _count_calls(monkeypatch, submodule(flce, "_torch_backend"), "row_stats")
    if DEVICE == "cpu":
        assert submodule(flce, "_triton_backend").interpreting()
    hidden, weight, targets, _ = make_inputs(N, H, V, torch.float32, seed=17)
    flce.fused_linear_cross_entropy(hidden, weight, targets).backward()
    assert triton_calls and not torch_calls


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_cpu_tensors_without_interpreter_use_the_torch_backend(flce, monkeypatch, reduction):
    """TRITON_INTERPRET unset (read at call time): CPU tensors take the chunked PyTorch path,
    which matches the reference and the Triton kernels' results."""
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=18, device="cpu", bias=True,
                                                ignore=0.2)
    kwargs = dict(reduction=reduction, label_smoothing=0.1, z_loss_scale=1e-2, softcap=5.0, return_metrics=True)

    def run(h, w, b):
        loss, metrics = flce.fused_linear_cross_entropy(h, w, targets.to(h.device), b, **kwargs)
        (loss * grad_output_for(loss, 0.6)).sum().backward()
        return loss, metrics

    # The Triton kernels on the test device (interpreter on CPU), for comparison.
    copies = [t.detach().to(DEVICE).requires_grad_() for t in (hidden, weight, bias)]
    triton_loss, triton_metrics = run(*copies)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch_calls = _count_calls(monkeypatch, submodule(flce, "_torch_backend"), "row_stats")
    triton_calls = _count_calls(monkeypatch, submodule(flce, "_triton_backend"), "row_stats")
    loss, metrics = run(hidden, weight, bias)
    assert torch_calls and not triton_calls

    ref = reference(hidden, weight, targets, bias, grad_output=grad_output_for(loss, 0.6),
                    **{k: v for k, v in kwargs.items() if k != "return_metrics"})
    tol = tolerance(torch.float32, "loss")
    assert_rel(loss, ref.loss, tol, "loss")
    check_metrics(metrics, ref, torch.float32, reduction)
    check_grads((hidden, weight, bias), ref, torch.float32)
    # Same results as the Triton kernels, up to fp32 rounding.
    assert_rel(loss, triton_loss.cpu(), tol, "loss vs triton")
    assert int(metrics["num_correct_tokens"]) == int(triton_metrics["num_correct_tokens"])
    for mine, theirs in zip((hidden, weight, bias), copies, strict=True):
        assert_rel(mine.grad, theirs.grad.cpu(), tolerance(torch.float32, "grad"), "grad vs triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning runs on the GPU only")
@pytest.mark.parametrize("tuned", [False, True], ids=["autotuner", "shipped"])
def test_autotuned_launch_matches_reference(flce, tune, tuned):
    """The suite launches one fixed configuration on the GPU; this case goes through the
    autotuner (every candidate configuration runs, the TMA descriptors get their blocks from
    its pre-hook), or on a GPU with a shipped configuration (sm_90) through that one, and must
    give the same answers."""
    tune(autotune=True, tuned=tuned)
    hidden, weight, targets, bias = make_inputs(300, 256, 1000, torch.bfloat16, seed=31, bias=True)
    loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True)
    loss.backward()
    ref = reference(hidden, weight, targets, bias, grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, tolerance(torch.bfloat16, "loss"), "loss")
    check_metrics(metrics, ref, torch.bfloat16)
    check_grads((hidden, weight, bias), ref, torch.bfloat16)


def test_autocast_inputs_take_the_autocast_dtype(flce):
    """Under torch.autocast the kernel computes in the autocast dtype, as F.linear would: fp32
    leaves are cast (differentiably), so their gradients come back in fp32. The reference is
    the float64 loss of the inputs rounded to that dtype. (fp16 on the CPU: the interpreter's
    bf16 products are wrong; bf16 on the GPU.)"""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    hidden, weight, targets, bias = make_inputs(N, H, V, torch.float32, seed=51, bias=True, ignore=0.2)
    with torch.autocast(DEVICE, dtype=dtype):
        loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.float32
    rounded = [t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    ref = reference(*rounded[:2], targets, rounded[2], grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, tolerance(dtype, "loss"), "loss")
    check_metrics(metrics, ref, dtype)
    # the gradients pass back through the casts: the 16-bit ones, in fp32
    for t, expected in ((hidden, ref.grad_hidden), (weight, ref.grad_weight), (bias, ref.grad_bias)):
        assert_rel(t.grad, expected, tolerance(dtype, "grad"), "grad")
    # outside autocast, mixed dtypes are refused
    with pytest.raises(TypeError, match="weight"):
        flce.fused_linear_cross_entropy(hidden.detach().to(dtype), weight.detach(), targets)


def _relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected| (the benchmark's measure)."""
    expected = expected.double().cpu()
    return float((actual.double().cpu() - expected).abs().max() / expected.abs().max())


@pytest.mark.skipif(DEVICE != "cuda", reason=BF16_ON_CPU)
@pytest.mark.parametrize("inputs", ["uniform", "peaked"])
def test_bf16_gradients_over_many_chunks_are_no_worse_than_pytorchs(flce, tune, inputs):
    """A bf16 step in 8 chunks: grad_hidden's and grad_weight's errors against float64 are at
    most PyTorch's bf16 step's (F.cross_entropy of hidden @ weight.T) on the same inputs. On a
    nearly uniform softmax (logits of size 0.02) each row's target entry is its largest term; on
    a peaked one (logits of size 6) the targets are drawn from the softmax itself, as a trained
    model's. The target entries stay out of the bf16 products and of grad_weight's running sum,
    which is what keeps grad_weight there (perf notes, run 52)."""
    n, h, v = 2048, 512, 8000
    tune(chunk_rows=256)
    hidden, weight, targets, _ = make_inputs(n, h, v, torch.bfloat16, seed=83,
                                             scale=0.02 if inputs == "uniform" else 6.0)
    if inputs == "peaked":
        probs = torch.softmax(hidden.double() @ weight.double().T, dim=1).cpu()
        targets = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(2))[:, 0].to(DEVICE)
    ref = reference(hidden, weight, targets, grad_output=torch.tensor(1.0))
    flce.fused_linear_cross_entropy(hidden, weight, targets).backward()
    ours = (hidden.grad, weight.grad)
    plain_hidden, plain_weight = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    torch.nn.functional.cross_entropy((plain_hidden @ plain_weight.T).float(), targets).backward()
    for name, got, plain, expected in (("grad_hidden", ours[0], plain_hidden.grad, ref.grad_hidden),
                                       ("grad_weight", ours[1], plain_weight.grad, ref.grad_weight)):
        error, plain_error = _relative_error(got, expected), _relative_error(plain, expected)
        assert error <= plain_error, f"{name} on {inputs} inputs: {error:.3g} against PyTorch's {plain_error:.3g}"


def test_a_factored_chunk_drops_its_gathered_rows_before_grad_hidden(flce, tune, monkeypatch):
    """A factored chunk's gathered hidden rows (a copy of H x element size bytes a row) are gone
    once its scaled copy is made, before grad_hidden's fp32 block comes: the chunk plan counts
    H x 4 bytes a row beside the buffer, one of these at a time. (The chunk loop's generator once
    kept them, one chunk of hidden rows more at the step's peak.)"""
    import weakref

    chunked = submodule(flce, "_chunked")
    tune(chunk_rows=8)
    gathered, alive_at_grad_hidden = [], []
    take, add_hidden_grad = chunked.RowOrder.take, chunked.Gradients.add_hidden_grad

    def recording_take(self, t, start, end):
        rows = take(self, t, start, end)
        if rows.data_ptr() != t[start:end].data_ptr():  # a gathered copy, not a view of t
            gathered.append(weakref.ref(rows))
        return rows

    def checking_add_hidden_grad(self, *args, **kwargs):
        alive_at_grad_hidden.append(gathered[-1]() is not None if gathered else None)
        return add_hidden_grad(self, *args, **kwargs)

    monkeypatch.setattr(chunked.RowOrder, "take", recording_take)
    monkeypatch.setattr(chunked.Gradients, "add_hidden_grad", checking_add_hidden_grad)
    hidden, weight, targets, _ = make_inputs(37, H, V, torch.float32, seed=91, ignore=0.3)
    flce.fused_linear_cross_entropy(hidden, weight, targets).backward()
    assert gathered and len(alive_at_grad_hidden) > 1
    assert not any(alive_at_grad_hidden), alive_at_grad_hidden
