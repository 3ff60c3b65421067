"""Which kernels a call runs: one frozen ``Plan``, decided once per call from its request.

``plan(request, shape, hardware)`` takes what defines the call (the ``Request``: options and
flags), its tensors' shapes and dtypes (``Shape``), the device's facts (``Hardware``, asked of
the backend module, so that this module imports no Triton) and the settings in force, and
decides the backend, the pipeline, the sweep kernel, the target-logit source, the row order,
the chunking, the grad-weight accumulation and whether the gradients are made in the forward.
``Plan.explain()`` says it in words. The chunk loops (``_chunked``, ``_kept``) execute a plan;
the launchers ask the rules below (``tile_width``, ``logit_tile_choice``, ``gluon_sweep``, ...)
for what varies per launch. This is the only module that reads the tuning settings.

What the last backward found (``Speculation``) is an explicit input: of ``grads_in_forward`` (a
per-token forward's or a divergence's gradients made in the sweep), and of ``plan`` (whether a
kept backward counts its rows, ``kept_rows_whole``). A top-k loss makes its gradients in the
forward where its upstream is a scalar (``sparse_grads_in_forward``)."""

import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import _torch_backend
from ._options import LossOptions, Request
from ._settings import Settings
from ._settings import current as settings
from ._speculation import Speculation


def tuning() -> Settings:
    """The settings in force (``_settings``), for the rules below."""
    return settings()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the device's facts ------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """What a backend says of a device (``backend.hardware(device)``): facts, no choices."""

    backend: str  # "triton" or "torch"
    interpreting: bool = False  # Triton's CPU interpreter (TRITON_INTERPRET=1)
    programs: int = 0  # programs a round of a persistent sweep (one per multiprocessor)
    gluon_tile: tuple[int, int] | None = None  # (rows, columns) of the Gluon statistics kernel where it runs here
    capability: tuple[int, int] | None = None  # the CUDA compute capability


TORCH = Hardware("torch")


# The Triton backend (it imports triton), imported on first use: CPU tensors outside the
# interpreter take the PyTorch backend, and triton may be absent (macOS, Windows, CPU-only Linux).
_triton_backend = None


def _import_triton_backend(why: str):
    """The Triton backend, imported once; without triton, an ImportError that starts with ``why``."""
    global _triton_backend
    try:
        from . import _triton_backend as module
    except ModuleNotFoundError as error:
        if error.name != "triton":
            raise
        raise ImportError(f"{why}, and triton is not installed: pip install triton") from error
    _triton_backend = module
    return module


def backend_for(device: torch.device):
    """Triton on CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``, when the kernels were
    decorated for the interpreter, i.e. the variable was set when the Triton backend was first
    imported), else PyTorch; PyTorch for every tensor under FLCE_TRITON=0 (``triton``). Raises
    ImportError where Triton is wanted and triton is not installed."""
    if not tuning().triton:
        return _torch_backend
    if device.type == "cuda":
        return _triton_backend or _import_triton_backend("fused_linear_ce runs Triton kernels on CUDA tensors")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        backend = _triton_backend or _import_triton_backend(
            "TRITON_INTERPRET=1 runs the Triton kernels in Triton's CPU interpreter (unset it for the "
            "PyTorch path on CPU tensors)")
        if backend.KERNELS_INTERPRETED:
            return backend
    return _torch_backend


@dataclass(frozen=True)
class Shape:
    """The tensors of a call, as the plan sees them: sizes, dtype, device kind, which are present."""

    n_rows: int
    vocab_size: int  # this weight's rows (a slice under vocabulary parallelism)
    hidden_size: int
    dtype: torch.dtype
    has_bias: bool = False
    has_class_weight: bool = False
    sharded: bool = False  # vocabulary parallelism: this weight is one rank's slice
    shards: int = 1  # ranks of the vocabulary split
    planning_vocab_size: int | None = None  # the slice every rank plans with (``Shard``); None: vocab_size
    capturing: bool = False  # a CUDA graph is being captured (the host cannot read a count)

    @property
    def element_size(self) -> int:
        return torch.finfo(self.dtype).bits // 8


# ---- the rules a launch asks -------------------------------------------------------------------
TUNED = {(9, 0): (128, 64, 8, 3, True)}  # (BLOCK_N, BLOCK_K, warps, stages, persistent), sm_90 16-bit 256 columns
L2_HIDDEN_BYTES = 32 * 2**20  # the hidden rows a sweep keeps in L2: 4096 rows of H = 4096 in 16 bits (50 MB L2)


class TileChoice(NamedTuple):
    """How the logit kernel is launched: ``fixed`` meta-parameters (then no autotuner), or the
    autotuner over its candidates (``first_only``: the first candidate alone)."""

    fixed: dict | None
    first_only: bool = False


def tile_width(dtype: torch.dtype, interpreting: bool) -> int:
    """Vocabulary columns per logit tile (BLOCK_V): ``block_v``, else 32 in the interpreter, 64
    for fp64, 128 for fp32, 256 for 16-bit inputs."""
    block_v = tuning().block_v
    if block_v is not None:
        return block_v
    return 32 if interpreting else {torch.float64: 64, torch.float32: 128}.get(dtype, 256)


def logit_tile_candidates(block_v: int, element_size: int) -> list[tuple]:
    """The logit kernel's candidate configurations for one tile width (BLOCK_V), as (BLOCK_N,
    BLOCK_K, warps, stages, persistent): BLOCK_V is fixed per call because the tile statistics are
    allocated per tile; the rest is autotuned. Shared memory per stage is (BLOCK_N + BLOCK_V) x
    BLOCK_K x element size, kept under Hopper's 227 KiB."""
    if element_size == 8:  # float64 (verification, not speed): fp64 accumulators are register-hungry
        return [(64, 32, 4, 2, False)]
    if element_size == 4:
        return [(128, 32, 8, 3, False), (64, 32, 4, 3, False)]
    if block_v >= 256:
        # 4 persistent stages fit only without the buffer's TMA store (the forward's sweep).
        return [(128, 64, 8, 3, False), (128, 64, 8, 3, True), (128, 64, 8, 4, False), (128, 64, 8, 4, True),
                (64, 64, 4, 4, False)]
    return [(128, 64, 4, 4, False), (128, 64, 8, 4, False), (128, 64, 8, 4, True), (256, 64, 8, 3, False)]


def logit_tile_choice(block_v: int, element_size: int, interpreting: bool, capability) -> TileChoice:
    """The logit kernel's configuration: one small tile when interpreting, the forced
    (``config``) or the shipped one (``TUNED``, for 16-bit 256-column tiles, with ``autotune``
    and ``tuned``), else the autotuner. ``capability`` (a callable giving it) is asked only then."""
    chosen = tuning()
    if interpreting:
        return TileChoice({"BLOCK_N": chosen.block_n, "BLOCK_K": chosen.block_k, "PERSISTENT": chosen.persistent})
    config = chosen.config
    if config is None and chosen.autotune and chosen.tuned and element_size == 2 and block_v == 256:
        config = TUNED.get(capability())
    if config is not None:
        block_n, block_k, warps, stages, persistent = config
        return TileChoice({"BLOCK_N": block_n, "BLOCK_K": block_k, "PERSISTENT": persistent,
                           "num_warps": warps, "num_stages": stages})
    return TileChoice(None, first_only=not chosen.autotune)


def uses_tma(element_size: int) -> bool:
    """Whether the logit kernel may load through the copy engine (``tma``; never for fp64)."""
    return tuning().tma and element_size != 8


def group_rows(hidden_size: int, element_size: int) -> int:
    """Rows of a tile group of the logit kernel (``group_rows``): 4096, or fewer where their hidden
    rows pass L2_HIDDEN_BYTES, in whole 128-row blocks (docs/design.md, "Two logit kernels")."""
    forced = tuning().group_rows
    if forced is not None:
        return forced
    row_bytes = hidden_size * element_size
    return max(128, min(4096, L2_HIDDEN_BYTES // max(row_bytes, 1) // 128 * 128))


def target_logit_by_product(dtype: torch.dtype, hardware: Hardware) -> bool:
    """Whether a statistics sweep without the factored buffer leaves each row's target logit to
    a tensor-core product (``_picked_logit_dot_kernel``) instead of picking it in its tiles: on
    the Triton backend, but for fp64 inputs (the product sums in fp32)."""
    return hardware.backend == "triton" and dtype != torch.float64


def factored_gradient(dtype: torch.dtype, opts: LossOptions, has_bias: bool, hardware: Hardware) -> bool:
    """Whether a training chunk keeps exponentials and factors its gradient: on the Triton
    backend with ``factored``, bf16 or fp32 (fp16's range cannot hold them), no bias, softcap,
    label smoothing or z-loss (whose gradients are not one factor per row times exponentials)."""
    if hardware.backend != "triton" or not tuning().factored:
        return False
    return (dtype in (torch.bfloat16, torch.float32) and not has_bias and not opts.has_softcap
            and not opts.has_smoothing and not opts.has_z_loss)


def gluon_sweep(dtype: torch.dtype, opts: LossOptions, has_bias: bool, return_metrics: bool,
                hardware: Hardware, factored: bool = False) -> bool:
    """Whether the Gluon kernel (``_gluon_stats``) computes a statistics sweep: with ``gluon``
    (and for the factored training sweep ``gluon_training``), where it runs (Hopper), 16-bit
    inputs, the logits z = h W^T alone (no bias, logit scale, softcap or smoothing's logit sum),
    no metrics and the logit kernel's tile width equal to its own."""
    chosen = tuning()
    if not chosen.gluon or (factored and not chosen.gluon_training) or hardware.gluon_tile is None:
        return False
    if dtype not in (torch.bfloat16, torch.float16) or return_metrics or has_bias:
        return False
    if float(opts.logit_scale) != 1.0 or opts.has_softcap or opts.has_smoothing:
        return False
    return tile_width(dtype, hardware.interpreting) == hardware.gluon_tile[1]


def row_block(dtype: torch.dtype, opts: LossOptions, has_bias: bool, training: bool, return_metrics: bool,
              hardware: Hardware) -> int:
    """Rows a tile of the statistics sweeps, in which the chunks are planned: the Gluon kernel's
    (192) where it sweeps (a forward's, or a training step's factored sweep), else 128 (the logit
    kernel's, and the PyTorch backend's); ``training_row_block`` sets a step's."""
    if hardware.backend != "triton":
        return 128
    if training:
        factored = factored_gradient(dtype, opts, has_bias, hardware)
        gluon = factored and gluon_sweep(dtype, opts, has_bias, return_metrics, hardware, factored=True)
        forced = tuning().training_row_block
        return forced if forced is not None else hardware.gluon_tile[0] if gluon else 128
    return hardware.gluon_tile[0] if gluon_sweep(dtype, opts, has_bias, return_metrics, hardware) else 128


def sweep_tiles(vocab_size: int, dtype: torch.dtype, hardware: Hardware) -> tuple[int, int] | None:
    """(vocabulary tiles a row block, programs a round) of a persistent sweep over this weight,
    for the chunk plan (``fullest_chunk``); None on the PyTorch backend (no rounds of tiles)."""
    if hardware.backend != "triton":
        return None
    return _cdiv(vocab_size, tile_width(dtype, hardware.interpreting)), hardware.programs


def precompiles() -> bool:
    """Whether the first call of a kind compiles its kernels in forked processes (``precompile``)."""
    return tuning().precompile


def rare_target() -> int | None:
    """Rows a factored step's target may be shared by for its entries to leave the products
    (``rare_target``); None: every entry stays in."""
    return None if tuning().rare_target < 0 else tuning().rare_target


def keep_budget() -> tuple[int | None, int | None]:
    """(``keep_mib``, ``keep_rows``) of a per-token forward's kept rows (``_kept``)."""
    return tuning().keep_mib, tuning().keep_rows


# ---- the chunking --------------------------------------------------------------------------------
def chunk_bytes(rows: int, vocab_size: int, dtype: torch.dtype, hidden_size: int, shards: int = 1) -> int:
    """Bytes of a Triton training chunk of ``rows`` at any time (``chunk_rows``' memory model): its
    logits' buffer [rows, V] in the inputs' dtype, and beside it H x max(4, 2 x element size)
    bytes a row (16-bit: the gathered rows and their scaled copy, then that copy alone, then the
    fp32 grad_hidden block; under vocabulary parallelism the gathered rows stay until
    grad_weight's product, beside that block: H x (element size + 4))."""
    element_size = torch.finfo(dtype).bits // 8
    beside = hidden_size * (max(4, 2 * element_size) if shards == 1 else element_size + 4)
    return rows * (vocab_size * element_size + beside)


def chunk_rows(backend: str, n_rows: int, vocab_size: int, dtype: torch.dtype, training: bool, shards: int = 1,
               spread: bool = True, hidden_size: int = 0, row_block: int = 128) -> int:
    """Rows per chunk on ``backend`` ("triton" or "torch"); a vocabulary slice of one of
    ``shards`` ranks takes ``shards`` times the rows.

    Triton: training keeps a chunk's logits (rows x V) in a buffer of at most ``buffer_mib`` (768
    MiB) and ``chunk_rows`` (1536) rows, its working set (``chunk_bytes``) within
    ``working_set_rows`` (2048) rows of logits (a step of many chunks may grow them:
    ``grown_chunk``); the forward alone takes up to 4096 rows (whole ``row_block``s). With
    ``spread`` the ``n_rows`` are spread evenly over the chunks (in whole ``row_block``s), so that
    no small last chunk runs at a loss; without it (the rows to compute not known yet) the largest.

    PyTorch: the chunk's fp32 logits, one fp32 temporary of their size and, for 16-bit inputs,
    the grad logits cast to that dtype stay under ``buffer_mib`` (256) together; the largest
    such chunk, with or without ``spread``."""
    chosen = tuning()
    if backend != "triton":
        budget = (256 if chosen.buffer_mib is None else chosen.buffer_mib) * 2**20
        acc_size = 8 if dtype == torch.float64 else 4
        bytes_per_row = vocab_size * (2 * acc_size + (dtype.itemsize if dtype.itemsize < 4 else 0))
        return max(1, min(n_rows, (chosen.chunk_rows or 4096) * shards, budget // bytes_per_row))
    if training:
        budget = (768 if chosen.buffer_mib is None else chosen.buffer_mib) * 2**20
        logit_row = vocab_size * (torch.finfo(dtype).bits // 8)
        by_budget = max(128, budget // logit_row // 128 * 128)
        by_share = max(128, chosen.working_set_rows * shards * logit_row
                       // chunk_bytes(1, vocab_size, dtype, hidden_size, shards) // 128 * 128)
        most = min((chosen.chunk_rows or 1536) * shards, by_budget, by_share)
    else:
        most = (chosen.chunk_rows or 4096) * shards
        most = max(row_block, most // row_block * row_block)
    if n_rows <= most:
        return max(1, n_rows)
    if not spread:
        return most
    per_chunk = _cdiv(n_rows, _cdiv(n_rows, most))
    return min(most, _cdiv(per_chunk, row_block) * row_block)


def weight_group(dtype: torch.dtype) -> int | None:
    """Chunks summed into a 16-bit grad_weight before that sum goes to an fp32 sum
    (``weight_group``, 8: ``_gradients.Gradients``); None for 32- and 64-bit inputs, whose
    grad_weight is its own sum."""
    return max(1, tuning().weight_group) if dtype.itemsize < 4 else None


def fp32_from_start(vocab_size: int, hidden_size: int, element_size: int, chunk: int) -> bool:
    """Whether a 16-bit grad_weight of many chunks is summed in fp32 from the start: where
    that costs no more than the chunk buffer itself or ``weight_fp32_mib`` (64 MiB)."""
    allowance = max(chunk * vocab_size * element_size, tuning().weight_fp32_mib * 2**20)
    return element_size < 4 and vocab_size * hidden_size * 4 <= allowance


def plan_chunk(backend: str, n_rows: int, vocab_size: int, hidden_size: int, dtype: torch.dtype, training: bool,
               shards: int = 1, spread: bool = True, row_block: int = 128, weight_grad: bool = False) -> int:
    """Rows per chunk (``vocab_size``: the planning slice under vocabulary parallelism, so that
    every rank plans the same). Without ``spread`` the largest chunk: when ignored rows are
    skipped, ``n_rows`` overstates the rows to compute. A training step that sums
    ``weight_grad`` may take fewer, larger chunks (``grown_chunk``)."""
    chunk = chunk_rows(backend, max(n_rows, 1), vocab_size, dtype, training, shards, spread=spread,
                       hidden_size=hidden_size, row_block=row_block)
    if training and weight_grad and backend == "triton":
        chunk = grown_chunk(n_rows, chunk, vocab_size, hidden_size, dtype, shards, row_block)
    return chunk


def grown_chunk(n_rows: int, chunk: int, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                shards: int, row_block: int) -> int:
    """The rows of a training step's chunks, grown to ``weight_group`` chunks where its planned
    ``chunk`` would take more: those steps keep an fp32 sum of grad_weight (V x H x 4 bytes),
    and chunks of n_rows / 8 rows fit in the memory that sum and the planned chunk take
    (``chunk_bytes``) while their buffer is smaller than the sum. Their 16-bit running sum is then
    that of at most 8 chunks, as the groups' is, with no fp32 sum, and each chunk less re-reads W
    twice and grad_weight once (docs/design.md). Elsewhere, with ``chunk_rows`` set (a cap) or
    without ``grow_chunks``, ``chunk``."""
    group = weight_group(dtype)
    if group is None or not tuning().grow_chunks or tuning().chunk_rows is not None:
        return chunk
    most = chunk_rows("triton", max(n_rows, 1), vocab_size, dtype, True, shards, spread=False,
                      hidden_size=hidden_size, row_block=row_block)
    fp32_sum = vocab_size * hidden_size * 4
    if _cdiv(n_rows, most) <= group or fp32_from_start(vocab_size, hidden_size, dtype.itemsize, most):
        return chunk  # no fp32 sum past the group to take the place of
    grown = _cdiv(_cdiv(n_rows, group), row_block) * row_block
    grown_bytes = chunk_bytes(grown, vocab_size, dtype, hidden_size, shards)
    # (a buffer of fewer than 2^31 elements, as the planned ones: at most 768 MiB of them)
    if grown * vocab_size * dtype.itemsize >= fp32_sum or grown * vocab_size >= 2**31:
        return chunk
    if grown_bytes > chunk_bytes(most, vocab_size, dtype, hidden_size, shards) + fp32_sum:
        return chunk
    return grown


DIVERGENCE_BUFFER_MIB = 512  # the divergence's two fp32 chunk buffers together, unless ``buffer_mib`` says otherwise


def divergence_chunk_rows(n_rows: int, vocab_size: int, hidden_size: int, acc: torch.dtype, dtype: torch.dtype,
                          training: bool) -> int:
    """Rows per chunk of the divergence (``distillation``): the two logit buffers within
    DIVERGENCE_BUFFER_MIB (``buffer_mib``), at most ``chunk_rows``; a 16-bit training step of
    more than ``weight_group`` chunks takes that many larger ones where their buffers are smaller
    than the fp32 sum of grad_weight they then spare. The rows are spread evenly over the chunks."""
    chosen = tuning()
    row_bytes = 2 * vocab_size * acc.itemsize
    most = max(1, ((chosen.buffer_mib or DIVERGENCE_BUFFER_MIB) * 2**20) // row_bytes)
    most = most // 128 * 128 if most >= 128 else most
    group = weight_group(dtype)
    if training and group is not None and _cdiv(n_rows, most) > group:
        grown = _cdiv(_cdiv(n_rows, group), 128) * 128
        if grown * row_bytes <= vocab_size * hidden_size * 4 and grown * vocab_size < 2**31:
            most = grown
    if chosen.chunk_rows is not None:
        most = min(most, chosen.chunk_rows)
    return _cdiv(n_rows, _cdiv(n_rows, most)) if n_rows else 1


def first_chunk_rows(n_rows: int, chunk: int, row_order, training: bool, row_block: int = 128,
                     sweep_tiles: tuple[int, int] | None = None) -> int:
    """Rows of the first chunk, computed before the count of rows with a loss is known. When
    rows are skipped (``row_order`` not None), a forward without gradients computes at most half
    of them first (in whole ``row_block``s), so that the ignored rows, last in the order, are
    left out unless they are more than half. With ``sweep_tiles`` a first chunk that more rows
    follow is sized to fill its sweep's rounds (``fullest_first``)."""
    first = min(chunk, n_rows)
    if row_order and not training and n_rows >= 2048:
        first = min(first, _cdiv(_cdiv(n_rows, 2), row_block) * row_block)
    if sweep_tiles is not None and first < n_rows:
        first = fullest_first(n_rows, first, chunk, row_block, *sweep_tiles)
    return first


def fullest_first(n_rows: int, first: int, chunk: int, row_block: int, tiles_per_block: int, programs: int) -> int:
    """The first chunk's rows: of 85% to 100% of ``first``, in whole blocks, the one whose sweep
    leaves the smallest share of its last round idle, among those that leave the ``n_rows`` (if
    all had a loss) as many more chunks of at most ``chunk`` as ``first`` does (docs/design.md)."""
    most = first // row_block
    if most == 0 or first % row_block:  # not whole blocks (exploration's chunk sizes): as it is
        return first

    def idle_share(blocks):
        rounds = _cdiv(blocks * tiles_per_block, programs)
        return (rounds * programs - blocks * tiles_per_block) / (rounds * programs)

    chunks_after = _cdiv(n_rows - first, chunk)
    candidates = [b for b in range(most, max(1, math.ceil(0.85 * most)) - 1, -1)  # largest first: ties keep it
                  if _cdiv(n_rows - b * row_block, chunk) == chunks_after]
    return min(candidates, key=idle_share) * row_block


def spans(n_rows: int, chunk: int, row_order, first: int, row_block: int = 128,
          sweep_tiles: tuple[int, int] | None = None):
    """[start, end) of each chunk: a first chunk of ``first`` rows, then the rows that
    ``row_order`` computes (its ``rows_to_compute()``, asked once the first chunk's work is
    queued), spread evenly over chunks of at most ``chunk`` rows, in multiples of ``row_block``
    but the last; with ``sweep_tiles``, in as many chunks, sized to fill the sweep's rounds
    (``fullest_chunk``)."""
    if first == 0:
        return
    yield 0, first
    total = n_rows if row_order is None else max(first, row_order.rows_to_compute())
    rest = total - first
    if rest > 0:
        per_chunk = _cdiv(rest, _cdiv(rest, chunk))
        per_chunk = min(chunk, _cdiv(per_chunk, row_block) * row_block)
        n_chunks = _cdiv(rest, per_chunk)
        if sweep_tiles is not None:
            per_chunk = fullest_chunk(rest, chunk, row_block, per_chunk, n_chunks, *sweep_tiles)
        starts = [first + i * per_chunk for i in range(n_chunks)]
        yield from zip(starts, [*starts[1:], total], strict=True)


def fullest_chunk(rest: int, chunk: int, row_block: int, even: int, n_chunks: int, tiles_per_block: int,
                  programs: int) -> int:
    """Rows of each but the last of ``n_chunks`` chunks of ``rest`` rows (the last takes what is
    left, at most ``chunk``) such that their sweeps take the fewest rounds; the even spread
    ``even`` where no size takes fewer. A persistent sweep of B row blocks x T tiles on P programs
    takes ceil(B T / P) rounds (docs/design.md)."""
    if even % row_block or n_chunks == 1:  # chunks smaller than a block (exploration), or one
        return even

    def rounds(rows):
        return _cdiv(_cdiv(rows, row_block) * tiles_per_block, programs)

    def cost(per_chunk):
        return (n_chunks - 1) * rounds(per_chunk) + rounds(rest - (n_chunks - 1) * per_chunk)

    fitting = [b * row_block for b in range(1, chunk // row_block + 1)
               if 0 < rest - (n_chunks - 1) * b * row_block <= chunk]
    return min([even, *fitting], key=cost)  # the even spread first: it wins ties


# ---- the plan -------------------------------------------------------------------------------------
PIPELINES = ("factored", "stored", "statistics", "kept", "recompute", "sparse")
# A kept backward's row orders, in words (``kept_rows_whole``).
KEPT_BACKWARD_ORDERS = {
    "forward": "kept backward: every computed row, kept parts whole, the rest recomputed; no host read",
    "kept": "kept backward: the rows with a gradient, counted on the host (one read), the others left out",
}


def kept_rows_whole(speculation: Speculation | None, key: str, capturing: bool) -> bool:
    """Whether a kept backward takes every row its forward computed with no host read (row order
    "forward"), or counts the rows with a gradient first ("kept"; one read that drains the GPU's
    queue) and leaves the others out. Both are exact (a zero upstream gives zero grad logits); the
    first is faster where every row has a gradient, the second where many have none (``_kept``).
    As ``speculation`` says for ``key`` (a fresh key: whole); never while a graph is captured."""
    return speculation is not None and not capturing and speculation.speculates(key)


@dataclass(frozen=True)
class Plan:
    """Which kernels one call runs, and how its rows are chunked (``plan``)."""

    backend: str  # "triton" or "torch"
    pipeline: str  # one of PIPELINES
    sharded: bool  # vocabulary parallelism (the chunks' statistics merged across ranks)
    grads_in_forward: tuple[bool, bool, bool]  # (hidden, weight, bias) made in the forward's sweep
    sweep: str  # the statistics sweep's kernel: "gluon", "tiles" (the logit kernel) or "torch"
    target_logit: str  # "reference" (row references first), "product" (one launch first) or "sweep"
    references_first: bool  # every row's reference and target logit in one launch before the chunks
    # "targets" (rows with a loss first), "gradients" (rows with a gradient first), "in place"; a kept
    # backward's "kept" (its rows with a gradient, counted on the host) or "forward" (the forward's
    # computed rows, every kept part whole: ``kept_rows_whole``)
    row_order: str
    row_block: int  # rows in whose multiples the chunks are planned
    chunk_rows: int  # rows per chunk, at most
    grown: bool  # a training step's chunks grown to ``weight_group`` of them
    first_rows: int  # rows of the first chunk
    sweep_tiles: tuple[int, int] | None  # (tiles a row block, programs) the forward's chunks fill
    n_chunks: int  # chunks planned for the gradients' accumulation (0 without gradients)
    weight_sum: str  # grad_weight's accumulation: "none", "direct", "fp32" (from the start) or "grouped"
    weight_group: int | None  # chunks of a 16-bit group before the fp32 sum
    weight_fp32: bool  # a 16-bit grad_weight of several chunks summed in fp32 from the start
    take_out: int | None  # rare_target: a factored step's rare target entries leave the products (None: none)
    tile_width: int | None  # vocabulary columns a logit tile (None on the PyTorch backend)
    recompute_rows: int = 0  # the kept pipeline: rows per chunk of the rows it recomputes in the backward
    keep_mib: int | None = None  # the kept pipeline's budget (None: TRL's head's peak)
    keep_rows: int | None = None  # the kept pipeline's cap on rows
    notes: tuple[str, ...] = field(default=(), compare=False)

    def spans(self, n_rows: int, row_order):
        """The chunks' [start, end) of this plan (``spans``)."""
        return spans(n_rows, self.chunk_rows, row_order, self.first_rows, self.row_block, self.sweep_tiles)

    def explain(self) -> str:
        """The plan in words, one line each."""
        grads = [name for name, wanted in zip(("hidden", "weight", "bias"), self.grads_in_forward, strict=True)
                 if wanted]
        lines = [
            f"backend: {self.backend}",
            f"pipeline: {self.pipeline}{' (vocabulary sharded)' if self.sharded else ''}",
            f"gradients in the forward: {', '.join(grads) if grads else 'none'}",
            f"sweep kernel: {self.sweep}" + ("" if self.tile_width is None else f", {self.tile_width}-column tiles"),
            f"target logit: {self.target_logit}" + (" (all rows before the chunks)" if self.references_first else ""),
            f"row order: {self.row_order}",
            f"chunks: first {self.first_rows} rows, then at most {self.chunk_rows}"
            f"{' (grown)' if self.grown else ''}, in blocks of {self.row_block}"
            + ("" if self.sweep_tiles is None else f", filling rounds of {self.sweep_tiles[1]} programs"),
            f"grad_weight sum: {self.weight_sum}" + ("" if self.weight_sum != "grouped"
                                                     else f" (groups of {self.weight_group} chunks)"),
        ]
        if self.pipeline == "factored":
            lines.append("rare target entries: " + ("kept in the products" if self.take_out is None
                                                    else f"out of the products (at most {self.take_out} rows)"))
        if self.pipeline == "sparse":
            lines.append("sparse loss: each chunk's grad logits from its buffer and its top-k loss, then the products")
        if self.pipeline == "kept" and self.row_order in KEPT_BACKWARD_ORDERS:
            lines.append(KEPT_BACKWARD_ORDERS[self.row_order])
        elif self.pipeline == "kept":
            lines.append(f"kept rows: budget {'TRL peak' if self.keep_mib is None else f'{self.keep_mib} MiB'}"
                         f"{'' if self.keep_rows is None else f', at most {self.keep_rows} rows'}, the others "
                         f"recomputed in chunks of {self.recompute_rows}")
        return "\n".join([*lines, *self.notes])

    def as_dict(self) -> dict:
        """The plan's fields (for benchmark records)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "notes"}


def plan(request: Request, shape: Shape, hardware: Hardware, *, backward: bool = False, keep: bool = False,
         kept: bool = False, sparse: bool = False, speculation: Speculation | None = None) -> Plan:
    """The plan of one call: a forward (``backward`` False) of ``request`` (its gradients those it
    makes in the sweep; with ``keep``, an eager per-token forward whose backward will recompute
    may keep rows; with ``sparse``, a top-k loss's forward whose gradients ``sparse_grads_in_forward``
    makes: pipeline "sparse", chunked as a training step), or a recomputing backward
    (``request``'s gradients those wanted; with ``kept``, from a forward that kept rows, its row
    order as ``speculation`` says: ``kept_rows_whole``). See the module docstring."""
    opts, n_rows, dtype = request.options, shape.n_rows, shape.dtype
    sharded = shape.sharded
    planning_vocab = shape.planning_vocab_size or shape.vocab_size
    grads = request.grads
    backend = hardware.backend
    width = tile_width(dtype, hardware.interpreting) if backend == "triton" else None
    skips = tuning().skip_ignored and not shape.capturing and n_rows > 0
    if backward:
        planned = plan_chunk(backend, n_rows, planning_vocab, shape.hidden_size, dtype, True, shape.shards)
        chunk = _grown(backend, grads[1], n_rows, planned, planning_vocab, shape, 128)
        n_chunks = _cdiv(n_rows, chunk)
        fp32 = fp32_from_start(shape.vocab_size, shape.hidden_size, shape.element_size, chunk)
        kept_order = "forward" if kept and kept_rows_whole(speculation, request.outputs, shape.capturing) else "kept"
        return Plan(
            backend=backend, pipeline="kept" if kept else "recompute", sharded=sharded,
            grads_in_forward=(False,) * 3, sweep="tiles" if backend == "triton" else "torch", target_logit="sweep",
            references_first=False,
            row_order=kept_order if kept else "gradients" if skips and not sharded else "in place", row_block=128,
            chunk_rows=chunk, grown=chunk != planned, first_rows=min(chunk, n_rows), sweep_tiles=None,
            n_chunks=n_chunks, weight_sum=_weight_sum(grads[1], shape, n_chunks, fp32),
            weight_group=weight_group(dtype), weight_fp32=fp32, take_out=None, tile_width=width)
    training = any(grads) and n_rows > 0
    tokens = request.outputs != ""
    ordered = skips and not request.all_rows
    factorable = factored_gradient(dtype, opts, shape.has_bias, hardware)
    factored = training and factorable
    block = 128 if sharded else row_block(dtype, opts, shape.has_bias, training, request.return_metrics, hardware)
    planned = plan_chunk(backend, n_rows, planning_vocab, shape.hidden_size, dtype, training, shape.shards,
                         spread=not ordered, row_block=block)
    chunk = _grown(backend, training and grads[1], n_rows, planned, planning_vocab, shape, block)
    # A forward's chunks sized to fill its sweep's rounds (training's take the memory's cap; the
    # ranks of a vocabulary split plan the same chunks, whatever their slice's tiles)
    tiles = None if training or sharded else sweep_tiles(shape.vocab_size, dtype, hardware)
    referenced = factored or (tokens and not training and n_rows > 0 and factorable)
    keeps = keep and not sharded and n_rows > 0 and tuning().keep_mib != 0
    pipeline = ("sparse" if sparse and training and not sharded else "factored" if factored and not sharded
                else "stored" if training else "kept" if keeps else "statistics")
    by_product = not referenced and n_rows > 0 and target_logit_by_product(dtype, hardware)
    n_chunks = _cdiv(n_rows, chunk) if training else 0
    fp32 = fp32_from_start(shape.vocab_size, shape.hidden_size, shape.element_size, chunk)
    keep_mib, keep_rows = keep_budget() if pipeline == "kept" else (None, None)
    # Kept chunks that take references store the factored sweep's exponentials (``_kept.forward_chunks``).
    kept_exponentials = pipeline == "kept" and referenced and not (request.logit_sum or request.sum_sq)
    recompute = plan_chunk(backend, n_rows, shape.vocab_size, shape.hidden_size, dtype, True,
                           weight_grad=True) if pipeline == "kept" else 0
    return Plan(
        backend=backend, pipeline=pipeline, sharded=sharded,
        grads_in_forward=tuple(bool(g) for g in grads),
        sweep=_sweep_kernel(request, shape, hardware, pipeline, factored or kept_exponentials, referenced, by_product),
        target_logit="reference" if referenced else "product" if by_product else "sweep",
        references_first=referenced and not sharded, row_order="targets" if ordered else "in place",
        row_block=block, chunk_rows=chunk, grown=training and chunk != planned,
        first_rows=first_chunk_rows(n_rows, chunk, ordered, training, block, tiles), sweep_tiles=tiles,
        n_chunks=n_chunks, weight_sum=_weight_sum(grads[1], shape, n_chunks, fp32),
        weight_group=weight_group(dtype), weight_fp32=fp32, tile_width=width,
        take_out=rare_target() if factored and grads[1] and pipeline != "sparse" else None,
        recompute_rows=recompute, keep_mib=keep_mib, keep_rows=keep_rows,
        notes=_notes(request, pipeline, training))


def _notes(request: Request, pipeline: str, training: bool) -> tuple[str, ...]:
    """What a forward's gradients are of, where it makes them."""
    if pipeline == "sparse":
        return ("gradients of the top-k loss on the (N, K) log-probs, for an upstream of 1",)
    return (f"gradients of the {'mean' if request.outputs else request.reduction}",) if training else ()


def _grown(backend: str, weight_grad: bool, n_rows: int, chunk: int, vocab_size: int, shape: Shape,
           block: int) -> int:
    """A training step's planned ``chunk``, grown where it sums grad_weight (``plan_chunk``'s rule)."""
    if not (weight_grad and backend == "triton"):
        return chunk
    return grown_chunk(n_rows, chunk, vocab_size, shape.hidden_size, shape.dtype, shape.shards, block)


def _weight_sum(weight_grad: bool, shape: Shape, n_chunks: int, fp32: bool) -> str:
    """How grad_weight is summed over the chunks (``_gradients.Gradients``)."""
    if not weight_grad:
        return "none"
    if n_chunks > 1 and fp32:
        return "fp32"
    group = weight_group(shape.dtype)
    return "grouped" if group is not None and n_chunks > group else "direct"


def _sweep_kernel(request: Request, shape: Shape, hardware: Hardware, pipeline: str, factored: bool,
                  referenced: bool, by_product: bool) -> str:
    """The statistics sweep's kernel, as ``_triton_backend._sweep`` takes it: the Gluon kernel for
    the statistics alone (no buffer, target logit by product, no references, no logit sum or
    squares) or for the factored sweep (a training chunk's, or a kept chunk's exponentials; the
    chunks past the budget take the tiles), where its inputs suit it (``_gluon_stats.applies``), else
    the logit kernel's tiles."""
    if hardware.backend != "triton":
        return "torch"
    opts = request.options
    plain = (pipeline in ("statistics", "kept") and not referenced and by_product
             and not (request.logit_sum or request.sum_sq))
    if (plain or factored) and gluon_sweep(shape.dtype, opts, shape.has_bias, request.return_metrics, hardware,
                                           factored=factored):
        return "gluon"
    return "tiles"


# ---- the gradients made in the forward -----------------------------------------------------------
def loss_grads_in_forward(needs, reduction: str, return_lse: bool, dtype: torch.dtype, class_weight: bool,
                          label_smoothing: float, z_loss_scale: float) -> tuple[bool, bool, bool]:
    """Which of the loss's gradients ``needs`` (hidden, weight, bias) its forward makes in the sweep
    (6 N V H flops) for the backward only to scale: not for reduction "none" or a returned lse (a
    per-row upstream, recomputed: 8 N V H flops), float64 (gradcheck backpropagates more than
    once), nor class weights with label smoothing or a z-loss (terms the stored-logits pass does
    not weight)."""
    in_forward = (any(needs) and reduction != "none" and not return_lse and dtype != torch.float64
                  and not (class_weight and (label_smoothing != 0 or z_loss_scale != 0)))
    return tuple(bool(in_forward and n) for n in needs)


def token_grads_in_forward(needs, allowed: bool, grad_in_forward: bool | None, speculation: Speculation,
                           key: str) -> tuple[bool, bool, bool]:
    """Which of the per-token outputs' gradients ``needs`` their forward makes in the sweep (those
    of the mean of -log_probs, scaled in the backward): where ``allowed`` (the caller's conditions)
    and ``grad_in_forward`` says so, or where it is None, as ``speculation`` says for ``key``."""
    in_forward = any(needs) and allowed and (speculation.speculates(key) if grad_in_forward is None
                                             else bool(grad_in_forward))
    return tuple(bool(in_forward and n) for n in needs)


def mean_logits_in_sweep(opts: LossOptions) -> bool:
    """Whether the sweep sums each row's logits for ``mean_logits``: with a softcap only, as
    otherwise the mean is affine in the row (``_ops.affine_mean_logits``), and a sweep without the
    sum leaves kept rows the factored exponentials (docs/design.md, "Kept rows")."""
    return opts.has_softcap


def sparse_grads_in_forward(needs, reduction: str, add_tail: bool, dtype: torch.dtype, n_rows: int,
                            eager: bool) -> tuple[bool, bool, bool]:
    """Which of a top-k loss's gradients ``needs`` its forward makes from each chunk's buffer
    (pipeline "sparse", ``_sparse_step``: 6 N V H), for the backward to scale: with the tail bucket
    (without it no sweep is needed), a scalar upstream ("mean" or "sum"), not float64 (gradcheck),
    with rows, and ``eager`` (not traced nor captured: the chunk loop reads a count on the host)."""
    in_forward = (any(needs) and add_tail and reduction in ("mean", "sum") and dtype != torch.float64
                  and n_rows > 0 and eager)
    return tuple(bool(in_forward and n) for n in needs)


def divergence_grads_in_forward(want, n_rows: int, speculation: Speculation) -> tuple[bool, bool, bool]:
    """Which of the divergence's gradients ``want`` its forward makes in the sweep: all of them
    while its last backward found the upstream uniform (``speculation``), none for no rows."""
    in_forward = any(want) and n_rows > 0 and speculation.speculates()
    return tuple(bool(in_forward and w) for w in want)
