"""The Triton backend (``_backend``'s contract): which configuration, tile width and chunk a call
takes, the logit kernels' launch, and the launchers of the other kernels, from the modules that
hold them (``_tile_kernels``, ``_row_kernels``, ``_target_kernels``, ``_elementwise_kernels``).

One call handles one chunk of rows; the chunk loop and the matrix products live in
``_chunked``. Under ``TRITON_INTERPRET=1`` the same launches run on CPU tensors.
"""

import warnings

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _precompile, _target_kernels
from . import _tile_kernels as K
from ._elementwise_kernels import scale_, scale_rows, zero_rows
from ._launch import contiguous_rows, input_precision, interpreting, scale_and_cap, smoothing_and_z_loss, unit_columns
from ._options import LossOptions, accumulation_dtype
from ._row_kernels import (
    FactoredSweep,
    TileState,
    factored_rows,
    finalize,
    grad_from_kept,
    grad_from_stored,
    row_factors,
)
from ._settings import current as settings
from ._target_kernels import mean_grad_ratio, order_rows, take_out_flags, targets_out_of_range
from ._tile_kernels import combine_tiles, new_row_stats

# The backend's functions (``_backend.Backend``) that the kernels' modules define: their launchers.
__all__ = ["factored_rows", "finalize", "grad_from_kept", "grad_from_stored", "mean_grad_ratio", "order_rows",
           "row_factors", "scale_", "scale_rows", "take_out_flags", "targets_out_of_range", "zero_rows"]


KERNELS_INTERPRETED = isinstance(K._tile_stats_kernel, InterpretedFunction)


# ---- configurations ---------------------------------------------------------------------
def _set_descriptor_blocks(nargs):
    # TMA descriptors carry their block shape, which depends on the configuration.
    if isinstance(nargs["hidden_ptr"], TensorDescriptor):
        nargs["hidden_ptr"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
        nargs["weight_ptr"].block_shape = [nargs["BLOCK_V"], nargs["BLOCK_K"]]
    if isinstance(nargs["out_ptr"], TensorDescriptor):
        nargs["out_ptr"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_V"]]


def _config(block_n: int, block_k: int, num_warps: int, num_stages: int, persistent: bool = False) -> triton.Config:
    return triton.Config(
        {"BLOCK_N": block_n, "BLOCK_K": block_k, "PERSISTENT": persistent},
        num_warps=num_warps,
        num_stages=num_stages,
        pre_hook=_set_descriptor_blocks,
    )


def logit_tile_configs(block_v: int, element_size: int) -> list[triton.Config]:
    """Candidate configurations of the logit kernel for one tile width (BLOCK_V).

    BLOCK_V is fixed per call because the tile statistics are allocated per tile; the
    rest is autotuned. Shared memory per stage is (BLOCK_N + BLOCK_V) * BLOCK_K * element
    size, kept under Hopper's 227 KiB.
    """
    if element_size == 8:  # float64 (verification, not speed): fp64 accumulators are register-hungry
        return [_config(64, 32, 4, 2)]
    if element_size == 4:
        return [_config(128, 32, 8, 3), _config(64, 32, 4, 3)]
    if block_v >= 256:
        # 4 persistent stages fit only without the buffer's TMA store (the forward's sweep).
        return [_config(128, 64, 8, 3), _config(128, 64, 8, 3, True), _config(128, 64, 8, 4),
                _config(128, 64, 8, 4, True), _config(64, 64, 4, 4)]
    return [_config(128, 64, 4, 4), _config(128, 64, 8, 4), _config(128, 64, 8, 4, True), _config(256, 64, 8, 3)]


_autotuned: dict[tuple, triton.runtime.Autotuner] = {}
_chosen: dict[tuple, triton.Config] = {}  # the autotuner's pick per launch key (see _launch_tiles)

# The configuration of both logit kernels on Hopper (sm_90) for 16-bit inputs and 256-column
# tiles, launched there without autotuning (its choice for the main heads: docs/design.md, "Two
# logit kernels"). Settings' ``tuned=False`` autotunes there too, to re-derive it.
TUNED = {(9, 0): (128, 64, 8, 3, True)}  # (BLOCK_N, BLOCK_K, warps, stages, persistent)

_capabilities: dict[torch.device, tuple[int, int]] = {}


def _tuned(device: torch.device, block_v: int, element_size: int) -> tuple | None:
    if element_size != 2 or block_v != 256:
        return None
    if device not in _capabilities:
        _capabilities[device] = torch.cuda.get_device_capability(device)
    return TUNED.get(_capabilities[device])


def _tile_kernel(kernel, block_v: int, element_size: int, device: torch.device, key: tuple):
    """(kernel, fixed meta-parameters) to launch ``kernel`` (``K._tile_stats_kernel`` or
    ``K._tile_grad_kernel``) with: one small tile when interpreting, the forced or the tuned
    configuration, else the autotuner (one per launch ``key``: the variants' pointers that are
    None differ in their best configuration) with no fixed ones."""
    tuning = settings()
    if interpreting():
        return kernel, {"BLOCK_N": tuning.block_n, "BLOCK_K": tuning.block_k, "PERSISTENT": tuning.persistent}
    config = tuning.config or (_tuned(device, block_v, element_size) if tuning.autotune and tuning.tuned else None)
    if config is not None:  # (BLOCK_N, BLOCK_K, warps, stages, persistent)
        block_n, block_k, warps, stages, persistent = config
        return kernel, {"BLOCK_N": block_n, "BLOCK_K": block_k, "PERSISTENT": persistent,
                        "num_warps": warps, "num_stages": stages}
    configs = logit_tile_configs(block_v, element_size)
    if not tuning.autotune:
        configs = configs[:1]
    key = (*key, len(configs))
    if key not in _autotuned:
        _autotuned[key] = triton.autotune(configs, key=["hidden_size", "vocab_size"])(kernel)
    return _autotuned[key], {}


def tile_width(dtype: torch.dtype) -> int:
    """Vocabulary columns per logit tile (BLOCK_V)."""
    block_v = settings().block_v
    if block_v is not None:
        return block_v
    if interpreting():
        return 32
    if dtype == torch.float64:
        return 64
    return 128 if dtype == torch.float32 else 256


def chunk_rows(n_rows: int, vocab_size: int, dtype: torch.dtype, training: bool, shards: int = 1,
               spread: bool = True, hidden_size: int = 0, row_block: int = 128) -> int:
    """Rows per chunk. Training keeps a chunk's logits (rows x V) in a buffer of at most
    ``buffer_mib`` (768 MiB) and ``chunk_rows`` (1536) rows (``_settings``), and the chunk's whole working
    set (``chunk_bytes``: the buffer and the hidden-sized blocks alive beside it) within a
    quarter of the logits of 8192 rows (``working_set_rows``, 2048 rows' worth; so, on a small
    vocabulary, fewer rows; a step of many chunks may then grow them: ``_chunked``); the forward
    alone keeps only per-tile statistics and takes up to 4096 rows. With ``spread`` the
    ``n_rows`` are then spread evenly over the chunks (in whole ``row_block``s: the sweep's rows
    a tile), so that no small last chunk runs at a loss; without it (the rows to compute are not
    known yet) the largest chunk. A vocabulary slice of one of ``shards`` ranks takes ``shards``
    times the rows. A forward's largest chunk is whole ``row_block``s too; training's is the
    memory's (a multiple of 128)."""
    tuning = settings()
    if training:
        budget = (768 if tuning.buffer_mib is None else tuning.buffer_mib) * 2**20
        logit_row = vocab_size * (torch.finfo(dtype).bits // 8)
        by_budget = max(128, budget // logit_row // 128 * 128)
        share_rows = tuning.working_set_rows  # a quarter of 8192 rows' logits
        by_share = max(128, share_rows * shards * logit_row
                       // chunk_bytes(1, vocab_size, dtype, hidden_size, shards) // 128 * 128)
        most = min((tuning.chunk_rows or 1536) * shards, by_budget, by_share)
    else:
        most = (tuning.chunk_rows or 4096) * shards
        most = max(row_block, most // row_block * row_block)
    if n_rows <= most:
        return max(1, n_rows)
    if not spread:
        return most
    per_chunk = triton.cdiv(n_rows, triton.cdiv(n_rows, most))
    return min(most, triton.cdiv(per_chunk, row_block) * row_block)


def chunk_bytes(rows: int, vocab_size: int, dtype: torch.dtype, hidden_size: int, shards: int = 1) -> int:
    """Bytes of a training chunk of ``rows`` at any time (``chunk_rows``' memory model): its
    logits' buffer [rows, V] in the inputs' dtype, and beside it H x max(4, 2 x element size)
    bytes a row (16-bit: the gathered rows and their scaled copy, then that copy alone, then the
    fp32 grad_hidden block; under vocabulary parallelism the gathered rows stay until
    grad_weight's product, beside that block: H x (element size + 4))."""
    element_size = torch.finfo(dtype).bits // 8
    beside = hidden_size * (max(4, 2 * element_size) if shards == 1 else element_size + 4)
    return rows * (vocab_size * element_size + beside)


def row_block(dtype: torch.dtype, opts: LossOptions, has_bias: bool, training: bool, return_metrics: bool,
              device: torch.device) -> int:
    """Rows a tile of the statistics sweeps, in which the chunks are planned: 192 where
    ``_gluon_stats`` computes them (``_gluon_sweep``: a forward's, or a training step's factored
    sweep with ``_gluon_training``), 128 (the logit kernel's) elsewhere. A tile's rows past a
    chunk's end cost as much as the others: Llama-2's 8192 rows, every target counted, spread
    in 128s took 46 tiles of 192 rows a vocabulary tile, in 192s 43. ``training_row_block``
    sets a step's (exploration)."""
    if training:
        factored = _gluon_training() and factored_gradient(dtype, opts, has_bias)
        gluon = _gluon_sweep(dtype, opts, has_bias, return_metrics, device) if factored else None
        forced = settings().training_row_block
        return forced if forced is not None else 128 if gluon is None else gluon.BLOCK_N
    gluon = _gluon_sweep(dtype, opts, has_bias, return_metrics, device)
    return 128 if gluon is None else gluon.BLOCK_N


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine (TMA) can move these 2-D tensors: Hopper or newer, rows
    contiguous and 16-byte aligned."""
    if not settings().tma or tensors[0].element_size() == 8:  # float64: plain loads
        return False
    if not interpreting() and torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    for t in tensors:
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


_sm_counts: dict[torch.device, int] = {}


def _max_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per multiprocessor (a handful when interpreting)."""
    if interpreting():
        return 4
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


def precompile(kind: str, device: torch.device) -> None:
    """On a GPU, compiles in forked processes the kernels that calls of ``kind`` compiled where
    they were recorded (``_precompile``), once per process; a no-op in the interpreter."""
    if device.type == "cuda":
        _precompile.warm(kind, device)


def sweep_tiles(vocab_size: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int] | None:
    """(vocabulary tiles a row block, programs a round) of a persistent sweep over this
    weight, for the chunk plan (``_chunked._fullest_chunk``)."""
    return triton.cdiv(vocab_size, tile_width(dtype)), _max_programs(device)


# ---- launches ---------------------------------------------------------------------------
L2_HIDDEN_BYTES = 32 * 2**20  # the hidden rows a sweep keeps in L2: 4096 rows of H = 4096 in 16 bits (50 MB L2)


def _group_rows(hidden: torch.Tensor) -> int:
    """Rows of a tile group of the logit kernel (``group_rows``, exploration): 4096, the
    forward's chunk, or fewer where their hidden rows pass L2_HIDDEN_BYTES, in whole 128-row
    blocks. On the H200 (docs/design.md) one launch over 8192 rows in one group took 3-6%
    more time than in groups of 4096 (the hidden rows fall out of L2), and a group of Gemma-2's
    7405 rows (34 MB) as much. Training chunks are one group; the forward's chunks under
    vocabulary parallelism (4096 rows a rank) and of fp32 inputs are several."""
    forced = settings().group_rows
    if forced is not None:
        return forced
    row_bytes = hidden.shape[1] * hidden.element_size()
    return max(128, min(4096, L2_HIDDEN_BYTES // max(row_bytes, 1) // 128 * 128))


def _launch_tiles(kernel, hidden, weight, out, pointers: tuple, scalars: tuple, block_v: int) -> None:
    """Launches a logit kernel (``K._tile_stats_kernel`` or ``K._tile_grad_kernel``) over every
    (row block, vocabulary tile) of ``hidden`` [rows, H] @ ``weight`` [V, H].T. ``pointers``: the
    kernel's pointer arguments after hidden and weight, ``out`` (the buffer [rows, V], contiguous, or
    None) among them; ``scalars``: its scalar arguments, None where absent. The kernels read hidden
    and weight as contiguous [rows, H] and [V, H] (``_launch.contiguous_rows``); descriptors where
    the copy engine moves them."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    assert unit_columns(hidden) and unit_columns(weight), "columns made adjacent once a call (_chunked.unit_columns)"
    assert out is None or out.stride() == (vocab_size, 1), "the logit kernels store to a contiguous [rows, V]"
    # The kernels derive the row strides from H: rows of a strided view are copied (a chunk's).
    hidden, weight = contiguous_rows(hidden), contiguous_rows(weight)
    # The copy engine loads hidden and weight, and stores the chunk buffer, where their rows
    # are aligned; block shapes are set per configuration (``_set_descriptor_blocks``).
    use_tma = _tma_ok(hidden, weight)
    tma_store = use_tma and out is not None and _tma_ok(out)
    hidden_arg = TensorDescriptor.from_tensor(hidden, [16, 16]) if use_tma else hidden
    weight_arg = TensorDescriptor.from_tensor(weight, [16, 16]) if use_tma else weight
    out_arg = TensorDescriptor.from_tensor(out, [16, 16]) if tma_store else out
    pointers = tuple(out_arg if p is out and out is not None else p for p in pointers)
    args = (
        hidden_arg, weight_arg, *pointers,
        n_rows, vocab_size, hidden_size, _group_rows(hidden), *scalars,
    )
    meta = dict(EVEN_K=hidden_size % 128 == 0, EVEN_V=vocab_size % block_v == 0,
                INPUT_PRECISION=input_precision(hidden.dtype), BLOCK_V=block_v)
    # What a launch's configuration may depend on: the kernel, dtypes, sizes and which arguments are None.
    key = (kernel.fn.__name__, hidden.dtype, None if out is None else out.dtype, hidden_size, vocab_size,
           *(p is None for p in pointers), *(s is None for s in scalars), use_tma, tma_store, meta["EVEN_K"],
           meta["EVEN_V"], meta["INPUT_PRECISION"], block_v)
    launched, fixed = _tile_kernel(kernel, block_v, hidden.element_size(), hidden.device, key)
    max_programs = _max_programs(hidden.device)

    def grid(meta):
        tiles = triton.cdiv(n_rows, meta["BLOCK_N"]) * triton.cdiv(vocab_size, block_v)
        return (min(tiles, max_programs) if meta["PERSISTENT"] else tiles,)

    descriptors = {"hidden_ptr": hidden_arg, "weight_ptr": weight_arg, "out_ptr": out_arg, "BLOCK_V": block_v}
    if fixed:
        _set_descriptor_blocks({**descriptors, **fixed})
        launched[grid](*args, **meta, **fixed)
        return
    # Once the autotuner has chosen for a key, launch its choice directly: the autotuner's own
    # per-launch work is host time that small heads' steps wait for.
    config = _chosen.get(key)
    if config is None:
        launched[grid](*args, **meta)  # tunes on the first launch of a key
        _chosen[key] = launched.best_config
        return
    _set_descriptor_blocks({**descriptors, **config.kwargs})
    kernel[grid](*args, **meta, **config.all_kwargs())


def _sweep(hidden, weight, bias, targets, opts: LossOptions, shifted_out, row_ref, loss_grad, class_weight,
           target_logit, return_metrics, logit_sum=False, sum_sq=False):
    """The statistics sweep over a chunk: (tile statistics, target_logit, tile width, tiles a row).
    Statistics not asked for are None. Without a buffer, a ``row_ref`` takes the sums relative to
    it (as the factored training sweep's, so that both give the same statistics)."""
    n_rows = hidden.shape[0]
    vocab_size = weight.shape[0]
    block_v = tile_width(hidden.dtype)  # once a chunk: the state carries it to the buffer's passes
    num_tiles = triton.cdiv(vocab_size, block_v)
    device = hidden.device
    acc_dtype = accumulation_dtype(hidden.dtype)

    def tile_array(enabled, dtype=acc_dtype):
        return torch.empty((n_rows, num_tiles), device=device, dtype=dtype) if enabled else None

    tile_stats = (
        tile_array(True), tile_array(True), tile_array(return_metrics),
        tile_array(return_metrics, torch.int32), tile_array(opts.has_smoothing or logit_sum), tile_array(sum_sq),
    )
    if row_ref is not None and target_logit is None:  # the factored sweep writes no target logit: it must come along
        raise ValueError("row_stats takes row_ref with its target_logit (both from row_reference)")
    pick_target = target_logit is None and not _target_logit_by_product(hidden)
    if pick_target:  # written by the tile that holds each row's target
        target_logit = torch.full((n_rows,), float("nan"), device=device, dtype=acc_dtype)
    elif target_logit is None:
        target_logit = _target_kernels.picked_logits(hidden, weight, targets, opts, bias)[1]
    factored = shifted_out is not None and row_ref is not None
    gluon = None
    plain_stats = shifted_out is None and not pick_target and row_ref is None and not (logit_sum or sum_sq)
    if plain_stats or factored and _gluon_training():
        gluon = _gluon_sweep(hidden.dtype, opts, bias is not None, return_metrics, device)
    buffer = shifted_out if factored else None  # the statistics alone store none
    if gluon is not None and gluon.applies(hidden, weight, buffer) and _gluon_tile_stats(
            gluon, hidden, weight, tile_stats[0], tile_stats[1], device, row_ref, loss_grad, buffer):
        return tile_stats, target_logit, block_v, num_tiles
    pointers = (bias, targets, *tile_stats, target_logit if pick_target else None, shifted_out, row_ref,
                loss_grad if factored else None, class_weight if tile_stats[4] is not None else None)
    _launch_tiles(K._tile_stats_kernel, hidden, weight, shifted_out, pointers, scale_and_cap(opts), block_v)
    return tile_stats, target_logit, block_v, num_tiles


def _gluon_training() -> bool:
    """Whether the factored training sweep takes ``_gluon_stats`` where it applies
    (``gluon_training``, default True: a step 1-2% faster at the power cap on large vocabularies,
    docs/design.md; ``gluon`` False turns off both sweeps)."""
    return settings().gluon_training


def _gluon_sweep(dtype: torch.dtype, opts: LossOptions, has_bias: bool, return_metrics: bool,
                 device: torch.device):
    """``_gluon_stats`` where it computes a statistics sweep (the statistics alone, or the factored training
    sweep) of inputs of ``dtype`` on ``device``, else None: 16-bit inputs on Hopper, the
    logits z = h W^T alone (no bias, logit scale, softcap or smoothing's logit sum; z-loss enters
    only the loss), no metrics, the target logit from the tensor-core product and the logit
    kernel's 256-column tiles."""
    if dtype not in (torch.bfloat16, torch.float16) or device.type != "cuda" or return_metrics or has_bias:
        return None
    if float(opts.logit_scale) != 1.0 or opts.has_softcap or opts.has_smoothing:
        return None
    gluon = _gluon_stats_module()
    if gluon is None or tile_width(dtype) != gluon.BLOCK_V.value or not gluon.device_applies(device):
        return None
    return gluon


_gluon_stats = None


def _gluon_stats_module():
    """``_gluon_stats`` (the forward's statistics in Gluon, for Hopper), or None where it cannot
    run: in the interpreter, or with a Triton whose Gluon lacks the names it uses."""
    global _gluon_stats
    if _gluon_stats is None:
        _gluon_stats = False
        if not interpreting():
            try:
                from . import _gluon_stats as module
                _gluon_stats = module
            except Exception:  # no Gluon, or another Triton's (an experimental API): the logit kernel
                pass
    return _gluon_stats or None


_gluon_compiled: set[tuple] = set()


def _gluon_tile_stats(gluon, hidden, weight, tile_max, tile_sum_exp, device, row_ref=None, loss_grad=None,
                      buffer=None) -> bool:
    """Launches ``_gluon_stats``' kernel (with ``buffer``, the factored sweep's); False (and the
    logit kernel from then on, with a warning) if its first launch of a specialisation fails:
    Gluon is experimental, and another Triton's may refuse this code where the logit kernel's
    language does not move."""
    global _gluon_stats
    key = (hidden.dtype, weight.shape[0] % gluon.BLOCK_V.value == 0, buffer is not None, device)
    try:
        gluon.tile_stats(hidden, weight, tile_max, tile_sum_exp, _group_rows(hidden), _max_programs(device),
                         row_ref, loss_grad, buffer)
    except Exception as error:
        if key in _gluon_compiled:  # it ran before: a failure of the launch itself
            raise
        warnings.warn(f"fused-linear-ce: the Gluon statistics kernel failed to launch with Triton "
                      f"{triton.__version__} ({type(error).__name__}); using the Triton logit kernel", stacklevel=2)
        _gluon_stats = False
        return False
    _gluon_compiled.add(key)
    return True


def row_stats(hidden, weight, bias, targets, opts: LossOptions, shifted_out=None, row_ref=None, loss_grad=None,
              class_weight=None, target_logit=None, return_metrics=False, logit_sum=False, sum_sq=False):
    """Softmax statistics of a chunk of rows; with ``shifted_out`` [rows, V] also stores
    ``z - tile_max`` there, or with ``row_ref`` [rows] (and ``loss_grad`` [rows]) the
    exponentials that ``row_factors`` turns into a factored gradient; the sweep leaves the
    target's logit to ``target_logit`` [rows] then (``row_reference``'s). Returns the stats and
    the state that ``grad_from_stored`` / ``row_factors`` need. ``class_weight`` [V] (fp32,
    with label smoothing only) weights the logit sum; with ``return_metrics`` the stats carry
    each row's entropy term and argmax too; ``logit_sum`` and ``sum_sq`` add each row's sum of
    logits and sum_j exp(2 (z_j - row_max)) (for the mean logit and sum_j p_j^2)."""
    n_rows = hidden.shape[0]
    device = hidden.device
    f32 = dict(device=device, dtype=accumulation_dtype(hidden.dtype))  # float64 for float64 inputs
    tile_stats, target_logit, block_v, num_tiles = _sweep(hidden, weight, bias, targets, opts, shifted_out, row_ref,
                                                          loss_grad, class_weight, target_logit, return_metrics,
                                                          logit_sum=logit_sum, sum_sq=sum_sq)
    stats = new_row_stats(n_rows, target_logit, opts, return_metrics, f32, logit_sum=logit_sum, sum_sq=sum_sq)
    combine_tiles(tile_stats, stats, row_ref, num_tiles)
    return stats, TileState(tile_stats[0], block_v)


def factored_sweep(hidden, weight, targets, opts: LossOptions, buffer, loss_grad, return_metrics=False,
                   reference=None) -> FactoredSweep:
    """A factored training chunk's sweep, of rows whose weight is the whole vocabulary:
    ``row_reference`` (unless ``reference`` brings its (B, target_logit) already), then the logit
    tiles' statistics, with the exponentials stored to ``buffer`` [rows, V]."""
    row_ref, target_logit = row_reference(hidden, weight, targets, opts) if reference is None else reference
    tile_stats, target_logit, block_v, num_tiles = _sweep(hidden, weight, None, targets, opts, buffer, row_ref,
                                                          loss_grad, None, target_logit, return_metrics)
    return FactoredSweep(tile_stats[:4], row_ref, target_logit, block_v, num_tiles)


def new_buffer(rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The bounded per-chunk buffer [rows, V]: ``z - tile_max`` in the inputs' dtype.

    Relative to the tile max, entries that matter (p not tiny) are small numbers, so the
    16-bit rounding costs an error in p of at most about 2^-9 / e, not |z| 2^-9."""
    return torch.empty((rows, vocab_size), dtype=dtype, device=device)


def kept_row_bytes(vocab_size: int, dtype: torch.dtype, has_softcap: bool) -> int:
    """A kept row's bytes: its buffer row in the inputs' dtype, its tile maxima and reference (fp32)."""
    return vocab_size * (torch.finfo(dtype).bits // 8) + 4 * (triton.cdiv(vocab_size, tile_width(dtype)) + 1)


def factored_gradient(dtype: torch.dtype, opts: LossOptions, has_bias: bool) -> bool:
    """Whether a training chunk can keep exponentials and factor its gradient (``row_factors``):
    bf16 or fp32 (fp16's range cannot hold them), and no bias, softcap, label smoothing or
    z-loss (whose gradients are not one factor per row times the exponentials)."""
    if not settings().factored:
        return False
    return (dtype in (torch.bfloat16, torch.float32) and not has_bias and not opts.has_softcap
            and not opts.has_smoothing and not opts.has_z_loss)


def _target_logit_by_product(hidden: torch.Tensor) -> bool:
    """Whether a statistics sweep without the factored buffer leaves each row's target logit to
    ``_picked_logit_dot_kernel`` instead of picking it in its tiles: the same value (the same
    tensor-core sums, then bias, scale and softcap), without the pick's compare and select on
    every logit (1.6-4.5% of a forward, docs/design.md). Not for fp64 inputs (the product
    sums in fp32)."""
    return hidden.dtype != torch.float64


def step_target_logits(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, opts: LossOptions,
                       bias: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every row's target logit [N] fp32 (NaN where the target is not a column here) from one
    ``_picked_logit_dot_kernel`` launch, where the statistics sweeps leave the target logit to it
    (``_target_logit_by_product``); with ``rows`` row i is hidden[rows[i]]. A launch of 64-row
    programs takes about as long for any rows up to a round of them, so one launch serves the
    step, not one a chunk (docs/design.md)."""
    if not _target_logit_by_product(hidden):
        return None
    return _target_kernels.picked_logits(hidden, weight, targets, opts, bias, rows=rows)[1]


def row_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, opts: LossOptions,
                  rows: torch.Tensor | None = None):
    """(B, target_logit), both [rows] fp32: B is each row's logit at its target (column 0 where
    the target is ignored or in another rank's slice), the reference that ``row_stats`` stores
    exponentials against, and target_logit the same logit, NaN where the target is not one of
    these columns, both from a tensor-core product that sums as the logit kernel's tiles do. B is
    a lower bound of the row's max; a row whose max passes it by more than the gap (a target of
    probability below e^-40) is moved to its max by ``row_factors``. With ``rows`` (int64) row i
    is hidden[rows[i]]."""
    return _target_kernels.picked_logits(hidden, weight, targets, opts, rows=rows)


def add_target_rows(acc: torch.Tensor, target_grad: torch.Tensor, targets: torch.Tensor, hidden: torch.Tensor,
                    hidden_rows: torch.Tensor | None = None) -> None:
    """grad_weight's target terms, in place: acc[t] += sum over the rows i with targets[i] == t
    of target_grad[i] * hidden[hidden_rows[i]] (hidden[i] without ``hidden_rows``), each sum in
    fp32 in a fixed order and added to acc's entry in one rounding. acc [V, H] (unit column
    stride), target_grad [rows] fp32 (0: no term), targets [rows] int (out of range: no term)."""
    if targets.shape[0] == 0:
        return
    # The rows sorted by their keys in [0, V] (V: no term), so that each target's rows are consecutive.
    sorted_keys, perm = torch.sort(_target_kernels.target_keys(targets, target_grad, acc.shape[0]), stable=True)
    _target_kernels.target_segments(acc, sorted_keys, perm, target_grad, hidden, hidden_rows, _max_programs(acc.device))


def grad_logits(hidden, weight, bias, targets, lse, loss_grad, lse_grad, opts: LossOptions, out, bias_grad_acc,
                class_weight=None, smooth_grad=None, entropy_grad=None):
    """Recomputes a chunk's logits and stores its grad logits [rows, V] to ``out`` (lse known);
    adds their column sums to ``bias_grad_acc`` [V] fp32 unless it is None. Returns ``out``.
    With label smoothing, ``class_weight`` [V] and ``smooth_grad`` [rows] give the smoothing
    term its class weights (see ``_chunked.kernel_row_grads``); ``entropy_grad`` [rows] is
    d out / d entropy_i, whose -e_i H_i part the caller has put in ``lse_grad``."""
    assert lse.dtype == accumulation_dtype(hidden.dtype), "the kernel computes in lse's dtype"
    pointers = (bias, targets, out, lse, loss_grad, lse_grad, entropy_grad, class_weight, smooth_grad)
    scalars = (*scale_and_cap(opts), *smoothing_and_z_loss(opts), opts.inv_vocab_size(weight.shape[0]))
    _launch_tiles(K._tile_grad_kernel, hidden, weight, out, pointers, scalars, tile_width(hidden.dtype))
    if bias_grad_acc is not None:
        bias_grad_acc += torch.sum(out, dim=0, dtype=bias_grad_acc.dtype)
    return out


