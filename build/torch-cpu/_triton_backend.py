"""Launch layer of the Triton kernels: pick a configuration, allocate, build the grid, launch.

One call handles one chunk of rows; the chunk loop and the matrix products live in
``_chunked``. Under ``TRITON_INTERPRET=1`` the same launches run on CPU tensors.
"""

import os
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _kernels as K
from . import _precompile
from ._options import LossOptions, RowResults, RowStats, accumulation_dtype
from ._settings import current as settings


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Triton decides at decoration time whether a kernel is interpreted.
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


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow PyTorch's matmul precision: "highest" gets 3xTF32 (about fp32
    # accuracy on the tensor cores), "high"/"medium" get TF32.
    if dtype != torch.float32:
        return "ieee"  # ignored for 16-bit operands
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


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
class TileState(NamedTuple):
    """What a chunk's sweep leaves for its gradient: each (row, tile)'s max [rows, num_tiles]
    and the tile width it was swept with, which the passes over its buffer must use too."""

    tile_max: torch.Tensor
    block_v: int


def _acc_dtype(dtype: torch.dtype):
    """The kernels' ACC_DTYPE for inputs of ``dtype``."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _smoothing_and_z_loss(opts: LossOptions) -> tuple:
    """(label_smoothing, z_loss_scale) as the kernels take them: None where absent (0)."""
    return (float(opts.label_smoothing) if opts.has_smoothing else None,
            float(opts.z_loss_scale) if opts.has_z_loss else None)


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


def _unit_columns(t: torch.Tensor) -> bool:
    """Whether the columns of ``t`` [rows, C] are adjacent (``_chunked.unit_columns`` sees to it)."""
    return t.stride(1) == 1 or t.shape[1] <= 1


def _launch_tiles(kernel, hidden, weight, out, pointers: tuple, scalars: tuple, block_v: int) -> None:
    """Launches a logit kernel (``K._tile_stats_kernel`` or ``K._tile_grad_kernel``) over every
    (row block, vocabulary tile) of ``hidden`` [rows, H] @ ``weight`` [V, H].T. ``pointers``: the
    kernel's pointer arguments after hidden and weight, ``out`` (the buffer [rows, V], contiguous, or
    None) among them; ``scalars``: its scalar arguments, None where absent. The kernels read hidden
    and weight with unit column strides (``_chunked.unit_columns``)."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    assert _unit_columns(hidden) and _unit_columns(weight), "the logit kernels read unit column strides"
    assert out is None or out.stride() == (vocab_size, 1), "the logit kernels store to a contiguous [rows, V]"
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
        n_rows, vocab_size, hidden_size, _group_rows(hidden), hidden.stride(0), weight.stride(0), *scalars,
    )
    meta = dict(USE_TMA=use_tma, TMA_STORE=tma_store, EVEN_K=hidden_size % 128 == 0,
                EVEN_V=vocab_size % block_v == 0, INPUT_PRECISION=_input_precision(hidden.dtype), BLOCK_V=block_v)
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
        target_logit = _picked_logits(hidden, weight, targets, opts, bias)[1]
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
    _launch_tiles(K._tile_stats_kernel, hidden, weight, shifted_out, pointers, _scale_and_cap(opts), block_v)
    return tile_stats, target_logit, block_v, num_tiles


def _scale_and_cap(opts: LossOptions) -> tuple:
    """(logit_scale, softcap) as the logit kernels take them: None for a scale of 1, no softcap."""
    scale = float(opts.logit_scale)
    return None if scale == 1.0 else scale, float(opts.softcap) if opts.has_softcap else None


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


def _new_row_stats(n_rows: int, target_logit, opts: LossOptions, return_metrics: bool, f32: dict,
                   logit_sum: bool = False, sum_sq: bool = False) -> RowStats:
    device = f32["device"]
    return RowStats(
        row_max=torch.empty(n_rows, **f32),
        sum_exp=torch.empty(n_rows, **f32),
        target_logit=target_logit,
        entropy_term=torch.empty(n_rows, **f32) if return_metrics else None,
        argmax=torch.empty(n_rows, device=device, dtype=torch.int64) if return_metrics else None,
        logit_sum=torch.empty(n_rows, **f32) if opts.has_smoothing or logit_sum else None,
        sum_sq=torch.empty(n_rows, **f32) if sum_sq else None,
    )


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
    stats = _new_row_stats(n_rows, target_logit, opts, return_metrics, f32, logit_sum=logit_sum, sum_sq=sum_sq)
    block_r = 16
    K._combine_tiles_kernel[(triton.cdiv(n_rows, block_r),)](
        *tile_stats[:5], stats.row_max, stats.sum_exp, stats.entropy_term, stats.argmax, stats.logit_sum, row_ref,
        tile_stats[5], stats.sum_sq,
        n_rows, num_tiles,
        BLOCK_R=block_r,
        BLOCK_T=min(128, triton.next_power_of_2(num_tiles)),
        ACC_DTYPE=_acc_dtype(hidden.dtype),
    )
    return stats, TileState(tile_stats[0], block_v)


class FactoredSweep(NamedTuple):
    """What a factored chunk's sweep leaves for its rows' pass (``factored_rows``)."""

    tile_stats: tuple  # (max, sum_exp, entropy term, argmax) [rows, num_tiles], the last two None without metrics
    row_ref: torch.Tensor  # [rows] fp32 B
    target_logit: torch.Tensor  # [rows] fp32
    block_v: int
    num_tiles: int


def factored_sweep(hidden, weight, targets, opts: LossOptions, buffer, loss_grad, return_metrics=False,
                   reference=None) -> FactoredSweep:
    """A factored training chunk's sweep, of rows whose weight is the whole vocabulary:
    ``row_reference`` (unless ``reference`` brings its (B, target_logit) already), then the logit
    tiles' statistics, with the exponentials stored to ``buffer`` [rows, V]."""
    row_ref, target_logit = row_reference(hidden, weight, targets, opts) if reference is None else reference
    tile_stats, target_logit, block_v, num_tiles = _sweep(hidden, weight, None, targets, opts, buffer, row_ref,
                                                          loss_grad, None, target_logit, return_metrics)
    return FactoredSweep(tile_stats[:4], row_ref, target_logit, block_v, num_tiles)


def factored_rows(sweep: FactoredSweep, hidden, targets, opts: LossOptions, buffer, loss_grad, out: RowResults,
                  scaled_hidden=None, return_metrics=False, take_out=None):
    """The pass over a factored chunk's rows after its sweep, in one launch: what ``row_stats``'
    merge, ``finalize`` (into ``out``) and ``row_factors`` do, and with ``scaled_hidden`` [rows, H]
    (contiguous) also diag(r) hidden written there. ``take_out`` [rows] int8 (None: none) flags the
    rows whose target entry leaves the products. Returns (stats, r, c): r and c [rows] fp32,
    G = diag(r) E' + diag(c) T (see ``_kernels``)."""
    n_rows, hidden_size = hidden.shape
    vocab_size = buffer.shape[1]
    device = hidden.device
    assert _unit_columns(hidden) and buffer.stride() == (vocab_size, 1)
    assert sweep.num_tiles == triton.cdiv(vocab_size, sweep.block_v)
    stats = _new_row_stats(n_rows, sweep.target_logit, opts, return_metrics, dict(device=device, dtype=torch.float32))
    row_factor = torch.empty(n_rows, device=device, dtype=torch.float32)
    target_grad = torch.empty_like(row_factor)
    # Two rows a program and 1024 columns a step: the hidden rows' scaling is bound by memory, and
    # the more programs the more loads in flight (half the time of 8 rows and 256 columns;
    # docs/design.md).
    block_r = 2
    K._factored_rows_kernel[(triton.cdiv(n_rows, block_r),)](
        *sweep.tile_stats, sweep.row_ref, sweep.target_logit, targets, _take_out(take_out, n_rows, device), loss_grad,
        buffer, stats.row_max, stats.sum_exp, stats.entropy_term, stats.argmax,
        out.lse, out.loss, out.correct, out.entropy, row_factor, target_grad, hidden, scaled_hidden,
        n_rows, vocab_size, hidden_size, hidden.stride(0), opts.ignore_index, float(opts.logit_scale),
        BLOCK_R=block_r,
        BLOCK_T=min(128, triton.next_power_of_2(sweep.num_tiles)),
        BLOCK_V=sweep.block_v,
        BLOCK_H=32 if interpreting() else 1024,
    )
    return stats, row_factor, target_grad


def finalize(stats: RowStats, targets, opts: LossOptions, vocab_size: int, out: RowResults,
             return_metrics: bool = False) -> None:
    """Writes lse and loss of each row to ``out`` from its merged statistics, and with
    ``return_metrics`` its correctness and entropy."""
    n_rows = targets.shape[0]
    entropy_term, argmax, correct, entropy = ((stats.entropy_term, stats.argmax, out.correct, out.entropy)
                                              if return_metrics else (None,) * 4)
    block_r = 128
    K._finalize_rows_kernel[(triton.cdiv(n_rows, block_r),)](
        stats.row_max, stats.sum_exp, entropy_term, argmax, stats.logit_sum if opts.has_smoothing else None,
        stats.target_logit, targets, out.lse, out.loss, correct, entropy,
        n_rows, opts.ignore_index, opts.inv_vocab_size(vocab_size), *_smoothing_and_z_loss(opts),
        BLOCK_R=block_r,
    )


def new_buffer(rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The bounded per-chunk buffer [rows, V]: ``z - tile_max`` in the inputs' dtype.

    Relative to the tile max, entries that matter (p not tiny) are small numbers, so the
    16-bit rounding costs an error in p of at most about 2^-9 / e, not |z| 2^-9."""
    return torch.empty((rows, vocab_size), dtype=dtype, device=device)


def grad_from_stored(buffer, state, targets, lse, loss_grad, opts: LossOptions, bias_grad_acc):
    """Turns the ``z - tile_max`` stored by ``row_stats`` into grad logits, in place, and
    adds the chunk's column sums to ``bias_grad_acc`` [V] fp32 unless it is None.
    Returns the grad logits [rows, V] (the buffer itself)."""
    n_rows, vocab_size = buffer.shape
    block_v = state.block_v
    # Without a bias, programs also split the rows (more of them in flight: this pass is
    # bound by memory bandwidth); with one, a program walks all rows of its columns.
    rows_per_program = n_rows if bias_grad_acc is not None else (32 if interpreting() else 128)
    grid = (triton.cdiv(vocab_size, block_v), triton.cdiv(n_rows, rows_per_program))
    K._grad_from_shifted_kernel[grid](
        buffer, state.tile_max, lse, loss_grad, targets, bias_grad_acc,
        n_rows, rows_per_program, vocab_size, buffer.stride(0),
        float(opts.logit_scale), _scale_and_cap(opts)[1], *_smoothing_and_z_loss(opts), opts.inv_vocab_size(vocab_size),
        BLOCK_N=16 if interpreting() else 32,
        BLOCK_V=block_v,
        num_warps=8,
    )
    return buffer


def kept_row_bytes(vocab_size: int, dtype: torch.dtype, has_softcap: bool) -> int:
    """A kept row's bytes: its buffer row in the inputs' dtype, its tile maxima and reference (fp32)."""
    return vocab_size * (torch.finfo(dtype).bits // 8) + 4 * (triton.cdiv(vocab_size, tile_width(dtype)) + 1)


def grad_from_kept(buffer, state, row_ref, targets, lse, loss_grad, lse_grad, entropy_grad, opts: LossOptions,
                   bias_grad_acc):
    """Grad logits [rows, V] of kept rows, in place in ``buffer`` (``z - tile_max``, or with
    ``row_ref`` the factored sweep's exponentials), by ``_grad_from_kept_kernel``; adds their
    column sums to ``bias_grad_acc`` [V] fp32 unless None. Returns the buffer."""
    n_rows, vocab_size = buffer.shape
    assert buffer.stride() == (vocab_size, 1), "the kernel reads a contiguous buffer"
    if n_rows == 0:
        return buffer
    # As ``grad_from_shifted``: without a bias, programs also split the rows (a pass bound by memory).
    rows_per_program = n_rows if bias_grad_acc is not None else (32 if interpreting() else 128)
    grid = (triton.cdiv(vocab_size, state.block_v), triton.cdiv(n_rows, rows_per_program))
    K._grad_from_kept_kernel[grid](
        buffer, state.tile_max, row_ref, lse, loss_grad, lse_grad, entropy_grad, targets, bias_grad_acc,
        n_rows, rows_per_program, vocab_size, buffer.stride(0), *_scale_and_cap(opts),
        BLOCK_N=16 if interpreting() else 32,
        BLOCK_V=state.block_v,
        FAST_LOG=not interpreting(),  # (the interpreter has no libdevice)
        num_warps=8,
    )
    return buffer


def factored_gradient(dtype: torch.dtype, opts: LossOptions, has_bias: bool) -> bool:
    """Whether a training chunk can keep exponentials and factor its gradient (``row_factors``):
    bf16 or fp32 (fp16's range cannot hold them), and no bias, softcap, label smoothing or
    z-loss (whose gradients are not one factor per row times the exponentials)."""
    if not settings().factored:
        return False
    return (dtype in (torch.bfloat16, torch.float32) and not has_bias and not opts.has_softcap
            and not opts.has_smoothing and not opts.has_z_loss)


def order_rows(targets: torch.Tensor, ignore_index: int, mean: bool):
    """The rows with a loss first: (order int64 [N], targets[order] int64 [N], their count
    int64 [1], d loss / d loss_i [N] fp32 of the ordered rows: 1, or 1 / count for a mean)."""
    n_rows = targets.shape[0]
    device = targets.device
    order = torch.empty(n_rows, device=device, dtype=torch.int64)
    ordered_targets = torch.empty(n_rows, device=device, dtype=torch.int64)
    count = torch.empty(1, device=device, dtype=torch.int64)
    loss_grad = torch.empty(n_rows, device=device, dtype=torch.float32)
    # Each program reads all N targets: blocks grow with N to keep the programs at 64 or fewer
    # (up to 262144 rows; a few when interpreting), to 4096 rows at 8 warps (8192 at 16 spill
    # on sm_90 in Triton 3.9): one program walking the blocks in turn took four times as long
    # (docs/design.md).
    parts = 4 if interpreting() else 64
    block = min(4096, max(64 if interpreting() else 1024, triton.next_power_of_2(triton.cdiv(n_rows, parts))))
    K._order_rows_kernel[(max(1, triton.cdiv(n_rows, block)),)](
        targets, order, ordered_targets, count, loss_grad, n_rows, int(ignore_index), MEAN=mean, BLOCK=block,
        num_warps=max(4, block // 512))
    return order, ordered_targets, count, loss_grad


def _target_logit_by_product(hidden: torch.Tensor) -> bool:
    """Whether a statistics sweep without the factored buffer leaves each row's target logit to
    ``_picked_logit_dot_kernel`` instead of picking it in its tiles: the same value (the same
    tensor-core sums, then bias, scale and softcap), without the pick's compare and select on
    every logit (1.6-4.5% of a forward, docs/design.md). Not for fp64 inputs (the product
    sums in fp32)."""
    return hidden.dtype != torch.float64


def _picked_logits(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, opts: LossOptions,
                   bias: torch.Tensor | None = None, rows: torch.Tensor | None = None):
    """(z_ic, the same or NaN where t_i is not a column here), both [rows] fp32, with c = t_i
    (column 0 where the target is not a column of this weight) and z the final logit (bias, scale,
    softcap), from a tensor-core product that sums each logit as the logit kernel's tiles do.
    With ``rows`` (int64 [rows]) row i is hidden[rows[i]]."""
    n_rows, hidden_size = (hidden.shape[0] if rows is None else rows.shape[0]), hidden.shape[1]
    out = torch.empty(n_rows, device=hidden.device, dtype=torch.float32)
    target_logit = torch.empty_like(out)
    block_r, block_k = (32, 16) if interpreting() else (64, 64)
    K._picked_logit_dot_kernel[(triton.cdiv(n_rows, block_r),)](
        hidden, weight, targets, out, target_logit, bias, rows,
        n_rows, weight.shape[0], hidden_size, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        float(opts.logit_scale), _scale_and_cap(opts)[1],
        INPUT_PRECISION=_input_precision(hidden.dtype), BLOCK_R=block_r, BLOCK_K=block_k,
        # six stages of 16 KiB: a 64-row program a multiprocessor is bound by the loads in flight
        # (three stages took a third longer; docs/design.md)
        num_warps=4, num_stages=6,
    )
    return out, target_logit


def step_target_logits(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, opts: LossOptions,
                       bias: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every row's target logit [N] fp32 (NaN where the target is not a column here) from one
    ``_picked_logit_dot_kernel`` launch, where the statistics sweeps leave the target logit to it
    (``_target_logit_by_product``); with ``rows`` row i is hidden[rows[i]]. A launch of 64-row
    programs takes about as long for any rows up to a round of them, so one launch serves the
    step, not one a chunk (docs/design.md)."""
    if not _target_logit_by_product(hidden):
        return None
    return _picked_logits(hidden, weight, targets, opts, bias, rows=rows)[1]


def row_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, opts: LossOptions,
                  rows: torch.Tensor | None = None):
    """(B, target_logit), both [rows] fp32: B is each row's logit at its target (column 0 where
    the target is ignored or in another rank's slice), the reference that ``row_stats`` stores
    exponentials against, and target_logit the same logit, NaN where the target is not one of
    these columns, both from a tensor-core product that sums as the logit kernel's tiles do. B is
    a lower bound of the row's max; a row whose max passes it by more than the gap (a target of
    probability below e^-40) is moved to its max by ``row_factors``. With ``rows`` (int64) row i
    is hidden[rows[i]]."""
    return _picked_logits(hidden, weight, targets, opts, rows=rows)


def scale_rows(src: torch.Tensor, factor: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor | None = None,
               target_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """dst[dst_rows] = factor[:, None] * src (rounded once to dst's dtype); dst_rows: int64
    [rows] indices into dst, or None for dst's first rows. src [rows, C] any strides, dst [*, C]
    with unit column stride. With ``target_terms`` (c [rows] fp32, targets [rows], weight [V, C],
    any strides)
    also + c[:, None] * weight[targets] (rows whose target is out of range add nothing)."""
    n_rows, n_cols = src.shape
    block_r, block_c = (16, 32) if interpreting() else (16, 256)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    target_grad, targets, weight = target_terms if target_terms is not None else (None, None, None)
    K._scale_rows_kernel[grid](
        src, factor, dst, dst_rows, target_grad, targets, weight,
        n_rows, n_cols, weight.shape[0] if target_terms is not None else 0,
        src.stride(0), src.stride(1), dst.stride(0), *(weight.stride() if target_terms is not None else (0, 0)),
        BLOCK_R=block_r, BLOCK_C=block_c,
    )
    return dst


def zero_rows(dst: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[rows] = 0 in place: dst [*, C] with unit column stride, rows int64 [n]. Vector stores,
    where ``index_fill_``'s elementwise kernel stores 2 bytes at a time (docs/design.md)."""
    n_rows, n_cols = rows.shape[0], dst.shape[1]
    if n_rows == 0:
        return
    block_r, block_c = (16, 32) if interpreting() else (16, 256)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    K._zero_rows_kernel[grid](dst, rows, n_rows, n_cols, dst.stride(0), BLOCK_R=block_r, BLOCK_C=block_c)


def add_target_rows(acc: torch.Tensor, target_grad: torch.Tensor, targets: torch.Tensor, hidden: torch.Tensor,
                    hidden_rows: torch.Tensor | None = None) -> None:
    """grad_weight's target terms, in place: acc[t] += sum over the rows i with targets[i] == t
    of target_grad[i] * hidden[hidden_rows[i]] (hidden[i] without ``hidden_rows``), each sum in
    fp32 in a fixed order and added to acc's entry in one rounding. acc [V, H] (unit column
    stride), target_grad [rows] fp32 (0: no term), targets [rows] int (out of range: no term)."""
    n_rows = targets.shape[0]
    vocab_size, hidden_size = acc.shape
    if n_rows == 0:
        return
    # The rows sorted by their keys in [0, V] (V: no term), so that each target's rows are
    # consecutive; int16 keys where V < 2^15 take half the radix passes of int32 ones.
    keys = torch.empty(n_rows, device=acc.device, dtype=torch.int16 if vocab_size < 2**15 else torch.int32)
    block = 64 if interpreting() else 1024
    K._target_keys_kernel[(triton.cdiv(n_rows, block),)](targets, target_grad, keys, n_rows, vocab_size, BLOCK=block)
    sorted_keys, perm = torch.sort(keys, stable=True)
    # Bound by memory (a row of hidden and acc's row twice per term): as many programs as the
    # multiprocessors hold, grid-stride, each with four positions' loads in flight.
    block_p, block_h = 4, 32 if interpreting() else 1024
    column_blocks = triton.cdiv(hidden_size, block_h)
    programs = min(triton.cdiv(n_rows, block_p), max(1, 16 * _max_programs(acc.device) // column_blocks))
    K._target_segments_kernel[(programs, column_blocks)](
        acc, sorted_keys, perm, target_grad, hidden, hidden_rows,
        n_rows, vocab_size, hidden_size, acc.stride(0), hidden.stride(0), hidden.stride(1),
        BLOCK_P=block_p, BLOCK_H=block_h,
    )


def targets_out_of_range(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """A [] int32 flag, 1 if a target is neither in [0, vocab_size) nor ``ignore_index``: one
    launch beside its zero fill, for the loss's range check."""
    flag = torch.zeros((), device=targets.device, dtype=torch.int32)
    n_rows = targets.numel()
    if n_rows:
        block = 64 if interpreting() else 1024
        K._targets_out_of_range_kernel[(triton.cdiv(n_rows, block),)](
            targets, flag, n_rows, vocab_size, int(ignore_index), BLOCK=block)
    return flag


def mean_grad_ratio(row_grad: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """[2] fp32 (uniform, ratio) of ``_mean_grad_ratio_kernel``, in one launch."""
    out = torch.empty(2, device=targets.device, dtype=torch.float32)
    K._mean_grad_ratio_kernel[(1,)](row_grad, targets, out, targets.shape[0], int(ignore_index),
                                    BLOCK=64 if interpreting() else 1024)
    return out


def take_out_flags(targets: torch.Tensor, vocab_size: int, ignore_index: int, rare_count: int,
                   improbable_count: int) -> torch.Tensor:
    """[N] int8 take_out flags (``_kernels``): OUT_ALWAYS on the rows whose target column is the
    target of at most ``rare_count`` of the rows, OUT_IF_IMPROBABLE where of at most
    ``improbable_count``, 0 elsewhere and on rows without a target here (out of range, or
    ``ignore_index``). Counted with int32 atomics in three launches and no host sync (so also
    under CUDA-graph capture)."""
    n_rows = targets.shape[0]
    counts = torch.zeros(vocab_size, device=targets.device, dtype=torch.int32)
    flags = torch.empty(n_rows, device=targets.device, dtype=torch.int8)
    if n_rows == 0:
        return flags
    block = 64 if interpreting() else 1024
    grid = (triton.cdiv(n_rows, block),)
    K._count_targets_kernel[grid](targets, counts, n_rows, vocab_size, int(ignore_index), BLOCK=block)
    K._take_out_flags_kernel[grid](targets, counts, flags, n_rows, vocab_size, int(ignore_index),
                                   int(rare_count), int(improbable_count), BLOCK=block)
    return flags


def _take_out(take_out: torch.Tensor | None, n_rows: int, device: torch.device) -> torch.Tensor:
    """The rows' take_out flags [rows] int8 (``_kernels``: 0, OUT_ALWAYS, OUT_IF_IMPROBABLE);
    zeros (every target entry in the products) for None."""
    return take_out if take_out is not None else torch.zeros(n_rows, device=device, dtype=torch.int8)


def row_factors(buffer, state, row_max, row_ref, lse, loss_grad, targets, opts: LossOptions,
                take_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Turns the exponentials stored by ``row_stats(row_ref=...)`` into E' in place and returns
    (r, c) [rows] fp32 such that the chunk's grad logits are diag(r) E' + diag(c) T (see
    ``_kernels``); ``take_out`` [rows] int8 (None: none) flags the rows whose target entry
    leaves the products (``_kernels._factor_rows``)."""
    n_rows, vocab_size = buffer.shape
    assert buffer.stride() == (vocab_size, 1), "the kernel reads a contiguous buffer"
    row_factor = torch.empty(n_rows, device=buffer.device, dtype=torch.float32)
    target_grad = torch.empty_like(row_factor)
    block_r = 16  # more rows a program take more registers than 4 warps have (compile_sm90.py)
    K._row_factors_kernel[(triton.cdiv(n_rows, block_r),)](
        buffer, state.tile_max, row_max, row_ref, lse, loss_grad, targets, _take_out(take_out, n_rows, buffer.device),
        row_factor, target_grad,
        n_rows, vocab_size, float(opts.logit_scale),
        BLOCK_R=block_r, BLOCK_V=state.block_v, num_warps=4,
    )
    return row_factor, target_grad


def grad_logits(hidden, weight, bias, targets, lse, loss_grad, lse_grad, opts: LossOptions, out, bias_grad_acc,
                class_weight=None, smooth_grad=None, entropy_grad=None):
    """Recomputes a chunk's logits and stores its grad logits [rows, V] to ``out`` (lse known);
    adds their column sums to ``bias_grad_acc`` [V] fp32 unless it is None. Returns ``out``.
    With label smoothing, ``class_weight`` [V] and ``smooth_grad`` [rows] give the smoothing
    term its class weights (see ``_chunked.kernel_row_grads``); ``entropy_grad`` [rows] is
    d out / d entropy_i, whose -e_i H_i part the caller has put in ``lse_grad``."""
    assert lse.dtype == accumulation_dtype(hidden.dtype), "the kernel computes in lse's dtype"
    pointers = (bias, targets, out, lse, loss_grad, lse_grad, entropy_grad, class_weight, smooth_grad)
    scalars = (*_scale_and_cap(opts), *_smoothing_and_z_loss(opts), opts.inv_vocab_size(weight.shape[0]))
    _launch_tiles(K._tile_grad_kernel, hidden, weight, out, pointers, scalars, tile_width(hidden.dtype))
    if bias_grad_acc is not None:
        bias_grad_acc += torch.sum(out, dim=0, dtype=bias_grad_acc.dtype)
    return out


def scale_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x *= scale in place (scale: a one-element fp32 tensor); no traffic when scale == 1."""
    if x.numel() == 0:
        return
    block = 4096
    numel = x.numel()
    programs = min(triton.cdiv(numel, block), 1024)
    K._scale_kernel[(programs,)](x, scale, numel, BLOCK=block)
