"""The logit sweeps' statistics in Gluon (``_gluon_stats``), on a Hopper GPU: the same tile statistics
as float64's, the forward that takes them (chunks in whole 192-row tiles) the same losses, and the
training sweep's stored exponentials float64's.

The interpreter runs no Gluon, so these run on an H100 / H200 only; on any machine
``test_hopper_compile.py`` compiles the kernel for sm_90."""

import pytest
import torch
from conftest import DEVICE, DTYPES_16, assert_rel, make_inputs, submodule, tolerance
from reference import reference

HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not HOPPER, reason="Gluon's warp-specialised wgmma kernel runs on sm_90 only")


def _gluon(flce):
    """The loaded kernel's ``_gluon_stats`` (imported by the Triton backend on first use)."""
    module = submodule(flce, "_triton_backend")._gluon_stats_module()
    assert module is not None, "sm_90 with this Triton: the Gluon module must load"
    return module


def _float64_tile_stats(hidden, weight, block_v=256):
    """Each (row, block_v-column tile)'s max and log of sum of exp(z - max), in float64."""
    z = hidden.double() @ weight.double().T
    pad = -z.shape[1] % block_v
    z = torch.nn.functional.pad(z, (0, pad), value=float("-inf")).view(z.shape[0], -1, block_v)
    tile_max = z.amax(dim=2)
    return tile_max, (z - tile_max[..., None]).exp().sum(dim=2).log()


@pytest.mark.parametrize("dtype", DTYPES_16)
@pytest.mark.parametrize("n, h, v, group_rows, programs", [
    (192, 64, 256, 4096, 132),  # one tile
    (1000, 256, 1000, 4096, 132),  # partial row block and vocabulary tile (columns masked)
    (2500, 512, 2048, 384, 7),  # groups of two row blocks, a few programs looping over many tiles
    (4032, 128, 32000, 4032, 132),  # the forward's chunk of Llama-2's vocabulary
])
def test_tile_statistics_match_float64(flce, dtype, n, h, v, group_rows, programs):
    gluon = _gluon(flce)
    hidden, weight, _, _ = make_inputs(n, h, v, dtype, seed=n + v, scale=8.0, requires_grad=False)
    tiles = -(-v // 256)
    tile_max = torch.full((n, tiles), float("nan"), device=DEVICE)
    tile_sum = torch.full((n, tiles), float("nan"), device=DEVICE)
    gluon.tile_stats(hidden, weight, tile_max, tile_sum, group_rows, programs)
    expected_max, expected_log_sum = _float64_tile_stats(hidden, weight)
    # fp32 sums of h products of 16-bit inputs (exact products): the rounding of a sum of h
    # terms is at most h * 2^-24 of the sum of their magnitudes; every entry must be written.
    bound = h * 2.0**-24 * (hidden.double().abs() @ weight.double().abs().T).max().item()
    assert not tile_max.isnan().any() and not tile_sum.isnan().any()
    assert (tile_max.double().cpu() - expected_max.cpu()).abs().max().item() <= bound
    # log sum exp(z - max): the logits' rounding (twice: z and max) plus the exponentials' and
    # the sum's fp32 rounding (256 terms, each at most 1).
    log_sum_bound = 2 * bound + 256 * 2.0**-22
    assert (tile_sum.log().double().cpu() - expected_log_sum.cpu()).abs().max().item() <= log_sum_bound


def _spy_gluon(monkeypatch, flce):
    """Counts the launches of the Gluon statistics kernel and records the rows of each."""
    gluon = _gluon(flce)
    rows, original = [], gluon.tile_stats

    def spy(hidden, *args):
        rows.append(hidden.shape[0])
        return original(hidden, *args)

    monkeypatch.setattr(gluon, "tile_stats", spy)
    return rows


@pytest.mark.parametrize("dtype", DTYPES_16)
def test_the_forward_takes_the_gluon_statistics_in_whole_tiles(flce, monkeypatch, dtype):
    """A forward without gradients of plain logits: its chunks are whole 192-row tiles (but the
    last), its statistics come from the Gluon kernel, and its losses are float64's; with
    ``gluon`` off the logit kernel computes the same losses."""
    n, h, v = 9000, 128, 1000
    hidden, weight, targets, _ = make_inputs(n, h, v, dtype, seed=7, ignore=0.1, requires_grad=False)
    expected = reference(hidden, weight, targets, reduction="none").loss
    rows = _spy_gluon(monkeypatch, flce)
    with torch.no_grad():
        losses = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    assert len(rows) >= 2 and all(r % 192 == 0 for r in rows[:-1]) and max(rows) <= 4032
    assert sum(rows) == int((targets != -100).sum())  # the ignored rows are skipped
    assert_rel(losses, expected, tolerance(dtype, "loss"), "loss, Gluon statistics")
    rows.clear()
    with submodule(flce, "_settings").override(gluon=False), torch.no_grad():
        losses_triton = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    assert rows == []
    assert_rel(losses_triton, expected, tolerance(dtype, "loss"), "loss, logit kernel")


@pytest.mark.parametrize("options", [
    dict(return_metrics=True), dict(softcap=30.0), dict(logit_scale=0.5), dict(label_smoothing=0.1), dict(bias=True),
])
def test_the_gluon_statistics_leave_other_forwards_to_the_logit_kernel(flce, monkeypatch, options):
    """Metrics, softcap, a logit scale, smoothing's logit sum and a bias need the logit
    kernel's epilogue: the Gluon kernel is not launched, and the losses are float64's."""
    options = dict(options)
    hidden, weight, targets, bias = make_inputs(600, 64, 500, torch.bfloat16, seed=3, bias=options.pop("bias", False),
                                                requires_grad=False)
    rows = _spy_gluon(monkeypatch, flce)
    with torch.no_grad():
        out = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="none", **options)
    losses = out[0] if isinstance(out, tuple) else out
    reference_options = {k: val for k, val in options.items() if k != "return_metrics"}
    expected = reference(hidden, weight, targets, bias, reduction="none", **reference_options).loss
    assert rows == []
    assert_rel(losses, expected, tolerance(torch.bfloat16, "loss"), f"loss with {options}")


def test_a_gluon_kernel_that_fails_to_launch_leaves_the_forward_to_the_logit_kernel(flce, monkeypatch):
    """Gluon is experimental: where another Triton refuses the kernel, its first launch warns
    and the logit kernel computes the forward (the same losses), from then on."""
    backend = submodule(flce, "_triton_backend")
    gluon = _gluon(flce)
    monkeypatch.setattr(backend, "_gluon_compiled", set())
    monkeypatch.setattr(backend, "_gluon_stats", gluon)  # restored after the test

    def refuse(*args):
        raise RuntimeError("a Gluon this kernel was not written for")

    monkeypatch.setattr(gluon, "tile_stats", refuse)
    hidden, weight, targets, _ = make_inputs(600, 64, 500, torch.bfloat16, seed=5, requires_grad=False)
    with pytest.warns(UserWarning, match="Gluon statistics kernel failed"), torch.no_grad():
        losses = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    assert backend._gluon_stats_module() is None
    plan = submodule(flce, "_plan")
    assert plan.row_block(torch.bfloat16, backend.LossOptions(), False, False, False,
                          backend.hardware(hidden.device)) == 128
    expected = reference(hidden, weight, targets, reduction="none").loss
    assert_rel(losses, expected, tolerance(torch.bfloat16, "loss"), "loss after the fallback")


@pytest.mark.parametrize("n, h, v", [
    (1000, 256, 1000),  # partial row block and vocabulary tile
    (1536, 128, 32000),  # a training chunk of Llama-2's vocabulary: 8 whole tiles of rows
])
def test_the_training_sweep_stores_the_exponentials_of_float64(flce, n, h, v):
    """The factored training sweep (STORE_EXP, the logit kernel's mode 3) in Gluon: each tile's
    max, its sum of exp(z - m) and exp(z - m) itself in the chunk buffer (stored by the copy
    engine half a tile at a time, clipped at the buffer's edges), with m the row's
    reference B_i unless the tile max passes it by more than the gap; rows without gradient
    store zeros. References below the row max by 3 (the usual case), by 60 (tiles near the max
    keep their own) and above it by 2 (every tile on B_i)."""
    gluon = _gluon(flce)
    hidden, weight, _, _ = make_inputs(n, h, v, torch.bfloat16, seed=n + v, scale=8.0, requires_grad=False)
    z = hidden.double() @ weight.double().T
    rows = torch.arange(n, device=DEVICE)
    row_ref = (z.amax(dim=1) + torch.tensor([-3.0, -60.0, 2.0], device=DEVICE, dtype=torch.float64)[rows % 3]).float()
    loss_grad = torch.where(rows % 5 == 0, 0.0, 1.0 + rows / n).float()
    tiles = -(-v // 256)
    tile_max = torch.full((n, tiles), float("nan"), device=DEVICE)
    tile_sum = torch.full((n, tiles), float("nan"), device=DEVICE)
    buffer = torch.full((n, v), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    gluon.tile_stats(hidden, weight, tile_max, tile_sum, 4096, 132, row_ref, loss_grad, buffer)
    assert not tile_max.isnan().any() and not tile_sum.isnan().any() and not buffer.isnan().any()
    expected_max, _ = _float64_tile_stats(hidden, weight)
    bound = h * 2.0**-24 * (hidden.double().abs() @ weight.double().abs().T).max().item()
    assert (tile_max.double() - expected_max).abs().max().item() <= bound
    # The reference each tile took, from the kernel's own tile max (float64's is within bound of
    # it, and the choice is a comparison of that max with B_i + 40).
    gap = submodule(flce, "_kernel_math").REFERENCE_GAP.value
    reference = torch.where(tile_max > row_ref[:, None] + gap, tile_max, row_ref[:, None]).double()
    reference = reference.repeat_interleave(256, dim=1)[:, :v]
    exponentials = (z - reference).exp()
    assert (rows % 3 == 1).any() and (reference != row_ref.double()[:, None]).any()  # both references occur
    # The sums (up to 256 terms) and the stored values, relative: the logits' rounding (bound,
    # twice with a tile max as reference: z and m), fp32 exp and sums, and bf16's rounding of
    # the stored values (8 significant bits: at most 2^-8 relative; 2^-8 is reached on these
    # 49M entries). Exponentials below fp32's smallest normal (2^-126, z - m < -87.3) flush to 0
    # (exp2's .ftz form, ``_kernel_math.LOG2E``): those are checked within 2^-126, absolutely.
    expected_sums = torch.nn.functional.pad(exponentials, (0, tiles * 256 - v)).view(n, tiles, 256).sum(dim=2)
    assert_rel(tile_sum / expected_sums, torch.ones_like(expected_sums), 2 * bound + 256 * 2.0**-22,
               "sum of exponentials")
    expected = torch.where((loss_grad != 0)[:, None], exponentials, 0.0)
    tiny = torch.finfo(torch.float32).tiny
    error = (buffer.double() - expected).abs()
    normal = expected >= tiny
    assert (error[normal] / expected[normal]).max().item() <= 2.0**-8 + 2 * bound + 2.0**-22
    assert (error[~normal] <= tiny).all()
    assert (buffer[expected == 0] == 0).all()


def _spy_training_sweeps(monkeypatch, flce):
    """Rows of each launch of the Gluon kernel that stores a training chunk's exponentials."""
    gluon = _gluon(flce)
    rows, original = [], gluon.tile_stats

    def spy(hidden, weight, tile_max, tile_sum_exp, group_rows, programs, row_ref=None, loss_grad=None, buffer=None):
        if buffer is not None:
            rows.append(hidden.shape[0])
        return original(hidden, weight, tile_max, tile_sum_exp, group_rows, programs, row_ref, loss_grad, buffer)

    monkeypatch.setattr(gluon, "tile_stats", spy)
    return rows


@pytest.mark.parametrize("n, h, v", [(2000, 256, 1000), (3000, 128, 2048)])
def test_a_training_step_takes_the_gluon_sweep_where_asked(flce, monkeypatch, n, h, v):
    """A bf16 training step of plain logits (``gluon_training``, the default): every chunk's
    sweep stores its exponentials from the Gluon kernel, and the loss and gradients are
    float64's; without ``gluon_training`` the logit kernel computes the same."""
    hidden, weight, targets, _ = make_inputs(n, h, v, torch.bfloat16, seed=n, ignore=0.1)
    ref = reference(hidden, weight, targets, grad_output=torch.tensor(1.0))
    rows = _spy_training_sweeps(monkeypatch, flce)
    for gluon_training in (True, False):
        rows.clear()
        hidden.grad = weight.grad = None
        with submodule(flce, "_settings").override(gluon_training=gluon_training):
            loss = flce.fused_linear_cross_entropy(hidden, weight, targets)
            loss.backward()
        if gluon_training:
            assert len(rows) >= 2  # several chunks
            assert sum(rows) == int((targets != -100).sum())  # the ignored rows are skipped
        else:
            assert rows == []
        what = f"gluon_training={gluon_training}"
        assert_rel(loss, ref.loss, tolerance(torch.bfloat16, "loss"), f"loss, {what}")
        assert_rel(hidden.grad, ref.grad_hidden, tolerance(torch.bfloat16, "grad"), f"grad_hidden, {what}")
        assert_rel(weight.grad, ref.grad_weight, tolerance(torch.bfloat16, "grad"), f"grad_weight, {what}")


@pytest.mark.parametrize("row_block", [192, 128])
def test_a_training_step_spreads_its_chunks_in_the_sweeps_tiles(flce, monkeypatch, row_block):
    """Chunks of at most 768 rows (``chunk_rows``): the first takes 768, and the rest of the
    rows with a loss are spread over as few chunks as they need, every one but the last in
    whole 192-row tiles of the Gluon sweep (``training_row_block`` 128: the logit kernel's 128);
    the gradients stay float64's."""
    hidden, weight, targets, _ = make_inputs(2000, 128, 1000, torch.bfloat16, seed=17, ignore=0.1)
    count = int((targets != -100).sum())
    ref = reference(hidden, weight, targets, grad_output=torch.tensor(1.0))
    rows = _spy_training_sweeps(monkeypatch, flce)
    with submodule(flce, "_settings").override(chunk_rows=768, training_row_block=row_block):
        flce.fused_linear_cross_entropy(hidden, weight, targets).backward()
    assert rows[0] == 768 and sum(rows) == count
    assert len(rows) == 1 + -(-(count - 768) // 768)
    assert all(r % row_block == 0 for r in rows[1:-1]) and 0 < rows[-1] <= rows[1]
    if row_block == 192:  # and not 128-row blocks (about 1040 rows after the first: 576, then the rest)
        assert any(r % 128 for r in rows[1:-1]), rows
    assert_rel(hidden.grad, ref.grad_hidden, tolerance(torch.bfloat16, "grad"), f"grad_hidden, {row_block}")
    assert_rel(weight.grad, ref.grad_weight, tolerance(torch.bfloat16, "grad"), f"grad_weight, {row_block}")


@pytest.mark.parametrize("options", [dict(return_metrics=True), dict(z_loss_scale=1e-3), dict(dtype=torch.float16)])
def test_training_steps_the_gluon_sweep_cannot_take_use_the_logit_kernel(flce, monkeypatch, options):
    """With ``gluon_training`` on, metrics (the entropy and argmax of each tile), z-loss and
    fp16 (neither factored) keep the logit kernel's training sweep: no Gluon launch stores a
    buffer, and the gradients are float64's."""
    options = dict(options)
    dtype = options.pop("dtype", torch.bfloat16)
    hidden, weight, targets, _ = make_inputs(1000, 128, 700, dtype, seed=11, ignore=0.1)
    rows = _spy_training_sweeps(monkeypatch, flce)
    with submodule(flce, "_settings").override(gluon_training=True):
        out = flce.fused_linear_cross_entropy(hidden, weight, targets, **options)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
    assert rows == []
    ref = reference(hidden, weight, targets, grad_output=torch.tensor(1.0),
                    **{k: val for k, val in options.items() if k != "return_metrics"})
    assert_rel(hidden.grad, ref.grad_hidden, tolerance(dtype, "grad"), f"grad_hidden with {options}")
    assert_rel(weight.grad, ref.grad_weight, tolerance(dtype, "grad"), f"grad_weight with {options}")
