"""The logit kernels and the merge of their tiles: each (row block, vocabulary tile) of
``hidden @ weight.T`` computed in registers and reduced to softmax statistics, or made its
gradient; then each row's statistics merged from its tiles. See ``_kernel_math`` for the notation.

The vocabulary is cut into tiles of BLOCK_V columns. For each (row, tile) the logit kernel
reduces the tile to a few numbers that can be merged in any grouping (online softmax):

    m  = max_j z_j                       tile max
    s  = sum_j exp(z_j - m)              sum of exponentials relative to m
    a  = sum_j exp(z_j - m) (m - z_j)    entropy term relative to m (>= 0)
    arg = first j with z_j == m          (torch.argmax's answer; a NaN counts as +inf, and the
                                          column of a tile whose sum is NaN is stored with the
                                          sign bit set, NAN_INDEX, so that merges prefer it)

Two partial states (m1, s1, a1) and (m2, s2, a2) merge into M = max(m1, m2) with
s = sum_k exp(m_k - M) s_k and a = sum_k exp(m_k - M) (a_k + s_k (M - m_k)); at the end
lse = M + log s and the softmax entropy is log s + a / s (no cancellation: every term >= 0).
The merge holds for any reference m_k in place of the tile max, as long as s_k and a_k are
taken relative to it.
"""

import torch
import triton
import triton.language as tl

from ._kernel_math import LOG2E, NAN_INDEX, NO_INDEX, _exp_reference, _grad_logits, _tanh, _target_columns
from ._launch import acc_dtype
from ._options import LossOptions, RowStats


@triton.jit
def _tile_logits(
    hidden_ptr, weight_ptr, bias_ptr,
    pid_n, pid_v, n_rows, vocab_size, hidden_size,
    logit_scale, softcap,
    USE_TMA: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    """Final logits [BLOCK_N, BLOCK_V] (ACC_DTYPE) of one tile; -inf past the vocabulary.
    ``hidden`` [n_rows, H] and ``weight`` [V, H] are contiguous; ``bias_ptr``, ``logit_scale`` and
    ``softcap`` are None where absent (a scale of 1: no multiply); EVEN_V (V a multiple of
    BLOCK_V) leaves out the column mask."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = offs_v < vocab_size
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=ACC_DTYPE)  # [BLOCK_N, BLOCK_V]
    if USE_TMA:
        # Out-of-range rows, columns and the K tail are zero-filled by the copy engine.
        for k in range(0, tl.cdiv(hidden_size, BLOCK_K)):
            h = hidden_ptr.load([pid_n * BLOCK_N, k * BLOCK_K])  # [BLOCK_N, BLOCK_K]
            w = weight_ptr.load([pid_v * BLOCK_V, k * BLOCK_K])  # [BLOCK_V, BLOCK_K]
            acc = tl.dot(h, w.T, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
    else:
        # Wrap out-of-range rows and columns onto valid ones so that only K needs a mask;
        # their results are discarded. Offsets in int64: n * H and v * H can pass 2^31.
        offs_k = tl.arange(0, BLOCK_K)
        load_n = (offs_n % n_rows).to(tl.int64)
        load_v = (offs_v % vocab_size).to(tl.int64)
        h_ptrs = hidden_ptr + load_n[:, None] * hidden_size + offs_k[None, :]
        w_ptrs = weight_ptr + load_v[None, :] * hidden_size + offs_k[:, None]
        for k in range(0, tl.cdiv(hidden_size, BLOCK_K)):
            if EVEN_K:
                h = tl.load(h_ptrs)  # [BLOCK_N, BLOCK_K]
                w = tl.load(w_ptrs)  # [BLOCK_K, BLOCK_V]
            else:
                k_mask = offs_k < hidden_size - k * BLOCK_K
                h = tl.load(h_ptrs, mask=k_mask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(h, w, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    logits = acc
    if bias_ptr is not None:
        bias = tl.load(bias_ptr + offs_v, mask=col_mask, other=0.0).to(ACC_DTYPE)
        logits = logits + bias[None, :]
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * _tanh(logits / softcap)
    if EVEN_V:
        return logits
    return tl.where(col_mask[None, :], logits, float("-inf"))


@triton.jit
def _tile_position(tile_id, n_rows, vocab_size, group_rows, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """(row block, vocabulary tile) of a sweep's tile ``tile_id``. Tile ids go over the row blocks
    of a group of ``group_rows`` rows fastest, then over the vocabulary, then over the groups:
    the programs running together share one weight tile in L2 while the group's hidden rows
    stay cached (a launch of more rows than L2 holds, ungrouped, re-reads them from memory)."""
    num_row_blocks = tl.cdiv(n_rows, BLOCK_N)
    num_tiles = tl.cdiv(vocab_size, BLOCK_V)
    group_blocks = tl.cdiv(group_rows, BLOCK_N)
    group = tile_id // (group_blocks * num_tiles)
    first_block = group * group_blocks
    blocks_in_group = tl.minimum(num_row_blocks - first_block, group_blocks)  # fewer in the last group
    in_group = tile_id - first_block * num_tiles
    return first_block + in_group % blocks_in_group, in_group // blocks_in_group


@triton.jit
def _store_tile(out_ptr, tile, pid_n, pid_v, n_rows, vocab_size, TMA_STORE: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """Stores one tile [BLOCK_N, BLOCK_V] to ``out`` [n_rows, V] (contiguous) in its dtype,
    clipped at the edges."""
    if TMA_STORE:  # through shared memory by the copy engine
        out_ptr.store([pid_n * BLOCK_N, pid_v * BLOCK_V], tile.to(out_ptr.dtype))
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        out_mask = (offs_n < n_rows)[:, None] & (offs_v < vocab_size)[None, :]
        out_ptrs = out_ptr + offs_n.to(tl.int64)[:, None] * vocab_size + offs_v[None, :]
        tl.store(out_ptrs, tile.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _store_target_logit(target_logit_ptr, targets_ptr, logits, offs_n, offs_v, row_mask, pid_v, vocab_size,
                        BLOCK_V: tl.constexpr):
    """Stores the logit at each row's target from the tile ``logits`` [BLOCK_N, BLOCK_V] that holds
    it (rows ``offs_n``, columns ``offs_v``). The target's logit from this tile's product, like the
    lse's terms: the two then share the product's rounding, which cancels in the loss lse - z_t.
    Without a target_logit the caller takes _picked_logit_dot_kernel's, a tensor-core product
    summed in the same order: the same loss, where picking here costs a compare, a select and an
    add a logit (1.6-4.5% of a forward, docs/design.md)."""
    targets = _target_columns(tl.load(targets_ptr + offs_n, mask=row_mask, other=-1), vocab_size)
    is_target = offs_v[None, :] == targets[:, None]  # [BLOCK_N, BLOCK_V]
    target_logit = tl.sum(tl.where(is_target, logits, 0.0), axis=1)
    tile_start = pid_v * BLOCK_V
    has_target = (targets >= tile_start) & (targets < tl.minimum(tile_start + BLOCK_V, vocab_size))
    tl.store(target_logit_ptr + offs_n, target_logit, mask=row_mask & has_target)


@triton.jit(do_not_specialize=["n_rows"])
def _tile_stats_kernel(
    # pointers (contiguous; TMA descriptors where the copy engine moves them: USE_TMA, TMA_STORE); None where absent
    hidden_ptr,  # [n_rows, H]
    weight_ptr,  # [V, H]
    bias_ptr,  # [V] or None
    targets_ptr,  # [n_rows] int
    tile_max_ptr,  # [n_rows, num_tiles] fp32
    tile_sum_exp_ptr,  # [n_rows, num_tiles] fp32
    tile_entropy_ptr,  # [n_rows, num_tiles] fp32, or None: no metrics
    tile_argmax_ptr,  # [n_rows, num_tiles] int32, with tile_entropy_ptr
    tile_logit_sum_ptr,  # [n_rows, num_tiles] fp32 sum_j z_j (w_j z_j with class weights), or None
    tile_sum_sq_ptr,  # [n_rows, num_tiles] fp32 sum_j exp(2 (z_j - m)), or None
    target_logit_ptr,  # [n_rows] fp32, written by the tile that holds the target; None: the caller's
    out_ptr,  # [n_rows, V] buffer, or None: statistics only
    row_ref_ptr,  # [n_rows] fp32 reference B of each row, or None: the tile max
    loss_grad_ptr,  # [n_rows] fp32, with an exponentials' buffer: its rows without gradient stay 0
    class_weight_ptr,  # [V] fp32 class weights of the logit sum, or None
    # sizes
    n_rows,
    vocab_size,
    hidden_size,
    group_rows,  # rows whose tiles sweep the vocabulary together (their hidden rows stay in L2)
    # scalars (None: a scale of 1, no softcap)
    logit_scale,
    softcap,
    # meta-parameters
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0
    EVEN_V: tl.constexpr,  # V % BLOCK_V == 0: no partial vocabulary tile
    INPUT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per-(row, tile) softmax statistics of (BLOCK_N rows) x (BLOCK_V vocabulary entries) tiles
    of logits, reduced in registers, and optionally the tile itself.

    A tile is ``hidden[rows] @ weight[cols].T`` accumulated in fp32 over the hidden size, then
    bias, scale and softcap. Each tile writes its max, its sum of exponentials, and where asked
    the entropy term and first argmax (metrics), the logit sum and the sum of squared
    exponentials (see the module docstring). With ``out``, it also stores ``z - tile_max``
    (no ``row_ref``) or ``exp(z - reference)`` (with ``row_ref``: the factored gradient's
    buffer, 0 on the rows whose ``loss_grad`` is 0). With ``row_ref`` the sums are taken
    relative to the row's reference (``_exp_reference``); the tile that holds a row's target
    writes its logit to ``target_logit`` unless that is None (the caller then takes it from
    ``_target_kernels._picked_logit_dot_kernel``, as the factored sweep does). Without PERSISTENT a program
    does one tile; with it, a fixed grid strides over the tiles in one flattened loop, so that
    the loads of the next tile overlap the epilogue of the current one.
    """
    ACC_DTYPE: tl.constexpr = tile_max_ptr.dtype.element_ty  # of the logits and statistics (fp64 for fp64 inputs)
    USE_TMA: tl.constexpr = isinstance(hidden_ptr, tl.tensor_descriptor)  # the copy engine loads hidden and weight
    TMA_STORE: tl.constexpr = isinstance(out_ptr, tl.tensor_descriptor)  # and stores the buffer
    STORE_EXP: tl.constexpr = out_ptr is not None and row_ref_ptr is not None
    tl.static_assert(isinstance(weight_ptr, tl.tensor_descriptor) == USE_TMA, "hidden and weight load alike")
    tl.static_assert(USE_TMA or not TMA_STORE, "the buffer's TMA store needs the TMA loads")
    tl.static_assert(not STORE_EXP or (bias_ptr is None and softcap is None and tile_logit_sum_ptr is None),
                     "the factored gradient has one factor per row: no bias, softcap or smoothing")
    tl.static_assert(not STORE_EXP or target_logit_ptr is None, "the factored sweep takes the caller's target logit")
    tl.static_assert(tile_logit_sum_ptr is not None or class_weight_ptr is None, "class weights weight the logit sum")
    num_tiles = tl.cdiv(vocab_size, BLOCK_V)
    num_all_tiles = tl.cdiv(n_rows, BLOCK_N) * num_tiles
    for tile_id in tl.range(tl.program_id(0), num_all_tiles, tl.num_programs(0), flatten=PERSISTENT):
        pid_n, pid_v = _tile_position(tile_id, n_rows, vocab_size, group_rows, BLOCK_N, BLOCK_V)
        logits = _tile_logits(
            hidden_ptr, weight_ptr, bias_ptr, pid_n, pid_v, n_rows, vocab_size, hidden_size, logit_scale, softcap,
            USE_TMA, EVEN_K, EVEN_V, INPUT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K, ACC_DTYPE,
        )  # [BLOCK_N, BLOCK_V]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        row_mask = offs_n < n_rows
        col_mask = offs_v < vocab_size

        if tile_entropy_ptr is not None:  # the max and its first column in one reduction, a NaN counting as +inf
            tile_max, argmax = tl.max(tl.where(logits != logits, float("inf"), logits), axis=1, return_indices=True,
                                      return_indices_tie_break_left=True)
        else:
            tile_max = tl.max(logits, axis=1)  # [BLOCK_N]
        row_ref = tile_max
        if row_ref_ptr is not None:
            row_ref = tl.load(row_ref_ptr + offs_n, mask=row_mask, other=0.0)
        reference = _exp_reference(tile_max, row_ref, ROW_REFERENCE=row_ref_ptr is not None)
        shifted = logits - reference[:, None]  # z - m (<= 0 unless m is the row's reference)
        exp_shifted = tl.exp2(shifted * LOG2E)
        sum_exp = tl.sum(exp_shifted, axis=1)
        stat_offs = offs_n.to(tl.int64) * num_tiles + pid_v
        tl.store(tile_max_ptr + stat_offs, tile_max, mask=row_mask)
        tl.store(tile_sum_exp_ptr + stat_offs, sum_exp, mask=row_mask)
        if tile_sum_sq_ptr is not None:  # sum_j p_j^2 of the row, merged as sum_exp is, with squared weights
            tl.store(tile_sum_sq_ptr + stat_offs, tl.sum(exp_shifted * exp_shifted, axis=1), mask=row_mask)
        if tile_entropy_ptr is not None:
            if EVEN_V and bias_ptr is None:  # no -inf logit: no 0 * inf to take out
                entropy_term = -tl.sum(exp_shifted * shifted, axis=1)
            else:
                entropy_term = tl.sum(tl.where(exp_shifted > 0.0, -exp_shifted * shifted, 0.0), axis=1)
            tl.store(tile_entropy_ptr + stat_offs, entropy_term, mask=row_mask)
            # The tile's first column of its max (NO_INDEX where the tile is all -inf, past V), or
            # its first NaN's, marked NAN_INDEX, as torch.argmax takes a NaN for the largest: such
            # a tile's max is +inf and its sum NaN (exp(NaN - inf)), as is the row's loss.
            argmax = pid_v * BLOCK_V + argmax
            argmax = tl.where(tile_max == float("-inf"), NO_INDEX, tl.where(sum_exp != sum_exp, argmax | NAN_INDEX,
                                                                             argmax))
            tl.store(tile_argmax_ptr + stat_offs, argmax, mask=row_mask)
        if tile_logit_sum_ptr is not None:
            summed = logits
            if class_weight_ptr is not None:  # sum_j w_j z_j
                class_weight = tl.load(class_weight_ptr + offs_v, mask=col_mask, other=0.0)
                summed = logits * class_weight[None, :]
            logit_sum = tl.sum(tl.where(col_mask[None, :], summed, 0.0), axis=1)
            tl.store(tile_logit_sum_ptr + stat_offs, logit_sum, mask=row_mask)
        if target_logit_ptr is not None:
            _store_target_logit(target_logit_ptr, targets_ptr, logits, offs_n, offs_v, row_mask, pid_v, vocab_size,
                                BLOCK_V)

        if STORE_EXP:
            # Zeros on the rows without gradient, only in a tile that has such a row (see
            # _gluon_stats._tile_epilogue): an unconditional select is moved past the 16-bit
            # conversion by the compiler, which then unpacks each pair of values for it.
            no_grad = tl.load(loss_grad_ptr + offs_n, mask=row_mask, other=1.0) == 0.0
            tile_out = exp_shifted
            if tl.max(no_grad.to(tl.int32), axis=0) > 0:
                tile_out = tl.where(no_grad[:, None], 0.0, exp_shifted)
            _store_tile(out_ptr, tile_out, pid_n, pid_v, n_rows, vocab_size, TMA_STORE, BLOCK_N, BLOCK_V)
        elif out_ptr is not None:
            _store_tile(out_ptr, shifted, pid_n, pid_v, n_rows, vocab_size, TMA_STORE, BLOCK_N, BLOCK_V)


@triton.jit(do_not_specialize=["n_rows"])
def _tile_grad_kernel(
    # pointers (contiguous; TMA descriptors where the copy engine moves them: USE_TMA, TMA_STORE); None where absent
    hidden_ptr,  # [n_rows, H]
    weight_ptr,  # [V, H]
    bias_ptr,  # [V] or None
    targets_ptr,  # [n_rows] int
    out_ptr,  # [n_rows, V] grad logits
    lse_ptr,  # [n_rows] fp32
    loss_grad_ptr,  # [n_rows] fp32 d out / d loss_i
    lse_grad_ptr,  # [n_rows] fp32 d out / d lse_i, or None
    entropy_grad_ptr,  # [n_rows] fp32 d out / d entropy_i, or None
    class_weight_ptr,  # [V] fp32 class weights of the smoothing term, or None
    smooth_grad_ptr,  # [n_rows] fp32 d out / d loss_i before the class weight, with class_weight_ptr
    # sizes
    n_rows,
    vocab_size,
    hidden_size,
    group_rows,
    # scalars (None: a scale of 1, no softcap, smoothing or z-loss)
    logit_scale,
    softcap,
    label_smoothing,
    z_loss_scale,
    inv_vocab_size,  # 1 / V of the whole vocabulary (this weight may be one shard of it)
    # meta-parameters
    EVEN_K: tl.constexpr,
    EVEN_V: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The gradient with respect to the raw logits, G = d out / d u [n_rows, V], of tiles of
    (BLOCK_N rows) x (BLOCK_V vocabulary entries), once each row's lse is known: the logits are
    recomputed as ``_tile_stats_kernel`` computes them, p = exp(z - lse), and ``_grad_logits``
    gives G, stored to ``out`` in its dtype. Tiles are visited in ``_tile_position``'s order."""
    ACC_DTYPE: tl.constexpr = lse_ptr.dtype.element_ty  # of the logits (fp64 for fp64 inputs)
    USE_TMA: tl.constexpr = isinstance(hidden_ptr, tl.tensor_descriptor)  # the copy engine loads hidden and weight
    TMA_STORE: tl.constexpr = isinstance(out_ptr, tl.tensor_descriptor)  # and stores the grad logits
    tl.static_assert(isinstance(weight_ptr, tl.tensor_descriptor) == USE_TMA, "hidden and weight load alike")
    tl.static_assert(USE_TMA or not TMA_STORE, "the buffer's TMA store needs the TMA loads")
    tl.static_assert(label_smoothing is not None or class_weight_ptr is None,
                     "class weights enter the kernel with smoothing only")
    num_all_tiles = tl.cdiv(n_rows, BLOCK_N) * tl.cdiv(vocab_size, BLOCK_V)
    for tile_id in tl.range(tl.program_id(0), num_all_tiles, tl.num_programs(0), flatten=PERSISTENT):
        pid_n, pid_v = _tile_position(tile_id, n_rows, vocab_size, group_rows, BLOCK_N, BLOCK_V)
        logits = _tile_logits(
            hidden_ptr, weight_ptr, bias_ptr, pid_n, pid_v, n_rows, vocab_size, hidden_size, logit_scale, softcap,
            USE_TMA, EVEN_K, EVEN_V, INPUT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_K, ACC_DTYPE,
        )  # [BLOCK_N, BLOCK_V]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        row_mask = offs_n < n_rows
        targets = _target_columns(tl.load(targets_ptr + offs_n, mask=row_mask, other=-1), vocab_size)
        is_target = offs_v[None, :] == targets[:, None]  # [BLOCK_N, BLOCK_V]
        lse = tl.load(lse_ptr + offs_n, mask=row_mask, other=0.0)
        loss_grad = tl.load(loss_grad_ptr + offs_n, mask=row_mask, other=0.0)
        lse_grad = loss_grad  # (unused without lse_grad_ptr, as the next three are without theirs)
        if lse_grad_ptr is not None:
            lse_grad = tl.load(lse_grad_ptr + offs_n, mask=row_mask, other=0.0)
        entropy_grad = loss_grad
        if entropy_grad_ptr is not None:
            entropy_grad = tl.load(entropy_grad_ptr + offs_n, mask=row_mask, other=0.0)
        class_weight = lse
        smooth_grad = loss_grad
        if class_weight_ptr is not None:
            class_weight = tl.load(class_weight_ptr + offs_v, mask=offs_v < vocab_size, other=0.0)
            smooth_grad = tl.load(smooth_grad_ptr + offs_n, mask=row_mask, other=0.0)
        probs = tl.exp(logits - lse[:, None])
        grad = _grad_logits(
            probs, logits, is_target, lse, loss_grad, lse_grad, class_weight, smooth_grad, inv_vocab_size,
            logit_scale, softcap, label_smoothing, z_loss_scale,
            HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing is not None,
            HAS_Z_LOSS=z_loss_scale is not None, HAS_LSE_GRAD=lse_grad_ptr is not None,
            HAS_CLASS_WEIGHT=class_weight_ptr is not None,
            entropy_grad=entropy_grad, HAS_ENTROPY_GRAD=entropy_grad_ptr is not None,
        )
        _store_tile(out_ptr, grad, pid_n, pid_v, n_rows, vocab_size, TMA_STORE, BLOCK_N, BLOCK_V)


@triton.jit
def _merge_tiles(
    tile_max_ptr, tile_sum_exp_ptr, tile_entropy_ptr, tile_argmax_ptr, tile_logit_sum_ptr, row_ref,
    offs_r, row_mask, num_tiles,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    """The row statistics [BLOCK_R] of rows ``offs_r`` merged from their tiles' [rows, num_tiles],
    in tile order (deterministic): (row_max, sum_exp relative to it, entropy term relative to it,
    argmax int32 (the first NaN's column if any tile has one), logit sum); the last three are
    zeros / NO_INDEX where their tiles' pointers (metrics: entropy and argmax; the logit sum) are
    None. The tiles' sums are relative to their tile max, or to ``_exp_reference``'s against
    ``row_ref`` [BLOCK_R] where that is not None."""
    RETURN_METRICS: tl.constexpr = tile_entropy_ptr is not None
    HAS_SMOOTHING: tl.constexpr = tile_logit_sum_ptr is not None
    ROW_REFERENCE: tl.constexpr = row_ref is not None
    base = offs_r.to(tl.int64)[:, None] * num_tiles  # [BLOCK_R, 1]

    # Accumulate elementwise over [BLOCK_R, BLOCK_T] and reduce across columns once at the
    # end: fewer shuffles, and a loop shape the compiler handles well.
    running_max = tl.full((BLOCK_R, BLOCK_T), float("-inf"), ACC_DTYPE)
    for t in range(0, num_tiles, BLOCK_T):
        offs_t = t + tl.arange(0, BLOCK_T)
        mask = row_mask[:, None] & (offs_t[None, :] < num_tiles)
        tile_max = tl.load(tile_max_ptr + base + offs_t[None, :], mask=mask, other=float("-inf"))
        running_max = tl.maximum(running_max, tile_max)
    row_max = tl.max(running_max, axis=1)  # [BLOCK_R]
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    if row_ref is None:
        row_ref = row_max

    sum_exp = tl.zeros((BLOCK_R, BLOCK_T), ACC_DTYPE)
    entropy_term = tl.zeros((BLOCK_R, BLOCK_T), ACC_DTYPE)
    logit_sum = tl.zeros((BLOCK_R, BLOCK_T), ACC_DTYPE)
    argmax = tl.full((BLOCK_R, BLOCK_T), NO_INDEX, tl.int32)
    for t in range(0, num_tiles, BLOCK_T):
        offs_t = t + tl.arange(0, BLOCK_T)
        mask = row_mask[:, None] & (offs_t[None, :] < num_tiles)
        ptrs = base + offs_t[None, :]
        tile_max = tl.load(tile_max_ptr + ptrs, mask=mask, other=float("-inf"))
        tile_sum = tl.load(tile_sum_exp_ptr + ptrs, mask=mask, other=0.0)
        live = tile_max > float("-inf")  # fully masked tiles contribute nothing
        reference = _exp_reference(tile_max, row_ref[:, None], ROW_REFERENCE)
        weight = tl.where(live, tl.exp(reference - safe_max[:, None]), 0.0)
        sum_exp += weight * tile_sum
        if RETURN_METRICS:
            tile_entropy = tl.load(tile_entropy_ptr + ptrs, mask=mask, other=0.0)
            gap = tl.where(live, safe_max[:, None] - reference, 0.0)
            entropy_term += weight * (tile_entropy + tile_sum * gap)
            tile_argmax = tl.load(tile_argmax_ptr + ptrs, mask=mask, other=NO_INDEX)
            at_max = mask & ((tile_max == row_max[:, None]) | (tile_argmax < 0))  # a tile's NaN (NAN_INDEX)
            argmax = tl.minimum(argmax, tl.where(at_max, tile_argmax, NO_INDEX))
        if HAS_SMOOTHING:
            logit_sum += tl.load(tile_logit_sum_ptr + ptrs, mask=mask, other=0.0)
    # Fixed-shape tree reductions: the same summation order on every call.
    return (row_max, tl.sum(sum_exp, axis=1), tl.sum(entropy_term, axis=1), tl.min(argmax, axis=1) & NO_INDEX,
            tl.sum(logit_sum, axis=1))


@triton.jit
def _store_row_stats(
    row_max_ptr, row_sum_exp_ptr, row_entropy_ptr, row_argmax_ptr, row_logit_sum_ptr,
    offs_r, row_mask, row_max, sum_exp, entropy_term, argmax, logit_sum,
):
    """Stores ``_merge_tiles``' statistics of rows ``offs_r`` (argmax as int64), those whose
    pointers are not None."""
    tl.store(row_max_ptr + offs_r, row_max, mask=row_mask)
    tl.store(row_sum_exp_ptr + offs_r, sum_exp, mask=row_mask)
    if row_entropy_ptr is not None:
        tl.store(row_entropy_ptr + offs_r, entropy_term, mask=row_mask)
        tl.store(row_argmax_ptr + offs_r, argmax.to(tl.int64), mask=row_mask)
    if row_logit_sum_ptr is not None:
        tl.store(row_logit_sum_ptr + offs_r, logit_sum, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _combine_tiles_kernel(
    # pointers
    tile_max_ptr,  # [n_rows, num_tiles] fp32
    tile_sum_exp_ptr,  # [n_rows, num_tiles] fp32
    tile_entropy_ptr,  # [n_rows, num_tiles] fp32, or None: no metrics
    tile_argmax_ptr,  # [n_rows, num_tiles] int32, with tile_entropy_ptr
    tile_logit_sum_ptr,  # [n_rows, num_tiles] fp32, or None
    row_max_ptr,  # [n_rows] fp32 out
    row_sum_exp_ptr,  # [n_rows] fp32 out, relative to row_max
    row_entropy_ptr,  # [n_rows] fp32 out, entropy term relative to row_max (with tile_entropy_ptr)
    row_argmax_ptr,  # [n_rows] int64 out (with tile_entropy_ptr)
    row_logit_sum_ptr,  # [n_rows] fp32 out (with tile_logit_sum_ptr)
    row_ref_ptr,  # [n_rows] fp32 reference B of the tiles' sums, or None: their tile max
    tile_sum_sq_ptr,  # [n_rows, num_tiles] fp32, or None
    row_sum_sq_ptr,  # [n_rows] fp32 out, sum_j exp(2 (z_j - row_max)) (with tile_sum_sq_ptr)
    # sizes
    n_rows,
    num_tiles,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC_DTYPE: tl.constexpr,  # of the statistics (fp64 for fp64 inputs)
):
    """Merges the per-tile statistics of each row (``_merge_tiles``), and the tiles' sums of
    squared exponentials where given, each rescaled by the square of its tile's weight."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = offs_r < n_rows
    row_ref = None
    if row_ref_ptr is not None:
        row_ref = tl.load(row_ref_ptr + offs_r, mask=row_mask, other=0.0)
    row_max, sum_exp, entropy_term, argmax, logit_sum = _merge_tiles(
        tile_max_ptr, tile_sum_exp_ptr, tile_entropy_ptr, tile_argmax_ptr, tile_logit_sum_ptr, row_ref,
        offs_r, row_mask, num_tiles, BLOCK_R=BLOCK_R, BLOCK_T=BLOCK_T, ACC_DTYPE=ACC_DTYPE,
    )
    _store_row_stats(row_max_ptr, row_sum_exp_ptr, row_entropy_ptr, row_argmax_ptr, row_logit_sum_ptr,
                     offs_r, row_mask, row_max, sum_exp, entropy_term, argmax, logit_sum)
    if tile_sum_sq_ptr is not None:
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        base = offs_r.to(tl.int64)[:, None] * num_tiles
        sum_sq = tl.zeros((BLOCK_R, BLOCK_T), ACC_DTYPE)
        for t in range(0, num_tiles, BLOCK_T):
            offs_t = t + tl.arange(0, BLOCK_T)
            mask = row_mask[:, None] & (offs_t[None, :] < num_tiles)
            tile_max = tl.load(tile_max_ptr + base + offs_t[None, :], mask=mask, other=float("-inf"))
            tile_sum_sq = tl.load(tile_sum_sq_ptr + base + offs_t[None, :], mask=mask, other=0.0)
            if row_ref is None:
                reference = _exp_reference(tile_max, tile_max, False)
            else:
                reference = _exp_reference(tile_max, row_ref[:, None], True)
            weight = tl.where(tile_max > float("-inf"), tl.exp(reference - safe_max[:, None]), 0.0)
            sum_sq += weight * weight * tile_sum_sq
        tl.store(row_sum_sq_ptr + offs_r, tl.sum(sum_sq, axis=1), mask=row_mask)


# ---- launches ---------------------------------------------------------------------------
def new_row_stats(n_rows: int, target_logit, opts: LossOptions, return_metrics: bool, f32: dict,
                  logit_sum: bool = False, sum_sq: bool = False) -> RowStats:
    """Empty row statistics [n_rows] for ``combine_tiles`` (``f32``: their device and dtype), with
    the metrics' and the sums' arrays where asked."""
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


def combine_tiles(tile_stats: tuple, stats: RowStats, row_ref: torch.Tensor | None, num_tiles: int) -> None:
    """Merges a chunk's tile statistics (``_tile_stats_kernel``'s max, sum_exp, entropy term,
    argmax, logit sum and sum of squares, [rows, num_tiles], None where not swept) into ``stats``
    (``new_row_stats``), by ``_combine_tiles_kernel``; with ``row_ref`` [rows] the tiles' sums are
    relative to it."""
    n_rows = stats.row_max.shape[0]
    block_r = 16
    _combine_tiles_kernel[(triton.cdiv(n_rows, block_r),)](
        *tile_stats[:5], stats.row_max, stats.sum_exp, stats.entropy_term, stats.argmax, stats.logit_sum, row_ref,
        tile_stats[5], stats.sum_sq,
        n_rows, num_tiles,
        BLOCK_R=block_r,
        BLOCK_T=min(128, triton.next_power_of_2(num_tiles)),
        ACC_DTYPE=acc_dtype(stats.row_max.dtype),
    )
