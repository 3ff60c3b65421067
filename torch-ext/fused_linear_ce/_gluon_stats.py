"""The logit sweeps' tile statistics on Hopper in Gluon, Triton's lower-level dialect (docs/design.md, 59).

The logit kernel (``_kernels._tile_stats_kernel``) computes 128 x 256 tiles with two warpgroups.
This kernel computes 192 x 256 tiles with three: each warpgroup takes 64 rows (a 64 x 256 fp32
accumulator, wgmma m64n256k16), and all three read one shared-memory ring that holds, for each
K step, three 64-row blocks of hidden and one 256-row block of weight. A tile then reads
(192 + 256) / (192 x 256) operand elements a product, 22% fewer than 128 x 256, and a forward of
Llama-2's head (V = 32000) takes fewer, fuller rounds of tiles. On the H200 it ran the
statistics 1-3% faster a flop than the logit kernel.

Three sweeps take this path, of plain logits only (no bias, logit scale, softcap or smoothing's
logit sum; z-loss and class weights enter the loss only), each with or without the metrics (each
tile's entropy term and first argmax, as the logit kernel computes them): the forward's
statistics (the logit kernel's statistics without the target pick), the same relative to each
row's reference (a forward that must match a training step's sums, ``match_training``), and
(with ``gluon_training``) the factored training sweep (the sums relative to each row's
reference, and the exponentials stored to the chunk buffer by the copy engine, half a tile at a
time through 48 KB of shared memory beside the ring). Everything else, and every GPU without Hopper's wgmma or a Triton
without this Gluon API (it is experimental and moves: written for Triton 3.6), uses the logit
kernel. The interpreter runs no Gluon: the GPU tests check this path against float64 and the
logit kernel, and the CPU tests compile it for sm_90 (``scripts/compile_sm90.py --gluon``).

Why warpgroup 0 also loads: a producer warp would make 13 warps, launched as 16 at 128 registers
each, and ptxas holds every partition to that, too few for the accumulator; 12 warps get 168.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._kernels import LOG2E, NAN_INDEX, NO_INDEX, REFERENCE_GAP
from ._settings import current as settings

ROWS_PER_GROUP = gl.constexpr(64)  # a warpgroup's rows of a tile
GROUPS = gl.constexpr(3)  # warpgroups a tile
BLOCK_V = gl.constexpr(256)
BLOCK_K = gl.constexpr(64)
STAGES = gl.constexpr(3)  # 3 x 56 KB of shared memory
BLOCK_N = ROWS_PER_GROUP.value * GROUPS.value  # rows a tile: 192
HALF_V = gl.constexpr(128)  # columns of a stored half tile
# A sweep's mode (``_mode``): the bits of what it computes besides each tile's max and sum.
METRICS = gl.constexpr(1)  # each tile's entropy term and first argmax
REFERENCED = gl.constexpr(2)  # sums relative to each row's reference, not to the tile max
STORE = gl.constexpr(4)  # the training sweep's exponentials stored to the chunk buffer
# The copy engine's load and store: ``async_load`` / ``async_store`` from Triton 3.7 on (which
# removes the older names).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _tile_coords(tile_id, num_row_blocks, num_col_tiles, group_blocks):
    """The logit kernel's order: row blocks of a group fastest, then columns, then groups."""
    group = tile_id // (group_blocks * num_col_tiles)
    first_block = group * group_blocks
    blocks_in_group = gl.minimum(num_row_blocks - first_block, group_blocks)
    in_group = tile_id - first_block * num_col_tiles
    return first_block + in_group % blocks_in_group, in_group // blocks_in_group


@gluon.jit
def _load_step(h_desc, w_desc, a_bufs, b_bufs, ready, empty, step, pid_n, pid_v, k):
    """Step ``step`` of this program (K step k of tile (pid_n, pid_v)) into stage step % STAGES,
    once all three warpgroups have released that stage's last use."""
    slot = step % STAGES
    mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), (GROUPS * ROWS_PER_GROUP + BLOCK_V) * BLOCK_K * 2)  # 16-bit inputs
    for i in gl.static_range(GROUPS):
        _tma_load(h_desc, [(pid_n * GROUPS + i) * ROWS_PER_GROUP, k * BLOCK_K], ready.index(slot),
                  a_bufs.index(slot * GROUPS + i))
    _tma_load(w_desc, [pid_v * BLOCK_V, k * BLOCK_K], ready.index(slot), b_bufs.index(slot))


@gluon.jit
def _next_step(load_tile, load_n, load_v, load_k, k_steps, programs, num_row_blocks, num_col_tiles, group_blocks):
    """The step after K step load_k of tile load_tile (at (load_n, load_v)): its (tile, the
    tile's coordinates, K step), with a division only when the tile changes."""
    load_k += 1
    if load_k == k_steps:
        load_k = 0
        load_tile += programs
        load_n, load_v = _tile_coords(load_tile, num_row_blocks, num_col_tiles, group_blocks)
    return load_tile, load_n, load_v, load_k


@gluon.jit
def _load_and_advance(h_desc, w_desc, a_bufs, b_bufs, ready, empty, step, load_tile, load_n, load_v, load_k,
                      k_steps, programs, num_row_blocks, num_col_tiles, group_blocks):
    """Loads step ``step`` (K step load_k of tile load_tile, at (load_n, load_v)); returns the
    next step's (tile, its coordinates, K step)."""
    _load_step(h_desc, w_desc, a_bufs, b_bufs, ready, empty, step, load_n, load_v, load_k)
    return _next_step(load_tile, load_n, load_v, load_k, k_steps, programs, num_row_blocks, num_col_tiles,
                      group_blocks)


@gluon.jit
def _tile_products(a_bufs, b_bufs, ready, empty, step, k_steps, which: gl.constexpr):
    """Warpgroup ``which``'s 64 x 256 block of one tile, from this program's step ``step`` on;
    each stage goes back once its product is done."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_V, 16])
    acc = gl.zeros([ROWS_PER_GROUP, BLOCK_V], gl.float32, acc_layout)
    for k in range(k_steps):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(slot * GROUPS + which), b_bufs.index(slot).permute((1, 0)), acc,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)  # the previous step's
        step += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
    return acc


@gluon.jit
def _tile_epilogue(acc, out, n_rows, vocab_size, num_col_tiles, pid_n, pid_v, which: gl.constexpr,
                   EVEN_V: gl.constexpr):
    """Each of warpgroup ``which``'s 64 rows: the tile's max m and sum of exp(z - R), R = m, or
    with a reference (``MODE``, ``_mode``) the row's reference unless m passes it by more than
    REFERENCE_GAP (``_kernels._exp_reference``); with the metrics, the entropy term
    sum exp(z - R) (R - z) and the first column of the max, a NaN counting as +inf (the logit
    kernel's rules, ``_kernels._tile_stats_kernel``); in the training sweep, exp(z - R) goes to
    the chunk buffer (0 on rows without gradient). ``out``: what the epilogue writes and reads,
    (tile_max, tile_sum[, tile_entropy, tile_argmax][, row_ref][, loss_grad, the buffer's
    descriptor, the staging tiles])."""
    MODE: gl.constexpr = _mode_of(out)
    HAS_METRICS: gl.constexpr = _has(MODE, METRICS)
    HAS_REFERENCE: gl.constexpr = _has(MODE, REFERENCED)
    STORE_EXP: gl.constexpr = _has(MODE, STORE)
    REF_AT: gl.constexpr = 4 if HAS_METRICS else 2  # where row_ref is in ``out``, then the store's operands
    col_layout: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
    cols = pid_v * BLOCK_V + gl.arange(0, BLOCK_V, layout=col_layout)
    if not EVEN_V:  # columns past the vocabulary (zeros from the copy engine) take no part
        acc = gl.where((cols < vocab_size)[None, :], acc, float("-inf"))
    row_layout: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    first_row = (pid_n * GROUPS + which) * ROWS_PER_GROUP
    rows = first_row + gl.arange(0, ROWS_PER_GROUP, layout=row_layout)
    row_mask = rows < n_rows
    tile_max = gl.max(acc, axis=1)  # (a NaN left out: see below)
    if HAS_METRICS:  # the first column of the max, a NaN counting as +inf (the logit kernel's rule)
        argmax = gl.min(gl.where(acc == tile_max[:, None], cols[None, :], NO_INDEX), axis=1)
        if not STORE_EXP:  # (the training sweep keeps its exponentials for the store: it looks there)
            has_nan = gl.max((acc != acc).to(gl.int32), axis=1) > 0
            if gl.max(has_nan.to(gl.int32), axis=0) > 0:  # rare: only where a row here has a NaN
                first_nan = gl.min(gl.where((acc != acc) | (acc == float("inf")), cols[None, :], NO_INDEX), axis=1)
                argmax = gl.where(has_nan, first_nan, argmax)
                tile_max = gl.where(has_nan, float("inf"), tile_max)
    reference = tile_max
    if HAS_REFERENCE:
        row_ref = gl.load(out[REF_AT] + rows, mask=row_mask, other=0.0)
        reference = gl.where(tile_max > row_ref + REFERENCE_GAP, tile_max, row_ref)
    shifted = acc - reference[:, None]
    exp_shifted = gl.exp2(shifted * LOG2E)  # as the logit kernel (``_kernels.LOG2E``)
    if HAS_METRICS:  # both sums in one pass over the tile (two would keep it and its exponentials live)
        if EVEN_V:  # no -inf logit: no 0 * inf to take out
            entropy_terms = -(exp_shifted * shifted)
        else:
            entropy_terms = gl.where(exp_shifted > 0.0, -exp_shifted * shifted, 0.0)
        sum_exp, entropy_term = gl.reduce((exp_shifted, entropy_terms), 1, _add_pairs)
        if STORE_EXP:  # a NaN (or +inf, whose z - m is NaN) makes its row's sum and exponential NaN
            has_nan = sum_exp != sum_exp
            if gl.max(has_nan.to(gl.int32), axis=0) > 0:  # rare: only where a row here has one
                first_nan = gl.min(gl.where(exp_shifted != exp_shifted, cols[None, :], NO_INDEX), axis=1)
                argmax = gl.where(has_nan, first_nan, argmax)
                tile_max = gl.where(has_nan, float("inf"), tile_max)
    else:
        sum_exp = gl.sum(exp_shifted, axis=1)
    stat = rows.to(gl.int64) * num_col_tiles + pid_v
    gl.store(out[0] + stat, tile_max, mask=row_mask)
    gl.store(out[1] + stat, sum_exp, mask=row_mask)
    if HAS_METRICS:
        gl.store(out[2] + stat, entropy_term, mask=row_mask)
        # NO_INDEX where the tile is all -inf (past V); NAN_INDEX marks a row whose sum is NaN
        argmax = gl.where(tile_max == float("-inf"), NO_INDEX,
                          gl.where(sum_exp != sum_exp, argmax | NAN_INDEX, argmax))
        gl.store(out[3] + stat, argmax, mask=row_mask)
    if STORE_EXP:
        loss_grad = gl.load(out[REF_AT + 1] + rows, mask=row_mask, other=1.0)
        no_grad = loss_grad == 0.0
        # Zeros on the rows without gradient, only where this warpgroup has such a row (few do: a
        # step's ignored rows come last in its order, where only a chunk planned before their
        # count is known reaches them). Unconditional, the select is moved past the 16-bit
        # conversion by the compiler, which then unpacks each pair of values to select them one
        # by one: about two instructions an element.
        if gl.max(no_grad.to(gl.int32), axis=0) > 0:
            exp_shifted = gl.where(no_grad[:, None], 0.0, exp_shifted)
        buffer_desc = out[REF_AT + 2]
        _store_halves(exp_shifted.to(buffer_desc.dtype), buffer_desc, out[REF_AT + 3].index(which), first_row,
                      pid_v * BLOCK_V)


@gluon.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@gluon.constexpr_function
def _mode_of(out):
    """A partition's mode from its ``out`` (warp_specialize hands constexprs over as values, so the
    mode goes as the tuple's length, which stays known at compile time): 2 pointers for the max
    and sum, 2 more for the metrics, 1 for the reference, 3 for the store."""
    return {2: 0, 3: REFERENCED.value, 4: METRICS.value, 5: METRICS.value + REFERENCED.value,
            6: REFERENCED.value + STORE.value, 8: METRICS.value + REFERENCED.value + STORE.value}[len(out)]


@gluon.constexpr_function
def _has(mode, bit):
    """Whether a sweep's ``mode`` (``_mode``) has ``bit``: METRICS, REFERENCED or STORE."""
    return (int(mode) & int(bit)) != 0


@gluon.jit
def _store_halves(tile, buffer_desc, staging, row, col):
    """Stores ``tile`` [64, 256] to the buffer at (row, col) by the copy engine, clipped at its
    edges, through ``staging`` [64, 128] in shared memory a half at a time: a whole tile's staging
    (three warpgroups' 96 KB) beside the 168 KB ring would pass an SM's 227 KB. The second half's
    copy is still running when this returns (under the next tile's products)."""
    low, high = gl.split(gl.permute(gl.reshape(tile, [ROWS_PER_GROUP, 2, HALF_V]), (0, 2, 1)))
    tma.store_wait(0)  # the previous tile's second half has left the staging tile
    staging.store(low)
    fence_async_shared()
    _tma_store(buffer_desc, [row, col], staging)
    tma.store_wait(0)
    staging.store(high)
    fence_async_shared()
    _tma_store(buffer_desc, [row, col + HALF_V], staging)


@gluon.jit
def _loading_group(h_desc, w_desc, a_bufs, b_bufs, ready, empty, out, n_rows, vocab_size, num_row_blocks,
                   num_col_tiles, k_steps, group_blocks, EVEN_V: gl.constexpr):
    """Warpgroup 0 (the default partition): its rows of every tile of this program, and every
    stage's loads, STAGES - 1 steps ahead of its products."""
    programs = gl.num_programs(0)
    num_tiles = num_row_blocks * num_col_tiles
    total_steps = gl.cdiv(num_tiles - gl.program_id(0), programs) * k_steps
    # the step to load next: its tile, the tile's coordinates and its K step
    load_tile = gl.program_id(0)
    load_n, load_v = _tile_coords(load_tile, num_row_blocks, num_col_tiles, group_blocks)
    load_k = 0
    for g in gl.static_range(STAGES - 1):
        if g < total_steps:
            load_tile, load_n, load_v, load_k = _load_and_advance(
                h_desc, w_desc, a_bufs, b_bufs, ready, empty, g, load_tile, load_n, load_v, load_k, k_steps,
                programs, num_row_blocks, num_col_tiles, group_blocks)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_V, 16])
    step = 0
    for tile_id in range(gl.program_id(0), num_tiles, programs):
        pid_n, pid_v = _tile_coords(tile_id, num_row_blocks, num_col_tiles, group_blocks)
        acc = gl.zeros([ROWS_PER_GROUP, BLOCK_V], gl.float32, acc_layout)
        for k in range(k_steps):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot * GROUPS), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # The previous step's product is done: release its stage, then load the step
            # STAGES - 1 ahead into it (once the other two warpgroups have released it too).
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
            if step + STAGES - 1 < total_steps:
                load_tile, load_n, load_v, load_k = _load_and_advance(
                    h_desc, w_desc, a_bufs, b_bufs, ready, empty, step + STAGES - 1, load_tile, load_n, load_v,
                    load_k, k_steps, programs, num_row_blocks, num_col_tiles, group_blocks)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        _tile_epilogue(acc, out, n_rows, vocab_size, num_col_tiles, pid_n, pid_v, 0, EVEN_V)
    if _has(_mode_of(out), STORE):
        tma.store_wait(0)  # the last half tile has left shared memory


@gluon.jit
def _group(a_bufs, b_bufs, ready, empty, out, n_rows, vocab_size, num_row_blocks, num_col_tiles, k_steps,
           group_blocks, which: gl.constexpr, EVEN_V: gl.constexpr):
    """Warpgroup ``which`` (1 or 2, a worker partition): its rows of every tile of this program."""
    step = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_tiles, gl.num_programs(0)):
        pid_n, pid_v = _tile_coords(tile_id, num_row_blocks, num_col_tiles, group_blocks)
        acc = _tile_products(a_bufs, b_bufs, ready, empty, step, k_steps, which)
        step += k_steps
        _tile_epilogue(acc, out, n_rows, vocab_size, num_col_tiles, pid_n, pid_v, which, EVEN_V)
    if _has(_mode_of(out), STORE):
        tma.store_wait(0)


@gluon.jit
def _group_1(a_bufs, b_bufs, ready, empty, out, n_rows, vocab_size, num_row_blocks, num_col_tiles, k_steps,
             group_blocks, EVEN_V: gl.constexpr):
    _group(a_bufs, b_bufs, ready, empty, out, n_rows, vocab_size, num_row_blocks, num_col_tiles, k_steps,
           group_blocks, 1, EVEN_V)


@gluon.jit
def _group_2(a_bufs, b_bufs, ready, empty, out, n_rows, vocab_size, num_row_blocks, num_col_tiles, k_steps,
             group_blocks, EVEN_V: gl.constexpr):
    _group(a_bufs, b_bufs, ready, empty, out, n_rows, vocab_size, num_row_blocks, num_col_tiles, k_steps,
           group_blocks, 2, EVEN_V)


# n_rows unspecialised: a step's chunks differ in it (and in its divisibility by 16), and each
# specialisation would be compiled anew.
@gluon.jit(do_not_specialize=["n_rows"])
def tile_stats_kernel(h_desc, w_desc, tile_max_ptr, tile_sum_ptr, tile_entropy_ptr, tile_argmax_ptr, row_ref_ptr,
                      loss_grad_ptr, buffer_desc, n_rows, vocab_size, hidden_size, group_blocks, EVEN_V: gl.constexpr):
    """Tile statistics [n_rows, ceil(V / 256)] of z = hidden [n_rows, H] @ weight [V, H].T: each
    (row, 256-column tile)'s max (fp32) and sum of exp(z - R) (fp32), and with ``tile_entropy`` and
    ``tile_argmax`` (or None) its entropy term (fp32) and first argmax (int32), persistent over
    192 x 256 tiles taken in groups of ``group_blocks`` row blocks (the logit kernel's order). R is
    the tile max, or with ``row_ref`` [n_rows] (fp32; or None) each row's reference; with
    ``buffer_desc`` (a [n_rows, V] buffer of the inputs' dtype, in 64 x 128 blocks; or None, and
    then ``loss_grad`` too) the factored training sweep: exp(z - R) stored there, zero on the rows
    whose loss_grad [n_rows] (fp32) is 0."""
    MODE: gl.constexpr = _mode(tile_entropy_ptr, row_ref_ptr, buffer_desc)
    a_bufs = gl.allocate_shared_memory(h_desc.dtype, [STAGES * GROUPS, ROWS_PER_GROUP, BLOCK_K], h_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_V, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=GROUPS)
    num_row_blocks = gl.cdiv(n_rows, GROUPS * ROWS_PER_GROUP)
    num_col_tiles = gl.cdiv(vocab_size, BLOCK_V)
    k_steps = gl.cdiv(hidden_size, BLOCK_K)
    # Only what the epilogue reads goes to the partitions (unused captures fail Triton 3.6's
    # lowering), in ``_tile_epilogue``'s order; the mode goes as the tuple's length (``_mode_of``).
    out = (tile_max_ptr, tile_sum_ptr)
    if _has(MODE, METRICS):
        out = out + (tile_entropy_ptr, tile_argmax_ptr)
    if _has(MODE, REFERENCED):
        out = out + (row_ref_ptr, )
    if _has(MODE, STORE):
        staging = gl.allocate_shared_memory(buffer_desc.dtype, [GROUPS, ROWS_PER_GROUP, HALF_V], buffer_desc.layout)
        out = out + (loss_grad_ptr, buffer_desc, staging)
    args = (a_bufs, b_bufs, ready, empty, out, n_rows, vocab_size, num_row_blocks, num_col_tiles, k_steps,
            group_blocks, EVEN_V)
    gl.warp_specialize([(_loading_group, (h_desc, w_desc) + args), (_group_1, args), (_group_2, args)],
                       [4, 4], [168, 168])


@gluon.constexpr_function
def _mode(tile_entropy, row_ref, buffer_desc):
    """The sweep's mode from which of its arguments are None: the bits METRICS, REFERENCED and
    STORE (the training sweep, which is referenced)."""
    return ((METRICS.value if tile_entropy is not None else 0) + (REFERENCED.value if row_ref is not None else 0)
            + (STORE.value if buffer_desc is not None else 0))


_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


_capabilities: dict[torch.device, tuple[int, int]] = {}


def device_applies(device: torch.device) -> bool:
    """Whether this kernel runs on ``device``: Hopper (sm_90), with ``gluon`` (``_settings``)."""
    if not settings().gluon or device.type != "cuda":
        return False
    if device not in _capabilities:  # asked a few times a forward: kept, as the SM counts are
        _capabilities[device] = torch.cuda.get_device_capability(device)
    return _capabilities[device] == (9, 0)


def applies(hidden: torch.Tensor, weight: torch.Tensor, buffer: torch.Tensor | None = None) -> bool:
    """Whether this kernel can compute the statistics of ``hidden`` against ``weight`` (and store
    the training sweep's exponentials to ``buffer``): on a device it runs on, 16-bit inputs of one
    dtype, rows the copy engine can move, K steps of 64."""
    if not device_applies(hidden.device):
        return False
    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype or hidden.shape[1] % BLOCK_K.value:
        return False
    if buffer is not None and (buffer.dtype != hidden.dtype or not _movable(buffer)):
        return False
    return _movable(hidden) and _movable(weight)


def _movable(t: torch.Tensor) -> bool:
    """Whether the copy engine can move the rows of the 2-D ``t``: contiguous, 16-byte aligned."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tile_stats(hidden: torch.Tensor, weight: torch.Tensor, tile_max: torch.Tensor, tile_sum_exp: torch.Tensor,
               group_rows: int, programs: int, row_ref: torch.Tensor | None = None,
               loss_grad: torch.Tensor | None = None, buffer: torch.Tensor | None = None,
               tile_entropy: torch.Tensor | None = None, tile_argmax: torch.Tensor | None = None) -> None:
    """Writes each (row, 256-column tile)'s max and sum of exp(z - R) of z = hidden [n_rows, H]
    @ weight [V, H].T to ``tile_max`` and ``tile_sum_exp`` [n_rows, ceil(V / 256)] (fp32,
    contiguous), R the tile max, or each row's reference with ``row_ref`` [n_rows] fp32; with
    ``tile_entropy`` (fp32) and ``tile_argmax`` (int32) of the same shape, the metrics' entropy
    term and first argmax. Tiles are swept in groups of about ``group_rows`` rows, on at most
    ``programs`` persistent programs. With ``buffer`` [n_rows, V] (the inputs' dtype, rows the
    copy engine can move), ``row_ref`` and ``loss_grad`` [n_rows] fp32: the logit kernel's
    factored sweep, exp(z - R) stored to ``buffer``."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    if n_rows == 0 or vocab_size == 0:
        return
    dtype = _DTYPES[hidden.dtype]
    block_h, block_w = [ROWS_PER_GROUP.value, BLOCK_K.value], [BLOCK_V.value, BLOCK_K.value]
    h_desc = TensorDescriptor.from_tensor(hidden, block_h, gl.NVMMASharedLayout.get_default_for(block_h, dtype))
    w_desc = TensorDescriptor.from_tensor(weight, block_w, gl.NVMMASharedLayout.get_default_for(block_w, dtype))
    buffer_desc = None
    if buffer is not None:
        assert row_ref is not None and loss_grad is not None and _movable(buffer) and buffer.dtype == hidden.dtype
        block_out = [ROWS_PER_GROUP.value, HALF_V.value]
        buffer_desc = TensorDescriptor.from_tensor(buffer, block_out,
                                                   gl.NVMMASharedLayout.get_default_for(block_out, dtype))
    assert (tile_entropy is None) == (tile_argmax is None)
    num_tiles = triton.cdiv(n_rows, BLOCK_N) * triton.cdiv(vocab_size, BLOCK_V.value)
    tile_stats_kernel[(min(num_tiles, programs),)](
        h_desc, w_desc, tile_max, tile_sum_exp, tile_entropy, tile_argmax, row_ref,
        loss_grad if buffer is not None else None, buffer_desc, n_rows, vocab_size, hidden_size,
        max(1, group_rows // BLOCK_N), EVEN_V=vocab_size % BLOCK_V.value == 0, num_warps=4)
