"""The forward's tile statistics on Hopper in Gluon, Triton's lower-level dialect (perf notes, runs 43-44).

The logit kernel (``_kernels._logit_tile_kernel``) computes 128 x 256 tiles with two warpgroups.
This kernel computes 192 x 256 tiles with three: each warpgroup takes 64 rows (a 64 x 256 fp32
accumulator, wgmma m64n256k16), and all three read one shared-memory ring that holds, for each
K step, three 64-row blocks of hidden and one 256-row block of weight. A tile then reads
(192 + 256) / (192 x 256) operand elements a product, 22% fewer than 128 x 256, and a forward of
Llama-2's head (V = 32000) takes fewer, fuller rounds of tiles. On the H200 it ran the
statistics 1-3% faster a flop than the logit kernel (``benchmarks/gluon_probe.py``).

Only the statistics of plain logits take this path (MODE_STATS without bias, logit scale, softcap
or smoothing's logit sum, without metrics and without the target pick; z-loss and class weights
enter the loss only); everything else, and every GPU without Hopper's wgmma or a Triton without
this Gluon API (it is experimental and moves: written for Triton 3.6), uses the logit kernel. The
interpreter runs no Gluon: the GPU tests check this path against float64, and the CPU tests
compile it for sm_90 (``scripts/compile_sm90.py --gluon``).

Why warpgroup 0 also loads: a producer warp would make 13 warps, launched as 16 at 128 registers
each, and ptxas holds every partition to that, too few for the accumulator; 12 warps get 168.
"""

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS_PER_GROUP = gl.constexpr(64)  # a warpgroup's rows of a tile
GROUPS = gl.constexpr(3)  # warpgroups a tile
BLOCK_V = gl.constexpr(256)
BLOCK_K = gl.constexpr(64)
STAGES = gl.constexpr(3)  # 3 x 56 KB of shared memory
BLOCK_N = ROWS_PER_GROUP.value * GROUPS.value  # rows a tile: 192
# The copy engine's load: ``async_load`` from Triton 3.7 on (which removes the older name).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


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
def _tile_epilogue(acc, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_col_tiles, pid_n, pid_v,
                   which: gl.constexpr, EVEN_V: gl.constexpr):
    """Each of warpgroup ``which``'s 64 rows: the tile's max and sum of exp(z - max)."""
    if not EVEN_V:  # columns past the vocabulary (zeros from the copy engine) take no part
        col_layout: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
        cols = pid_v * BLOCK_V + gl.arange(0, BLOCK_V, layout=col_layout)
        acc = gl.where((cols < vocab_size)[None, :], acc, float("-inf"))
    row_layout: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    tile_max = gl.max(acc, axis=1)
    sum_exp = gl.sum(gl.exp(acc - tile_max[:, None]), axis=1)
    rows = (pid_n * GROUPS + which) * ROWS_PER_GROUP + gl.arange(0, ROWS_PER_GROUP, layout=row_layout)
    stat = rows.to(gl.int64) * num_col_tiles + pid_v
    gl.store(tile_max_ptr + stat, tile_max, mask=rows < n_rows)
    gl.store(tile_sum_ptr + stat, sum_exp, mask=rows < n_rows)


@gluon.jit
def _loading_group(h_desc, w_desc, a_bufs, b_bufs, ready, empty, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size,
                   num_row_blocks, num_col_tiles, k_steps, group_blocks, EVEN_V: gl.constexpr):
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
        _tile_epilogue(acc, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_col_tiles, pid_n, pid_v, 0, EVEN_V)


@gluon.jit
def _group(a_bufs, b_bufs, ready, empty, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_row_blocks,
           num_col_tiles, k_steps, group_blocks, which: gl.constexpr, EVEN_V: gl.constexpr):
    """Warpgroup ``which`` (1 or 2, a worker partition): its rows of every tile of this program."""
    step = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_tiles, gl.num_programs(0)):
        pid_n, pid_v = _tile_coords(tile_id, num_row_blocks, num_col_tiles, group_blocks)
        acc = _tile_products(a_bufs, b_bufs, ready, empty, step, k_steps, which)
        step += k_steps
        _tile_epilogue(acc, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_col_tiles, pid_n, pid_v, which,
                       EVEN_V)


@gluon.jit
def _group_1(a_bufs, b_bufs, ready, empty, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_row_blocks,
             num_col_tiles, k_steps, group_blocks, EVEN_V: gl.constexpr):
    _group(a_bufs, b_bufs, ready, empty, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_row_blocks,
           num_col_tiles, k_steps, group_blocks, 1, EVEN_V)


@gluon.jit
def _group_2(a_bufs, b_bufs, ready, empty, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_row_blocks,
             num_col_tiles, k_steps, group_blocks, EVEN_V: gl.constexpr):
    _group(a_bufs, b_bufs, ready, empty, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_row_blocks,
           num_col_tiles, k_steps, group_blocks, 2, EVEN_V)


@gluon.jit
def tile_stats_kernel(h_desc, w_desc, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, hidden_size, group_blocks,
                      EVEN_V: gl.constexpr):
    """Tile statistics [n_rows, ceil(V / 256)] fp32 of z = hidden [n_rows, H] @ weight [V, H].T:
    each (row, 256-column tile)'s max and sum of exp(z - max), persistent over 192 x 256 tiles
    taken in groups of ``group_blocks`` row blocks (the logit kernel's order)."""
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
    args = (a_bufs, b_bufs, ready, empty, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, num_row_blocks,
            num_col_tiles, k_steps, group_blocks, EVEN_V)
    gl.warp_specialize([(_loading_group, (h_desc, w_desc) + args), (_group_1, args), (_group_2, args)],
                       [4, 4], [168, 168])


_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


_capabilities: dict[torch.device, tuple[int, int]] = {}


def device_applies(device: torch.device) -> bool:
    """Whether this kernel runs on ``device``: Hopper (sm_90) and not FLCE_GLUON=0."""
    if os.environ.get("FLCE_GLUON", "1") == "0" or device.type != "cuda":
        return False
    if device not in _capabilities:  # asked a few times a forward: kept, as the SM counts are
        _capabilities[device] = torch.cuda.get_device_capability(device)
    return _capabilities[device] == (9, 0)


def applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this kernel can compute the statistics of ``hidden`` against ``weight``: on a
    device it runs on, 16-bit inputs of one dtype, rows the copy engine can move, K steps of 64."""
    if not device_applies(hidden.device):
        return False
    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype or hidden.shape[1] % BLOCK_K.value:
        return False
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (hidden, weight))


def tile_stats(hidden: torch.Tensor, weight: torch.Tensor, tile_max: torch.Tensor, tile_sum_exp: torch.Tensor,
               group_rows: int, programs: int) -> None:
    """Writes each (row, 256-column tile)'s max and sum of exp(z - max) of z = hidden [n_rows, H]
    @ weight [V, H].T to ``tile_max`` and ``tile_sum_exp`` [n_rows, ceil(V / 256)] (fp32,
    contiguous); tiles are swept in groups of about ``group_rows`` rows, on at most ``programs``
    persistent programs."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    if n_rows == 0 or vocab_size == 0:
        return
    dtype = _DTYPES[hidden.dtype]
    block_h, block_w = [ROWS_PER_GROUP.value, BLOCK_K.value], [BLOCK_V.value, BLOCK_K.value]
    h_desc = TensorDescriptor.from_tensor(hidden, block_h, gl.NVMMASharedLayout.get_default_for(block_h, dtype))
    w_desc = TensorDescriptor.from_tensor(weight, block_w, gl.NVMMASharedLayout.get_default_for(block_w, dtype))
    num_tiles = triton.cdiv(n_rows, BLOCK_N) * triton.cdiv(vocab_size, BLOCK_V.value)
    tile_stats_kernel[(min(num_tiles, programs),)](
        h_desc, w_desc, tile_max, tile_sum_exp, n_rows, vocab_size, hidden_size, max(1, group_rows // BLOCK_N),
        EVEN_V=vocab_size % BLOCK_V.value == 0, num_warps=4)
