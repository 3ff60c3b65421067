"""The chunk plan: how many rows each chunk of the loop computes (pure Python, no kernels).

When ignored rows are skipped, the number of rows to compute is known only once the first
chunk's work is queued; the plan must then use as few chunks as that number needs."""

import math

import torch
from conftest import DEVICE, submodule
from hypothesis import given, settings
from hypothesis import strategies as st


class _Count:
    """Stands for a ``_row_order.RowOrder`` whose count of rows with a loss is ``count``."""

    def __init__(self, count: int):
        self.count = count
        self.asked = 0

    def rows_to_compute(self) -> int:
        self.asked += 1
        return self.count


# Settings whose defaults the plans below assume, whatever FLCE_CHUNK_ROWS and FLCE_BUFFER_MIB say.
DEFAULTS = dict(chunk_rows=None, buffer_mib=None)


def _plan(flce, n_rows, chunk, count, training, row_block=128, sweep_tiles=None):
    plan = submodule(flce, "_plan")
    order = None if count is None else _Count(count)
    first = plan.first_chunk_rows(n_rows, chunk, order, training, row_block, sweep_tiles)
    return first, list(plan.spans(n_rows, chunk, order, first, row_block, sweep_tiles))


def _triton_rows(flce, *args, **kwargs):
    """Rows per chunk of the Triton backend (``_plan.chunk_rows``)."""
    return submodule(flce, "_plan").chunk_rows("triton", *args, **kwargs)


def _rounds(spans, row_block, tiles_per_block, programs):
    """Rounds of the persistent sweeps of these chunks: ceil(row blocks x tiles / programs) each."""
    return sum(math.ceil(math.ceil((end - start) / row_block) * tiles_per_block / programs) for start, end in spans)


def test_llama3_step_at_8192_rows(flce):
    """8192 rows of which 7373 have a loss, chunks of at most 1536 rows: five chunks, the
    last four spread over the 5837 rows after the first, in whole blocks of 128 rows."""
    first, spans = _plan(flce, 8192, 1536, 7373, training=True)
    assert first == 1536
    assert spans == [(0, 1536), (1536, 3072), (3072, 4608), (4608, 6144), (6144, 7373)]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(n_rows=st.integers(1, 20000), blocks=st.integers(1, 40), row_block=st.sampled_from([128, 192]),
       kept=st.floats(0.0, 1.0), training=st.booleans())
def test_spans_cover_the_rows_to_compute_in_the_fewest_chunks(flce, n_rows, blocks, row_block, kept, training):
    count = round(kept * n_rows)
    chunk = blocks * row_block
    first, spans = _plan(flce, n_rows, chunk, count, training, row_block)
    total = max(first, count)
    assert spans[0] == (0, first)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # contiguous
    assert spans[-1][1] == total
    assert all(0 < end - start <= chunk for start, end in spans)
    # the first chunk is taken blind; after it, as few chunks as the remaining rows need, each
    # but the last in whole row blocks
    assert len(spans) == 1 + math.ceil((total - first) / chunk)
    assert all((end - start) % row_block == 0 for start, end in spans[1:-1])


def test_llama2_forward_chunks_fill_their_rounds(flce):
    """Llama-2's head (125 tiles of 256 a row block) on 132 multiprocessors, a forward of 8192
    rows of which 7373 have a loss, in 192-row tiles, chunks of at most 4032 (21 blocks): the
    first chunk takes 19 blocks (2375 tiles, 18 rounds for 17.99 of work; 21 blocks take 20 for
    19.89), the rest (3725 rows, 20 blocks) 19 rounds: 37 against the even plan's 20 + 18; and
    where the rest takes several chunks, their sizes fill rounds too."""
    first, spans = _plan(flce, 8192, 4032, 7373, training=False, row_block=192, sweep_tiles=(125, 132))
    assert first == 3648 and spans == [(0, 3648), (3648, 7373)]
    assert _rounds(spans, 192, 125, 132) == 37
    even_first, even = _plan(flce, 8192, 4032, 7373, training=False, row_block=192)
    assert even == [(0, 4032), (4032, 7373)] and _rounds(even, 192, 125, 132) == 38
    # 32768 rows, 29491 with a loss: after the same first chunk, the 25843 others take 7 chunks
    # either way; six of 19 blocks (18 rounds each) and the last 3955 rows (21 blocks, 20 rounds)
    # make 128 rounds, the even six of 20 blocks (19 each) and 2803 rows (15 blocks, 15) 129.
    first, spans = _plan(flce, 32768, 4032, 29491, training=False, row_block=192, sweep_tiles=(125, 132))
    assert first == 3648 and [end - start for start, end in spans] == [3648] * 7 + [3955]
    assert _rounds(spans, 192, 125, 132) == 18 + 128


def test_llama3_forward_half_first_fills_its_rounds(flce):
    """Llama-3's head (501 tiles a row block), 4096 rows of which 3686 have a loss: at most half
    first, 11 blocks (2112 rows, 42 rounds for 41.75 of work), or 10 (1920 rows, 38 for 37.95);
    the rest then 1766 rows (10 blocks, 38 rounds): 76 against 2112 + 1574 rows' 42 + 35."""
    first, spans = _plan(flce, 4096, 4032, 3686, training=False, row_block=192, sweep_tiles=(501, 132))
    assert first == 1920 and spans == [(0, 1920), (1920, 3686)]
    assert _rounds(spans, 192, 501, 132) == 76
    assert _rounds(_plan(flce, 4096, 4032, 3686, training=False, row_block=192)[1], 192, 501, 132) == 77


@settings(max_examples=500, deadline=None, derandomize=True)
@given(n_rows=st.integers(1, 40000), blocks=st.integers(1, 24), row_block=st.sampled_from([128, 192]),
       kept=st.floats(0.0, 1.0), tiles=st.integers(1, 1200), programs=st.integers(1, 200))
def test_round_filled_chunks_keep_the_plan_and_never_take_more_rounds(flce, n_rows, blocks, row_block, kept, tiles,
                                                                     programs):
    """Chunks sized to fill their rounds (a forward's, ``sweep_tiles``) keep the plan's rules (the
    rows covered once, in as few chunks as the rest needs, each at most ``chunk`` and in whole
    row blocks but the last; a first chunk of 85% to 100% of the plain plan's) and, after the same
    first chunk, never take more rounds than the even spread."""
    count = round(kept * n_rows)
    chunk = blocks * row_block
    first, spans = _plan(flce, n_rows, chunk, count, training=False, row_block=row_block,
                         sweep_tiles=(tiles, programs))
    total = max(first, count)
    assert spans[0] == (0, first) and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(0 < end - start <= chunk for start, end in spans)
    assert len(spans) == 1 + math.ceil((total - first) / chunk)
    assert all((end - start) % row_block == 0 for start, end in spans[1:-1])
    if first < total:  # rows follow: 85-100% of a whole chunk, or of half the rows (a forward's split)
        half = math.ceil(math.ceil(n_rows / 2) / row_block) * row_block if n_rows >= 2048 else n_rows
        planned = min(chunk, n_rows, half)
        assert math.ceil(0.85 * (planned // row_block)) * row_block <= first <= planned
    even = list(submodule(flce, "_plan").spans(n_rows, chunk, _Count(count), first, row_block))
    assert _rounds(spans, row_block, tiles, programs) <= _rounds(even, row_block, tiles, programs)


def test_a_forward_that_fits_one_chunk_computes_half_first(flce):
    """Without gradients (no accumulation per chunk), 4096 rows that fit one chunk are taken as
    2048 then the rest with a loss, so that ignored rows beyond them are left out; with
    gradients, or when every row is computed anyway, one chunk."""
    assert _plan(flce, 4096, 4096, 3686, training=False) == (2048, [(0, 2048), (2048, 3686)])
    assert _plan(flce, 4096, 4096, 3686, training=True) == (4096, [(0, 4096)])
    assert _plan(flce, 4096, 4096, None, training=False) == (4096, [(0, 4096)])
    assert _plan(flce, 1024, 4096, 900, training=False) == (1024, [(0, 1024)])  # too few rows to split


def test_chunk_rows_without_spread_is_the_largest_chunk(flce, tune):
    tune(**DEFAULTS)
    # Llama-3's head, 8192 rows in chunks of at most 1536: spread evenly, six chunks of 1408
    # (whole blocks of 128); without spreading, the cap itself.
    assert _triton_rows(flce, 8192, 128256, torch.bfloat16, True, hidden_size=4096) == 1408
    assert _triton_rows(flce, 8192, 128256, torch.bfloat16, True, spread=False, hidden_size=4096) == 1536
    assert _triton_rows(flce, 1000, 128256, torch.bfloat16, True, spread=False, hidden_size=4096) == 1000


def test_a_training_chunk_stays_within_a_quarter_of_the_logits_of_8192_rows(flce, tune):
    """Its logits (V x 2 bytes a row) and the hidden-sized blocks beside them (H x 4 bytes a row:
    the gathered rows and their scaled copy, or the fp32 grad_hidden block) within 2048 rows of
    logits: Llama-2's head (4096, 32000) takes 1536 rows (1536 x 80384 bytes <= 2048 x 64000 <
    1664 x 80384), a large vocabulary the 1536 cap. Under a two-way vocabulary split the gathered
    rows stay beside the fp32 block (H x 6 bytes a row): a rank's slice of Llama-2's head
    (16000 columns, 32000 bytes a row) takes 2 x 2048 x 32000 // (32000 + 24576) = 2316, so 2304
    rows (the same 2048 rows' worth of the slice's logits)."""
    tune(**DEFAULTS)
    assert _triton_rows(flce, 8192, 32000, torch.bfloat16, True, spread=False, hidden_size=4096) == 1536
    assert _triton_rows(flce, 8192, 16000, torch.bfloat16, True, 2, spread=False, hidden_size=4096) == 2304
    assert _triton_rows(flce, 8192, 152064, torch.bfloat16, True, spread=False, hidden_size=3584) == 1536
    # Gemma-2's (2304, 256000): the 768 MiB buffer allows 1572 rows, so 1536
    assert _triton_rows(flce, 8192, 256000, torch.bfloat16, True, spread=False, hidden_size=2304) == 1536


def test_the_working_set_knob_trades_memory_for_fewer_chunks(flce, tune):
    """``working_set_rows`` replaces the 2048 rows of logits that bound a training chunk's working
    set: Llama-2's head (64000 + 16384 bytes a row) at 2600 takes 2600 x 64000 // 80384 = 2070, so
    2048 rows (four chunks of 7405 rows, where 1536 take five) when ``chunk_rows`` allows them;
    at 1024, 1024 x 64000 // 80384 = 815, so 768 rows."""
    tune(buffer_mib=None, chunk_rows=2048, working_set_rows=2600)
    assert _triton_rows(flce, 8192, 32000, torch.bfloat16, True, spread=False, hidden_size=4096) == 2048
    tune(working_set_rows=1024)
    assert _triton_rows(flce, 8192, 32000, torch.bfloat16, True, spread=False, hidden_size=4096) == 768


def test_a_forward_in_192_row_tiles_plans_whole_tiles(flce, tune):
    """Where the forward's statistics come in 192-row tiles (the Gluon kernel), its chunks hold
    at most 4032 rows (21 tiles) and every chunk but the last is whole tiles: Llama-2's LM
    inputs (7405 rows with a loss of 8192) take 4032 rows, then 3373; without ignored rows the
    8192 are spread over three chunks of 2880 (15 tiles) and the rest."""
    tune(**DEFAULTS)
    assert _triton_rows(flce, 8192, 32000, torch.bfloat16, False, spread=False, row_block=192) == 4032
    assert _triton_rows(flce, 8192, 32000, torch.bfloat16, False, row_block=192) == 2880
    assert _plan(flce, 8192, 4032, 7405, training=False, row_block=192) == (4032, [(0, 4032), (4032, 7405)])
    # rows that fit one chunk: half first, in whole tiles
    assert _plan(flce, 4000, 4032, 3600, training=False, row_block=192)[0] == 2112
    # rows that pass one chunk but fit two (Llama-3 at N = 4096: 3686 with a loss): half first
    # too, not a whole chunk of 4032 with 346 ignored rows in it
    assert _plan(flce, 4096, 4032, 3686, training=False, row_block=192) == (2112, [(0, 2112), (2112, 3686)])
    assert _plan(flce, 6000, 4032, 5400, training=False, row_block=192) == (3072, [(0, 3072), (3072, 5400)])


def test_a_training_step_in_192_row_tiles_spreads_its_chunks_in_whole_tiles(flce, tune):
    """A step's largest chunk is the memory's (1536 rows here, whatever the tile); after the
    first, the rows are spread in whole tiles of the sweep. Llama-2's head, every one of 8192
    targets counted: in 128-row blocks four chunks of 1408 and one of 1024 after the first, tiles
    of 192 rows 8 + 4 x 8 + 6 = 46 a vocabulary tile; in 192-row tiles four of 1344 (7 tiles) and
    one of 1280, 8 + 5 x 7 = 43, the fewest 8192 rows take. Without an order (every row in place) the spread
    chunk is 1536 in 192s (six chunks: 43 tiles) and 1408 in 128s."""
    tune(**DEFAULTS)
    for row_block in (128, 192):
        assert _triton_rows(flce, 8192, 32000, torch.bfloat16, True, spread=False, hidden_size=4096,
                                  row_block=row_block) == 1536
    assert _triton_rows(flce, 8192, 32000, torch.bfloat16, True, hidden_size=4096, row_block=128) == 1408
    assert _triton_rows(flce, 8192, 32000, torch.bfloat16, True, hidden_size=4096, row_block=192) == 1536
    first, spans = _plan(flce, 8192, 1536, 8192, training=True, row_block=128)
    assert [end - start for start, end in spans] == [1536, 1408, 1408, 1408, 1408, 1024]
    assert sum(math.ceil((end - start) / 192) for start, end in spans) == 46
    first, spans = _plan(flce, 8192, 1536, 8192, training=True, row_block=192)
    assert [end - start for start, end in spans] == [1536, 1344, 1344, 1344, 1344, 1280]
    assert sum(math.ceil((end - start) / 192) for start, end in spans) == math.ceil(8192 / 192) == 43


def test_the_torch_backend_and_a_cpu_forward_plan_in_128_row_blocks(flce):
    """Only the Gluon kernel's forward (CUDA, sm_90) tiles 192 rows; a CPU tensor's forward, and
    the PyTorch backend's, plan in 128-row blocks."""
    options = submodule(flce, "_options").LossOptions()
    plan = submodule(flce, "_plan")
    for name in ("_triton_backend", "_torch_backend"):
        hardware = submodule(flce, name).hardware(torch.device("cpu"))
        assert plan.row_block(torch.bfloat16, options, False, False, False, hardware) == 128


def test_a_forward_plans_in_192_row_tiles_only_where_the_gluon_kernel_takes_its_sweep(flce):
    """The gate of the Gluon statistics (``_plan.gluon_sweep``), on a Hopper device's facts: a
    16-bit forward of plain logits, and a bf16 training step's factored sweep,
    plan in its 192-row tiles; metrics, a bias, a logit scale, a softcap, smoothing or fp32 inputs
    keep the logit kernel's 128 rows. z-loss
    does not change the forward's statistics, so it keeps the Gluon tiles there; a step with it
    is not factored."""
    plan = submodule(flce, "_plan")
    options = submodule(flce, "_options").LossOptions
    hopper = plan.Hardware("triton", programs=132, gluon_tile=(192, 256), capability=(9, 0))  # the kernel runs

    def block(dtype=torch.bfloat16, training=False, return_metrics=False, has_bias=False, **opts):
        return plan.row_block(dtype, options(**opts), has_bias, training, return_metrics, hopper)

    assert block() == 192 and block(torch.float16) == 192 and block(z_loss_scale=1e-4) == 192
    assert block(return_metrics=True) == block(has_bias=True) == 128
    assert block(logit_scale=0.5) == block(softcap=30.0) == block(label_smoothing=0.1) == 128
    assert block(torch.float32) == 128
    # a training step's factored sweep (bf16, no z-loss: fp16 and z-loss are not factored)
    assert block(training=True) == 192
    assert block(training=True, z_loss_scale=1e-4) == block(torch.float16, training=True) == 128
    assert block(training=True, return_metrics=True) == 128
    override = submodule(flce, "_settings").override
    with override(training_row_block=128):
        assert block(training=True) == 128 and block() == 192
    with override(gluon_training=False):
        assert block(training=True) == 128 and block() == 192


def test_rare_target_rows_flag_the_targets_of_few_rows(flce, monkeypatch):
    """A row's target entry leaves the bf16 products where its column is the target of at most
    ``rare_target`` (2) of the step's rows (OUT_ALWAYS), or may leave them (where its p_t is
    small: OUT_IF_IMPROBABLE) where it is of at most IMPROBABLE_MAX_COUNT; counted over the rows
    with a target in this weight's columns (ignored ones, also with an ignore_index inside the
    vocabulary, and other ranks' columns count for nothing, and are flagged 0); ``rare_target`` -1
    turns the rule off."""
    chunked, kernels = submodule(flce, "_chunked"), submodule(flce, "_kernel_math")
    backend = submodule(flce, "_triton_backend")
    always, if_improbable = kernels.OUT_ALWAYS.value, kernels.OUT_IF_IMPROBABLE.value
    targets = torch.tensor([3, 3, 3, 1, 1, 4, -100, 9, 0, 2, 2, 2, 2, 5, 5, 5])  # V = 8: 9 is another rank's

    def expected(rare, most, ignore_index=-100):
        counted = [t for t in targets.tolist() if 0 <= t < 8 and t != ignore_index]
        return [0 if t not in counted else always if counted.count(t) <= rare
                else if_improbable if counted.count(t) <= most else 0 for t in targets.tolist()]

    def flags(ignore_index=-100):
        rare = submodule(flce, "_plan").rare_target()  # (the plan's: None where the rule is off)
        return None if rare is None else backend.take_out_flags(targets.to(DEVICE), 8, ignore_index, rare,
                                                                chunked.IMPROBABLE_MAX_COUNT).tolist()

    assert flags() == expected(2, 64)
    assert flags(ignore_index=5) == expected(2, 64, ignore_index=5)
    assert flags(ignore_index=5)[-3:] == [0, 0, 0] and flags()[-3:] == [if_improbable] * 3
    override = submodule(flce, "_settings").override
    with override(rare_target=3):
        assert flags() == expected(3, 64)
    with override(rare_target=0):
        assert flags() == expected(0, 64)
        monkeypatch.setattr(chunked, "IMPROBABLE_MAX_COUNT", 3)  # target 2's four rows keep their entries in
        assert flags() == expected(0, 3)
    with override(rare_target=-1):  # no rule: no flags at all
        assert flags() is None




def _step_chunk(flce, n_rows, vocab_size, hidden_size, dtype=torch.bfloat16, weight_grad=True, row_block=192):
    return submodule(flce, "_plan").plan_chunk("triton", n_rows, vocab_size, hidden_size, dtype, True, spread=False,
                                               row_block=row_block, weight_grad=weight_grad)


def test_a_step_of_more_than_8_chunks_takes_8_larger_ones_in_the_fp32_sums_memory(flce, tune):
    """Llama-3's head (4096, 128256), bf16: a chunk of 1536 rows keeps 1536 x (256512 + 16384) =
    419 MB, and past 8 chunks grad_weight's fp32 sum adds V x H x 4 = 2101 MB. 32768 rows in 8
    chunks take ceil(4096 / 192) = 22 tiles, 4224 rows: 1153 MB (buffer 1083 MB < 2101): grown.
    16384 rows: 2112 (11 tiles). 12288 rows fit 8 chunks of 1536: no sum, no growth. 65536 rows:
    8256 rows a chunk would hold a buffer of 2118 MB, more than the sum: 1536. Gemma-2's head
    (2304, 256000) at 49152 rows: 6144 rows' buffer is 3146 MB against a sum of 2359: 1536; at
    32768, 4224 rows (2163 MB of buffer)."""
    tune(**DEFAULTS)
    assert _step_chunk(flce, 32768, 128256, 4096) == 4224
    assert _step_chunk(flce, 32768, 128256, 4096, row_block=128) == 4096
    assert _step_chunk(flce, 16384, 128256, 4096) == 2112
    assert _step_chunk(flce, 12288, 128256, 4096) == 1536
    assert _step_chunk(flce, 65536, 128256, 4096) == 1536
    assert _step_chunk(flce, 49152, 256000, 2304) == 1536
    assert _step_chunk(flce, 32768, 256000, 2304) == 4224
    # Llama-2's head at 32768 rows: 4224 x 80384 = 340 MB, within 1536 x 80384 + 524 MB
    assert _step_chunk(flce, 32768, 32000, 4096) == 4224
    # the grown chunk's memory is at most the planned chunk's and the fp32 sum's
    plan = submodule(flce, "_plan")
    for n_rows, vocab_size, hidden_size in ((32768, 128256, 4096), (16384, 128256, 4096), (32768, 256000, 2304)):
        grown = _step_chunk(flce, n_rows, vocab_size, hidden_size)
        planned = plan.chunk_bytes(1536, vocab_size, torch.bfloat16, hidden_size) + vocab_size * hidden_size * 4
        assert plan.chunk_bytes(grown, vocab_size, torch.bfloat16, hidden_size) <= planned
        assert math.ceil(n_rows / grown) == 8


def test_chunks_grow_only_where_the_step_would_keep_an_fp32_sum(flce, tune):
    """No growth without grad_weight, for fp32 inputs (their grad_weight is its own sum), without
    ``grow_chunks``, with ``chunk_rows`` set (a cap), with groups larger than the chunks
    (``weight_group`` 1000: no fp32 sum), or for a small head summed in fp32 from the start (its
    V x H x 4 bytes within 64 MiB); on the PyTorch backend, whose chunks never grow."""
    tune(**DEFAULTS)

    def planned(vocab_size, hidden_size, dtype=torch.bfloat16):
        return _triton_rows(flce, 32768, vocab_size, dtype, True, spread=False, hidden_size=hidden_size,
                                  row_block=192)

    assert _step_chunk(flce, 32768, 128256, 4096, weight_grad=False) == 1536
    assert _step_chunk(flce, 32768, 128256, 4096, dtype=torch.float32) == planned(128256, 4096, torch.float32)
    # V x H x 4 = 131 MB, past 64 MiB: 896-row chunks (2048 x 16000 // 32384 = 1011) grow to 4224
    # (136.8 MB, within 896 x 32384 + 131 MB); 64 MB (8000 x 2000 x 4) is summed in fp32 from the start
    assert planned(8000, 4096) == 896 and _step_chunk(flce, 32768, 8000, 4096) == 4224
    assert _step_chunk(flce, 32768, 8000, 2000) == planned(8000, 2000)
    # no buffer of 2^31 elements or more: a (16384, 256000) head's 131072 rows in 8 chunks of
    # 16512 would hold 4.23e9 a chunk (8.5 GB, under the 16.8 GB fp32 sum)
    assert _step_chunk(flce, 131072, 256000, 16384) == _triton_rows(
        flce, 131072, 256000, torch.bfloat16, True, spread=False, hidden_size=16384, row_block=192)
    override = submodule(flce, "_settings").override
    assert _step_chunk(flce, 32768, 128256, 4096) == 4224  # grown, but for the settings below
    for changes in (dict(grow_chunks=False), dict(chunk_rows=1536), dict(weight_group=1000)):
        with override(**changes):
            assert _step_chunk(flce, 32768, 128256, 4096) == 1536, changes
    plan = submodule(flce, "_plan")
    planned = plan.chunk_rows("torch", 32768, 128256, torch.bfloat16, True, spread=False, hidden_size=4096)
    assert plan.plan_chunk("torch", 32768, 128256, 4096, torch.bfloat16, True, spread=False,
                           weight_grad=True) == planned
