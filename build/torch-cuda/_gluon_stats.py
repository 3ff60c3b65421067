"""The logit sweeps' tile statistics on Hopper in Gluon, Triton's lower-level dialect (docs/design.md,
"Hopper: the copy engine and the Gluon kernel").

The logit kernel (``_tile_kernels._tile_stats_kernel``) computes 128 x 256 tiles with two warpgroups.
This kernel computes 192 x 256 tiles with three: each warpgroup takes 64 rows (a 64 x 256 fp32
accumulator, wgmma m64n256k16), and all three read one shared-memory ring that holds, for each
K step, three 64-row blocks of hidden and one 256-row block of weight. A tile then reads
(192 + 256) / (192 x 256) operand elements a product, 22% fewer than 128 x 256, and a forward of
Llama-2's head (V = 32000) takes fewer, fuller rounds of tiles.

Two sweeps take this path, of plain logits only (no bias, logit scale, softcap or smoothing's
logit sum, no metrics; z-loss and class weights enter the loss only): the forward's statistics
(the logit kernel's statistics without the target pick) and (with ``gluon_training``) the
factored training sweep (its buffer of exponentials: the sums relative to each row's reference, and the exponentials
stored to the chunk buffer by the copy engine, half a tile at a time through 48 KB of shared
memory beside the ring). Everything else, and every GPU without Hopper's wgmma or a Triton
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

from ._kernel_math import LOG2E, REFERENCE_GAP

ROWS_PER_GROUP = gl.constexpr(64)  # a warpgroup's rows of a tile
GROUPS = gl.constexpr(3)  # warpgroups a tile
BLOCK_V = gl.constexpr(256)
BLOCK_K = gl.constexpr(64)
STAGES = gl.constexpr(3)  # 3 x 56 KB of shared memory
BLOCK_N = ROWS_PER_GROUP.value * GROUPS.value  # rows a tile: 192
HALF_V = gl.constexpr(128)  # columns of a stored half tile
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
    """Each of warpgroup ``which``'s 64 rows: the tile's max and sum of exp(z - m), m the tile max;
    in the training sweep (the logit kernel's factored sweep, ``_stores_exp``), m is the row's reference
    unless the tile max passes it by more than REFERENCE_GAP (``_kernel_math._exp_reference``), and
    exp(z - m) goes to the chunk buffer (0 on rows without gradient). ``out``: what the epilogue
    writes and reads, (tile_max, tile_sum[, row_ref, loss_grad, the buffer's descriptor, the
    staging tiles])."""
    STORE_EXP: gl.constexpr = _stores_exp(out)
    tile_max_ptr = out[0]
    tile_sum_ptr = out[1]
    if not EVEN_V:  # columns past the vocabulary (zeros from the copy engine) take no part
        col_layout: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
        cols = pid_v * BLOCK_V + gl.arange(0, BLOCK_V, layout=col_layout)
        acc = gl.where((cols < vocab_size)[None, :], acc, float("-inf"))
    row_layout: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    first_row = (pid_n * GROUPS + which) * ROWS_PER_GROUP
    rows = first_row + gl.arange(0, ROWS_PER_GROUP, layout=row_layout)
    row_mask = rows < n_rows
    tile_max = gl.max(acc, axis=1)
    reference = tile_max
    if STORE_EXP:
        row_ref = gl.load(out[2] + rows, mask=row_mask, other=0.0)
        reference = gl.where(tile_max > row_ref + REFERENCE_GAP, tile_max, row_ref)
    exp_shifted = gl.exp2((acc - reference[:, None]) * LOG2E)  # as the logit kernel (``_kernel_math.LOG2E``)
    sum_exp = gl.sum(exp_shifted, axis=1)
    stat = rows.to(gl.int64) * num_col_tiles + pid_v
    gl.store(tile_max_ptr + stat, tile_max, mask=row_mask)
    gl.store(tile_sum_ptr + stat, sum_exp, mask=row_mask)
    if STORE_EXP:
        loss_grad = gl.load(out[3] + rows, mask=row_mask, other=1.0)
        no_grad = loss_grad == 0.0
        # Zeros on the rows without gradient, only where this warpgroup has such a row (few do: a
        # step's ignored rows come last in its order, where only a chunk planned before their
        # count is known reaches them). Unconditional, the select is moved past the 16-bit
        # conversion by the compiler, which then unpacks each pair of values to select them one
        # by one: about two instructions an element.
        if gl.max(no_grad.to(gl.int32), axis=0) > 0:
            exp_shifted = gl.where(no_grad[:, None], 0.0, exp_shifted)
        buffer_desc = out[4]
        _store_halves(exp_shifted.to(buffer_desc.dtype), buffer_desc, out[5].index(which), first_row,
                      pid_v * BLOCK_V)


@gluon.constexpr_function
def _stores_exp(out):
    """Whether the partitions' ``out`` is the training sweep's (warp_specialize hands flags over
    as values, so the mode goes as the tuple's length, which stays known at compile time)."""
    return len(out) > 2


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
    if _stores_exp(out):
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
    if _stores_exp(out):
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
def tile_stats_kernel(h_desc, w_desc, tile_max_ptr, tile_sum_ptr, row_ref_ptr, loss_grad_ptr, buffer_desc, n_rows,
                      vocab_size, hidden_size, group_blocks, EVEN_V: gl.constexpr, STORE_EXP: gl.constexpr):
    """Tile statistics [n_rows, ceil(V / 256)] fp32 of z = hidden [n_rows, H] @ weight [V, H].T:
    each (row, 256-column tile)'s max and sum of exp(z - m), persistent over 192 x 256 tiles
    taken in groups of ``group_blocks`` row blocks (the logit kernel's order). m is the tile max;
    with STORE_EXP, as in the logit kernel's factored sweep, the reference of row_ref [n_rows] (fp32),
    and exp(z - m) stored through ``buffer_desc`` (a [n_rows, V] buffer of the inputs' dtype, in
    64 x 128 blocks), zero on the rows whose loss_grad [n_rows] (fp32) is 0. Without STORE_EXP
    row_ref, loss_grad and the buffer are not read."""
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
    # Only what the epilogue reads goes to the partitions (unused captures fail Triton 3.6's lowering).
    if STORE_EXP:
        staging = gl.allocate_shared_memory(buffer_desc.dtype, [GROUPS, ROWS_PER_GROUP, HALF_V], buffer_desc.layout)
        out = (tile_max_ptr, tile_sum_ptr, row_ref_ptr, loss_grad_ptr, buffer_desc, staging)
    else:
        out = (tile_max_ptr, tile_sum_ptr)
    args = (a_bufs, b_bufs, ready, empty, out, n_rows, vocab_size, num_row_blocks, num_col_tiles, k_steps,
            group_blocks, EVEN_V)
    gl.warp_specialize([(_loading_group, (h_desc, w_desc) + args), (_group_1, args), (_group_2, args)],
                       [4, 4], [168, 168])


_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


_capabilities: dict[torch.device, tuple[int, int]] = {}


def device_applies(device: torch.device) -> bool:
    """Whether this kernel runs on ``device``: Hopper (sm_90); whether a call takes it is the
    plan's (``_plan.gluon_sweep``)."""
    if device.type != "cuda":
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
               loss_grad: torch.Tensor | None = None, buffer: torch.Tensor | None = None) -> None:
    """Writes each (row, 256-column tile)'s max and sum of exp(z - max) of z = hidden [n_rows, H]
    @ weight [V, H].T to ``tile_max`` and ``tile_sum_exp`` [n_rows, ceil(V / 256)] (fp32,
    contiguous); tiles are swept in groups of about ``group_rows`` rows, on at most ``programs``
    persistent programs. With ``buffer`` [n_rows, V] (the inputs' dtype, rows the copy engine can
    move), ``row_ref`` and ``loss_grad`` [n_rows] fp32, the logit kernel's factored sweep instead: the sums
    are relative to each row's reference and exp(z - reference) goes to ``buffer``."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    if n_rows == 0 or vocab_size == 0:
        return
    dtype = _DTYPES[hidden.dtype]
    block_h, block_w = [ROWS_PER_GROUP.value, BLOCK_K.value], [BLOCK_V.value, BLOCK_K.value]
    h_desc = TensorDescriptor.from_tensor(hidden, block_h, gl.NVMMASharedLayout.get_default_for(block_h, dtype))
    w_desc = TensorDescriptor.from_tensor(weight, block_w, gl.NVMMASharedLayout.get_default_for(block_w, dtype))
    store_exp = buffer is not None
    if store_exp:
        assert row_ref is not None and loss_grad is not None and _movable(buffer) and buffer.dtype == hidden.dtype
        block_out = [ROWS_PER_GROUP.value, HALF_V.value]
        buffer_desc = TensorDescriptor.from_tensor(buffer, block_out,
                                                   gl.NVMMASharedLayout.get_default_for(block_out, dtype))
    else:
        row_ref = loss_grad = tile_max  # not read
        buffer_desc = h_desc
    num_tiles = triton.cdiv(n_rows, BLOCK_N) * triton.cdiv(vocab_size, BLOCK_V.value)
    tile_stats_kernel[(min(num_tiles, programs),)](
        h_desc, w_desc, tile_max, tile_sum_exp, row_ref, loss_grad, buffer_desc, n_rows, vocab_size, hidden_size,
        max(1, group_rows // BLOCK_N), EVEN_V=vocab_size % BLOCK_V.value == 0, STORE_EXP=store_exp, num_warps=4)
