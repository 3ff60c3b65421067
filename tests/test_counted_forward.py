"""A forward that stops at the count of rows with a loss on the device (``counts_on_device``).

Where the Gluon statistics compute a forward (Hopper, 16-bit, plain logits), the host never
reads the count of rows with a loss: every chunk is planned from all the rows, in the order that
puts the rows with a loss first, and each chunk's sweep skips, on the device, the rows past the
count; they get an empty row's statistics (max 0, sum of exponentials 1, so lse 0), as rows never
computed. Here the chunk loop takes that path on any device (``counts_on_device`` forced on), the
Triton logit kernel or PyTorch computing the statistics; ``test_gluon_stats.py`` runs the Gluon
kernel itself on an H100 / H200."""

import pytest
import torch
from conftest import DEVICE, DTYPES, assert_rel, make_inputs, submodule, tolerance
from reference import reference


def _counted(monkeypatch, flce):
    """The chunk loop's backend with ``counts_on_device`` forced on; returns the module and the
    (start, count) of each ``row_stats`` call's ``row_count``. Reading the count on the host fails."""
    chunked = submodule(flce, "_chunked")
    backend = chunked.backend_for(torch.device(DEVICE))
    monkeypatch.setattr(backend, "counts_on_device", lambda *args: True)
    calls, row_stats = [], backend.row_stats

    def spy(*args, row_count=None, **kwargs):
        calls.append(None if row_count is None else (row_count[1], int(row_count[0])))
        return row_stats(*args, row_count=row_count, **kwargs)

    def no_host_read(self):
        raise AssertionError("a counted forward read the count on the host")

    monkeypatch.setattr(backend, "row_stats", spy)
    monkeypatch.setattr(chunked._RowOrder, "rows_to_compute", no_host_read)
    return chunked, calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_a_counted_forward_stops_at_the_count_on_the_device(flce, monkeypatch, dtype, reduction):
    """600 rows, about half of them ignored, in chunks of one row block (128 rows, or the Gluon
    kernel's 192 on Hopper in 16 bits) planned from all 600: the count falls in the second or third
    chunk, the last two hold only ignored rows. Losses are float64's, the rows with a loss get
    their lse and the ignored rows lse 0 exactly."""
    chunked, calls = _counted(monkeypatch, flce)
    monkeypatch.setenv("FLCE_CHUNK_ROWS", "128")
    hidden, weight, targets, _ = make_inputs(600, 32, 100, dtype, seed=11, ignore=0.5, requires_grad=False)
    valid = targets != -100
    count = int(valid.sum())
    options = submodule(flce, "_options").LossOptions()
    with torch.no_grad():
        result = chunked.forward(hidden, weight, targets, None, options, reduction)
    block = chunked.backend_for(hidden.device).row_block(dtype, options, False, False, False, hidden.device)
    assert block < count < 384, "the inputs must leave the last two chunks without a row with a loss"
    assert calls == [(start, count) for start in range(0, 600, block)]
    expected = reference(hidden, weight, targets, reduction=reduction)
    assert_rel(result.loss, expected.loss, tolerance(dtype, "loss"), f"loss ({reduction})")
    lse = result.lse.cpu()
    assert_rel(lse[valid.cpu()], expected.lse[valid.cpu()], tolerance(dtype, "loss"), "lse of the rows with a loss")
    assert torch.equal(lse[~valid.cpu()], torch.zeros(len(targets) - count)), "ignored rows: lse 0"


def test_the_public_function_takes_the_counted_forward(flce, monkeypatch):
    """``fused_linear_cross_entropy`` without gradients, through the op: the same per-row losses
    (0 at ignored rows) with the count never read on the host."""
    _, calls = _counted(monkeypatch, flce)
    hidden, weight, targets, _ = make_inputs(200, 32, 100, torch.float32, seed=12, ignore=0.4, requires_grad=False)
    with torch.no_grad():
        losses = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    assert calls == [(0, int((targets != -100).sum()))]
    expected = reference(hidden, weight, targets, reduction="none").loss
    assert_rel(losses, expected, tolerance(torch.float32, "loss"), "per-row loss")


@pytest.mark.parametrize("backend_name", ["_triton_backend", "_torch_backend"])
@pytest.mark.parametrize("count, start", [(7, 3), (2, 3), (30, 0)])
def test_row_stats_give_rows_past_the_count_an_empty_rows_statistics(flce, backend_name, count, start):
    """A chunk of 10 rows that starts at row ``start`` of the counted rows: rows [0, count - start)
    get their max and sum of exp(z - max) (float64's), the others max 0 and sum 1."""
    backend = submodule(flce, backend_name)
    device = "cpu" if backend_name == "_torch_backend" else DEVICE
    hidden, weight, targets, _ = make_inputs(10, 16, 70, torch.float32, seed=count, device=device,
                                             requires_grad=False)
    row_count = (torch.tensor([count], device=device), start)
    stats, _ = backend.row_stats(hidden, weight, None, targets, submodule(flce, "_options").LossOptions(),
                                 row_count=row_count)
    z = hidden.double().cpu() @ weight.double().cpu().T
    counted = torch.arange(10) < count - start
    expected_max = torch.where(counted, z.amax(dim=1), 0.0)
    expected_sum = torch.where(counted, (z - z.amax(dim=1, keepdim=True)).exp().sum(dim=1), 1.0)
    assert_rel(stats.row_max, expected_max, tolerance(torch.float32, "loss"), "row max")
    assert_rel(stats.sum_exp, expected_sum, tolerance(torch.float32, "loss"), "sum of exponentials")
    assert torch.equal(stats.row_max.cpu()[~counted], torch.zeros(int((~counted).sum())))
    assert torch.equal(stats.sum_exp.cpu()[~counted], torch.ones(int((~counted).sum())))
