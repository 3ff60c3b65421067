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

from . import _plan, _precompile, _target_kernels
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
    """The logit kernel's candidate configurations for one tile width (``_plan.logit_tile_candidates``)."""
    return [_config(*candidate) for candidate in _plan.logit_tile_candidates(block_v, element_size)]


_autotuned: dict[tuple, triton.runtime.Autotuner] = {}
_chosen: dict[tuple, triton.Config] = {}  # the autotuner's pick per launch key (see _launch_tiles)

_capabilities: dict[torch.device, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    if device not in _capabilities:
        _capabilities[device] = torch.cuda.get_device_capability(device)
    return _capabilities[device]


def _tile_kernel(kernel, block_v: int, element_size: int, device: torch.device, key: tuple):
    """(kernel, fixed meta-parameters) to launch ``kernel`` (``K._tile_stats_kernel`` or
    ``K._tile_grad_kernel``) with: the plan's fixed configuration (``_plan.logit_tile_choice``),
    else the autotuner (one per launch ``key``: the variants' pointers that are None differ in
    their best configuration) with no fixed ones."""
    choice = _plan.logit_tile_choice(block_v, element_size, interpreting(), lambda: _capability(device))
    if choice.fixed is not None:
        return kernel, choice.fixed
    configs = logit_tile_configs(block_v, element_size)
    if choice.first_only:
        configs = configs[:1]
    key = (*key, len(configs))
    if key not in _autotuned:
        _autotuned[key] = triton.autotune(configs, key=["hidden_size", "vocab_size"])(kernel)
    return _autotuned[key], {}


def tile_width(dtype: torch.dtype) -> int:
    """Vocabulary columns per logit tile (BLOCK_V): the plan's (``_plan.tile_width``)."""
    return _plan.tile_width(dtype, interpreting())


def hardware(device: torch.device) -> _plan.Hardware:
    """This device's facts for the plan: the interpreter, a persistent round's programs, the Gluon
    statistics kernel's tile where it runs here (Hopper, with a Triton whose Gluon it suits)."""
    if interpreting() or device.type != "cuda":
        return _plan.Hardware("triton", interpreting=interpreting(), programs=4 if interpreting() else 0)
    gluon = _gluon_stats_module()
    tile = (gluon.BLOCK_N, gluon.BLOCK_V.value) if gluon is not None and gluon.device_applies(device) else None
    return _plan.Hardware("triton", programs=_max_programs(device), gluon_tile=tile, capability=_capability(device))


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the copy engine (TMA) can move these 2-D tensors: Hopper or newer, rows
    contiguous and 16-byte aligned."""
    if not _plan.uses_tma(tensors[0].element_size()):  # (float64: plain loads)
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


# ---- launches ---------------------------------------------------------------------------
def _group_rows(hidden: torch.Tensor) -> int:
    """Rows of a tile group of the logit kernel: the plan's (``_plan.group_rows``)."""
    return _plan.group_rows(hidden.shape[1], hidden.element_size())


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
    if (plain_stats or factored) and _plan.gluon_sweep(hidden.dtype, opts, bias is not None, return_metrics,
                                                       hardware(device), factored=factored):
        gluon = _gluon_stats_module()
    buffer = shifted_out if factored else None  # the statistics alone store none
    if gluon is not None and gluon.applies(hidden, weight, buffer) and _gluon_tile_stats(
            gluon, hidden, weight, tile_stats[0], tile_stats[1], device, row_ref, loss_grad, buffer):
        return tile_stats, target_logit, block_v, num_tiles
    pointers = (bias, targets, *tile_stats, target_logit if pick_target else None, shifted_out, row_ref,
                loss_grad if factored else None, class_weight if tile_stats[4] is not None else None)
    _launch_tiles(K._tile_stats_kernel, hidden, weight, shifted_out, pointers, scale_and_cap(opts), block_v)
    return tile_stats, target_logit, block_v, num_tiles


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


def _target_logit_by_product(hidden: torch.Tensor) -> bool:
    """Whether the sweeps leave each row's target logit to a product (``_plan.target_logit_by_product``)."""
    return _plan.target_logit_by_product(hidden.dtype, _plan.Hardware("triton"))


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


