"""Triton kernels of the fused linear cross-entropy. Kernels only: no allocation, no launch.

Notation, for a row i of ``hidden`` (h_i), a vocabulary entry j and a target t_i:

    u_ij  = h_i . w_j + b_j                        raw logit (fp32 accumulator of tl.dot)
    z_ij  = s * u_ij                               s = logit_scale
    z_ij <- c * tanh(z_ij / c)                     when a softcap c is set
    lse_i = log sum_j exp(z_ij)
    loss_i = lse_i - (1 - eps) z_it - (eps / V) sum_j z_ij + k lse_i^2
                                                   eps = label_smoothing, k = z_loss_scale
    d loss_i / d z_ij = p_ij (1 + 2 k lse_i) - (1 - eps) [j == t_i] - eps / V,   p = softmax(z_i)
    d z_ij / d u_ij   = s (1 - (z_ij / c)^2)       (s alone without a softcap)
    grad_hidden = G @ W,  grad_weight = G^T @ H,  grad_bias = sum_i G_i   with G = d loss / d u

With class weights w (PyTorch's ``weight=``), row i's cross-entropy is w_t times the above, except
for the smoothing term, which becomes (eps / V) sum_j w_j (lse_i - z_ij); the z-loss stays
unweighted (its gradient then comes through the lse gradient). The per-row factors
(w_t, and the coefficients of p) are applied outside the kernels; inside, HAS_CLASS_WEIGHT
(set only with label smoothing) weights the logit sum, sum_j w_j z_ij, and the smoothing term
of the gradient, (eps / V) w_j per column.

Statistics and accumulators are fp32 (ACC_DTYPE), fp64 for fp64 inputs.

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

Factored gradients (``_tile_stats_kernel`` with a buffer and row references). Given a reference
R_i per row, the tile sweep can store e_ij = exp(z_ij - R_i) instead of z - tile_max. Without
bias, softcap, smoothing or z-loss the gradient is then G = diag(r) E' + diag(c) T with r_i = s
g_i exp(R_i - lse_i) (g_i = d out / d loss_i), T the one-hot targets, and either E' = E minus
exp(lse_i - R_i) at the row's target and c_i = 0 (the target entry inside the products), or E'
= E with 0 at the target and c_i = s g_i (p_it - 1) (the target entry outside them), so that

    grad_hidden = diag(r) (E' @ W) + diag(c) W[t]
    grad_weight += E'^T @ (diag(r) H),  then grad_weight[t_i] += c_i h_i (once, at the end)

and no pass over the chunk's buffer is needed once lse is known. Which way a row goes is a
matter of rounding, decided by how many of the step's rows have the same target
(``take_out``, see ``_chunked``) and by p_t: a rare target's entry, or that of a row that
gives its (not frequent) target less than RARE_PROBABILITY, is its column's largest term, and kept out of
grad_weight's 16-bit running sum it meets that sum once, in fp32, at its last rounding (as
PyTorch's G_it = p_t - 1 meets h_i in one product); a frequent, well predicted target's
entries nearly cancel its column's other terms, so they stay in each chunk's product, where
the sum stays as small as the gradient. R_i starts as a cheap lower bound of the row max (the
target's logit, B_i); a tile whose max passes B_i by more than REFERENCE_GAP keeps its own
max as reference instead (exp(z - B_i) could overflow 16 bits there), and
``_row_factors_kernel`` later moves such rare rows to their true max. Entries below exp(-87)
of their reference flush to zero, as exp does in fp32.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

# Larger than any column index: the neutral element of the first-index argmax (a min over the
# indices where the max is reached), and the value of a tile or row without one.
NO_INDEX = tl.constexpr(2147483647)
# A NaN logit's column j is kept as j | NAN_INDEX (j - 2^31): below every column index, so that the
# min that picks the first max picks the first NaN where there is one, as torch.argmax does;
# ``& NO_INDEX`` gives back j (and leaves other indices as they are).
NAN_INDEX = tl.constexpr(-2147483648)

# How far above the row's reference B_i a tile's max may go before the tile takes its own max as
# reference: e^40 ~ 2e17 keeps every stored exponential, and products of them with the weights,
# far inside bf16's and fp32's range.
REFERENCE_GAP = tl.constexpr(40.0)
# exp(x) as exp2(x * LOG2E): on NVIDIA GPUs the same product (LOG2E rounded to fp32) and the same
# ex2.approx instruction as tl.exp, without tl.exp's path for results below 2^-126 (exp2's is the
# .ftz form: they flush to 0, far under the sums' rounding and the 16-bit buffer's). The sweeps'
# epilogues then take one fp32 multiply an element where tl.exp takes three and a compare.
LOG2E = tl.constexpr(1.4426950408889634)

# A row's take_out flag (``_factor_rows``): its target entry stays in the bf16 products (0), leaves
# them (OUT_ALWAYS: a rare target), or leaves them where p_t < RARE_PROBABILITY (OUT_IF_IMPROBABLE:
# near-uniform rows, whose columns' other terms are too small to cancel it).
OUT_ALWAYS = tl.constexpr(1)
OUT_IF_IMPROBABLE = tl.constexpr(2)
RARE_PROBABILITY = tl.constexpr(2.0**-10)


@triton.jit
def _exp_reference(tile_max, row_ref, ROW_REFERENCE: tl.constexpr):
    """The reference m of a tile's exponentials exp(z - m), per row: the tile max (0 where the
    tile is all -inf, so that no NaN appears); with ROW_REFERENCE, the row's reference B_i
    unless the tile max passes it by more than REFERENCE_GAP. [BLOCK] fp32 from [BLOCK] fp32."""
    reference = tl.where(tile_max == float("-inf"), 0.0, tile_max)
    if ROW_REFERENCE:
        reference = tl.where(reference > row_ref + REFERENCE_GAP, reference, row_ref)
    return reference


@triton.jit
def _target_columns(targets, vocab_size):
    """Targets [BLOCK] (int64) as int32 columns, -1 where not a column of this weight: compared
    against every column of a tile, int64 targets make each compare a 64-bit one (the forward's
    sweep, picking the target in its tiles, took 255 registers a thread against 165 so, compiled
    for sm_90)."""
    return tl.where((targets >= 0) & (targets < vocab_size), targets, -1).to(tl.int32)


# Below this |x|, tanh is an odd polynomial (``_tanh``).
TANH_POLY_BOUND = tl.constexpr(0.625)


@triton.jit
def _tanh(x):
    """tanh(x) elementwise (fp32 or fp64, x's shape), within a few roundings r of x's dtype
    (r = 2^-24 in fp32, 2^-53 in fp64) of the exact value, relative, for every x.

    For |x| >= TANH_POLY_BOUND: 1 - 2 / (exp(2|x|) + 1), with x's sign. It saturates to +-1 without
    overflow (exp -> inf), but its subtraction leaves an error of about r absolute, r / tanh(x)
    relative: used for all x, a softcap c would put an error of about c r on every logit, whatever
    its size, and the z / c of a huge cap would round the logits to a constant. Above the bound
    the error is r plus (1 - tanh) / tanh times the roundings of exp, the add and the division;
    that factor is 0.8 at |x| = 0.625 (tanh = 0.555), and the form is within 2r there and above
    (measured against mpmath on [0.625, 20], fp32 and fp64).

    Below: x (1 + s Q(s)), s = x^2, with Q interpolating (tanh(x) / x - 1) / s at Chebyshev nodes
    of [0, 0.625^2] (coefficients near Taylor's -1/3, 2/15, -17/315, ...). The bound trades the
    polynomial's degree against the exp form's cancellation: tanh's poles at +-i pi / 2 make a
    degree-n fit on [-0.625, 0.625] converge as about 5^-n, so degree 13 is within 0.01r in fp32
    and degree 25 in fp64; by Horner's rule the result is within 1.1r (fp32) and 2r (fp64). Plain
    multiplies and adds, the same in the interpreter and compiled; every kernel that caps logits
    calls this one function, so that they agree bit for bit."""
    abs_x = tl.abs(x)
    s = x * x
    if x.dtype == tl.float64:
        q = -3.1201101425797402e-05 + s * 6.485163482793113e-06
        q = 9.2571161295567687e-05 + s * q
        q = -0.0002375906496055562 + s * q
        q = 0.00058966065777570434 + s * q
        q = -0.0014557754120478055 + s * q
        q = 0.0035921217511549622 + s * q
        q = -0.0088632351032408782 + s * q
        q = 0.021869488519008305 + s * q
        q = -0.053968253967896992 + s * q
        q = 0.13333333333333042 + s * q
        q = -0.33333333333333331 + s * q
    else:
        q = -0.00834394526 + s * 0.00229274482
        q = 0.0217689183 + s * q
        q = -0.0539592579 + s * q
        q = 0.133333042 + s * q
        q = -0.333333343 + s * q
    small = x + x * (s * q)
    large = 1.0 - 2.0 / (tl.exp(2.0 * abs_x) + 1.0)
    return tl.where(abs_x < TANH_POLY_BOUND, small, tl.where(x < 0.0, -large, large))


@triton.jit
def _grad_logits(
    probs,  # [BLOCK_N, BLOCK_V] fp32 softmax
    logits,  # [BLOCK_N, BLOCK_V] fp32 final logits z (used with a softcap only)
    is_target,  # [BLOCK_N, BLOCK_V] bool
    lse,  # [BLOCK_N] fp32
    loss_grad,  # [BLOCK_N] fp32 d out / d loss_i, 0 on ignored rows
    lse_grad,  # [BLOCK_N] fp32 d out / d lse_i (HAS_LSE_GRAD)
    class_weight,  # [BLOCK_V] fp32 class weights w_j (HAS_CLASS_WEIGHT)
    smooth_grad,  # [BLOCK_N] fp32 d out / d loss_i before the class weight (HAS_CLASS_WEIGHT)
    inv_vocab_size,
    logit_scale,
    softcap,
    label_smoothing,
    z_loss_scale,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_LSE_GRAD: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr,
    entropy_grad=None,  # [BLOCK_N] fp32 d out / d entropy_i (HAS_ENTROPY_GRAD)
    HAS_ENTROPY_GRAD: tl.constexpr = False,
):
    """d out / d u for one tile: the gradient with respect to the raw logits h.w + b.

    With HAS_ENTROPY_GRAD the rows' entropies H_i = -sum_j p_ij log p_ij take gradient too:
    d H_i / d z_ij = -p_ij (log p_ij + H_i). The caller folds -e_i H_i into ``lse_grad`` (a
    coefficient of p like lse's); the log p_ij = z_ij - lse_i part is added here."""
    prob_coef = loss_grad
    if HAS_Z_LOSS:
        prob_coef = prob_coef * (1.0 + 2.0 * z_loss_scale * lse)
    if HAS_LSE_GRAD:
        prob_coef = prob_coef + lse_grad
    target_coef = loss_grad
    if HAS_SMOOTHING:
        target_coef = loss_grad * (1.0 - label_smoothing)
    grad = probs * prob_coef[:, None] - tl.where(is_target, target_coef[:, None], 0.0)
    if HAS_ENTROPY_GRAD:
        grad = grad - probs * (entropy_grad[:, None] * (logits - lse[:, None]))
    if HAS_SMOOTHING:
        if HAS_CLASS_WEIGHT:
            grad = grad - (smooth_grad * (label_smoothing * inv_vocab_size))[:, None] * class_weight[None, :]
        else:
            grad = grad - (loss_grad * (label_smoothing * inv_vocab_size))[:, None]
    if HAS_SOFTCAP:
        capped = logits / softcap
        grad = grad * (1.0 - capped * capped)
    if logit_scale is not None:
        grad = grad * logit_scale
    # Rows with no gradient (ignored targets) stay exactly 0, even with non-finite logits.
    keep = loss_grad != 0.0
    if HAS_LSE_GRAD:
        keep = keep | (lse_grad != 0.0)
    if HAS_ENTROPY_GRAD:
        keep = keep | (entropy_grad != 0.0)
    return tl.where(keep[:, None], grad, 0.0)


@triton.jit
def _tile_logits(
    hidden_ptr, weight_ptr, bias_ptr,
    pid_n, pid_v, n_rows, vocab_size, hidden_size,
    stride_hn, stride_wv,
    logit_scale, softcap,
    USE_TMA: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    """Final logits [BLOCK_N, BLOCK_V] (ACC_DTYPE) of one tile; -inf past the vocabulary.
    ``hidden`` and ``weight`` have unit column strides; ``bias_ptr``, ``logit_scale`` and
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
        h_ptrs = hidden_ptr + load_n[:, None] * stride_hn + offs_k[None, :]
        w_ptrs = weight_ptr + load_v[None, :] * stride_wv + offs_k[:, None]
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


@triton.jit(do_not_specialize=["n_rows"])
def _tile_stats_kernel(
    # pointers (TMA descriptors for hidden and weight when USE_TMA, for out when TMA_STORE); None where absent
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
    # row strides (the columns' are 1; ``out`` is contiguous)
    stride_hn,
    stride_wv,
    # scalars (None: a scale of 1, no softcap)
    logit_scale,
    softcap,
    # meta-parameters
    USE_TMA: tl.constexpr,
    TMA_STORE: tl.constexpr,
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
    ``_picked_logit_dot_kernel``, as the factored sweep does). Without PERSISTENT a program
    does one tile; with it, a fixed grid strides over the tiles in one flattened loop, so that
    the loads of the next tile overlap the epilogue of the current one.
    """
    ACC_DTYPE: tl.constexpr = tile_max_ptr.dtype.element_ty  # of the logits and statistics (fp64 for fp64 inputs)
    STORE_EXP: tl.constexpr = out_ptr is not None and row_ref_ptr is not None
    tl.static_assert(USE_TMA or not TMA_STORE, "the buffer's TMA store needs the TMA loads")
    tl.static_assert(out_ptr is not None or not TMA_STORE, "no buffer to store")
    tl.static_assert(not STORE_EXP or (bias_ptr is None and softcap is None and tile_logit_sum_ptr is None),
                     "the factored gradient has one factor per row: no bias, softcap or smoothing")
    tl.static_assert(not STORE_EXP or target_logit_ptr is None, "the factored sweep takes the caller's target logit")
    tl.static_assert(tile_logit_sum_ptr is not None or class_weight_ptr is None, "class weights weight the logit sum")
    num_tiles = tl.cdiv(vocab_size, BLOCK_V)
    num_all_tiles = tl.cdiv(n_rows, BLOCK_N) * num_tiles
    for tile_id in tl.range(tl.program_id(0), num_all_tiles, tl.num_programs(0), flatten=PERSISTENT):
        pid_n, pid_v = _tile_position(tile_id, n_rows, vocab_size, group_rows, BLOCK_N, BLOCK_V)
        logits = _tile_logits(
            hidden_ptr, weight_ptr, bias_ptr, pid_n, pid_v, n_rows, vocab_size, hidden_size,
            stride_hn, stride_wv, logit_scale, softcap,
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
            # The target's logit from this tile's product, like the lse's terms: the two then
            # share the product's rounding, which cancels in the loss lse - z_t. Without a
            # target_logit the caller takes _picked_logit_dot_kernel's, a tensor-core product
            # summed in the same order: the same loss, where picking here costs a compare, a
            # select and an add a logit (1.6-4.5% of a forward, docs/design.md).
            targets = _target_columns(tl.load(targets_ptr + offs_n, mask=row_mask, other=-1), vocab_size)
            is_target = offs_v[None, :] == targets[:, None]  # [BLOCK_N, BLOCK_V]
            target_logit = tl.sum(tl.where(is_target, logits, 0.0), axis=1)
            tile_start = pid_v * BLOCK_V
            has_target = (targets >= tile_start) & (targets < tl.minimum(tile_start + BLOCK_V, vocab_size))
            tl.store(target_logit_ptr + offs_n, target_logit, mask=row_mask & has_target)

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
    # pointers (TMA descriptors for hidden and weight when USE_TMA, for out when TMA_STORE); None where absent
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
    # row strides (the columns' are 1; ``out`` is contiguous)
    stride_hn,
    stride_wv,
    # scalars (None: a scale of 1, no softcap, smoothing or z-loss)
    logit_scale,
    softcap,
    label_smoothing,
    z_loss_scale,
    inv_vocab_size,  # 1 / V of the whole vocabulary (this weight may be one shard of it)
    # meta-parameters
    USE_TMA: tl.constexpr,
    TMA_STORE: tl.constexpr,
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
    tl.static_assert(USE_TMA or not TMA_STORE, "the buffer's TMA store needs the TMA loads")
    tl.static_assert(label_smoothing is not None or class_weight_ptr is None,
                     "class weights enter the kernel with smoothing only")
    num_all_tiles = tl.cdiv(n_rows, BLOCK_N) * tl.cdiv(vocab_size, BLOCK_V)
    for tile_id in tl.range(tl.program_id(0), num_all_tiles, tl.num_programs(0), flatten=PERSISTENT):
        pid_n, pid_v = _tile_position(tile_id, n_rows, vocab_size, group_rows, BLOCK_N, BLOCK_V)
        logits = _tile_logits(
            hidden_ptr, weight_ptr, bias_ptr, pid_n, pid_v, n_rows, vocab_size, hidden_size,
            stride_hn, stride_wv, logit_scale, softcap,
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


@triton.jit
def _finalize(
    row_max, sum_exp, entropy_term, argmax, logit_sum, target_logit, targets, valid,
    inv_vocab_size, label_smoothing, z_loss_scale,
):
    """(lse, loss, correct int32, entropy) [BLOCK_R] of rows from their merged statistics; loss,
    correct and entropy are 0 where not ``valid`` (ignored rows). ``label_smoothing`` and
    ``z_loss_scale`` are None where absent."""
    log_sum_exp = tl.log(sum_exp)
    lse = row_max + log_sum_exp
    if label_smoothing is not None:
        loss = lse - (1.0 - label_smoothing) * target_logit - label_smoothing * inv_vocab_size * logit_sum
    else:
        loss = lse - target_logit
    if z_loss_scale is not None:
        loss = loss + z_loss_scale * lse * lse
    correct = (valid & (argmax == targets)).to(tl.int32)
    entropy = log_sum_exp + entropy_term / sum_exp
    return lse, tl.where(valid, loss, 0.0), correct, tl.where(valid, entropy, 0.0)


@triton.jit
def _store_results(lse_ptr, loss_ptr, correct_ptr, entropy_ptr, offs_r, row_mask, lse, loss, correct, entropy):
    """Stores ``_finalize``'s per-row results (the metrics where ``correct_ptr`` is not None)."""
    tl.store(lse_ptr + offs_r, lse, mask=row_mask)
    tl.store(loss_ptr + offs_r, loss, mask=row_mask)
    if correct_ptr is not None:
        tl.store(correct_ptr + offs_r, correct, mask=row_mask)
        tl.store(entropy_ptr + offs_r, entropy, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _finalize_rows_kernel(
    # pointers
    row_max_ptr,  # [n_rows] fp32
    row_sum_exp_ptr,  # [n_rows] fp32, relative to row_max
    row_entropy_ptr,  # [n_rows] fp32, relative to row_max, or None: no metrics
    row_argmax_ptr,  # [n_rows] int64 (with the metrics)
    row_logit_sum_ptr,  # [n_rows] fp32 (with label smoothing)
    target_logit_ptr,  # [n_rows] fp32 (NaN where no tile held the target)
    targets_ptr,  # [n_rows] int
    lse_ptr,  # [n_rows] fp32 out
    loss_ptr,  # [n_rows] fp32 out, 0 on ignored rows
    correct_ptr,  # [n_rows] int32 out (with the metrics)
    entropy_ptr,  # [n_rows] fp32 out, 0 on ignored rows (with the metrics)
    # sizes and scalars (label_smoothing and z_loss_scale None where absent)
    n_rows,
    ignore_index,
    inv_vocab_size,
    label_smoothing,
    z_loss_scale,
    # meta-parameters
    BLOCK_R: tl.constexpr,
):
    """Per-row lse, loss, correctness and entropy from the merged row statistics (``_finalize``)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = offs_r < n_rows
    row_max = tl.load(row_max_ptr + offs_r, mask=row_mask, other=0.0)
    sum_exp = tl.load(row_sum_exp_ptr + offs_r, mask=row_mask, other=1.0)
    targets = tl.load(targets_ptr + offs_r, mask=row_mask, other=ignore_index)
    target_logit = tl.load(target_logit_ptr + offs_r, mask=row_mask, other=0.0)
    entropy_term = tl.zeros_like(row_max)
    argmax = tl.full(row_max.shape, -1, tl.int64)
    logit_sum = tl.zeros_like(row_max)
    if row_entropy_ptr is not None:
        entropy_term = tl.load(row_entropy_ptr + offs_r, mask=row_mask, other=0.0)
        argmax = tl.load(row_argmax_ptr + offs_r, mask=row_mask, other=-1)
    if row_logit_sum_ptr is not None:
        logit_sum = tl.load(row_logit_sum_ptr + offs_r, mask=row_mask, other=0.0)
    lse, loss, correct, entropy = _finalize(
        row_max, sum_exp, entropy_term, argmax, logit_sum, target_logit, targets, targets != ignore_index,
        inv_vocab_size, label_smoothing, z_loss_scale,
    )
    _store_results(lse_ptr, loss_ptr, correct_ptr, entropy_ptr, offs_r, row_mask, lse, loss, correct, entropy)


@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def _grad_from_shifted_kernel(
    # pointers
    buffer_ptr,  # [n_rows, V] in: z - tile_max, out: grad logits (in place)
    tile_max_ptr,  # [n_rows, num_tiles] fp32
    lse_ptr,  # [n_rows] fp32
    loss_grad_ptr,  # [n_rows] fp32, 0 on ignored rows
    targets_ptr,  # [n_rows] int
    bias_grad_ptr,  # [V] fp32 accumulator, added to; or None: no bias
    # sizes and strides
    n_rows,
    rows_per_program,
    vocab_size,
    stride_buf_n,
    # scalars (softcap, label_smoothing and z_loss_scale None where absent)
    logit_scale,
    softcap,
    label_smoothing,
    z_loss_scale,
    inv_vocab_size,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Turns the stored ``z - tile_max`` of a chunk into grad logits, in place.

    A program owns BLOCK_V columns (one logit tile, so ``tile_max`` is one value a row)
    and walks down ``rows_per_program`` rows; with a bias it walks all of them, which
    gives the bias gradient's column sums without atomics. p = exp((z - m) + m - lse).
    """
    pid_v = tl.program_id(0)
    first_row = tl.program_id(1) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    num_tiles = tl.cdiv(vocab_size, BLOCK_V)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = offs_v < vocab_size
    bias_grad = tl.zeros((BLOCK_V,), tl.float32)
    for n0 in range(first_row, last_row, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        row_mask = offs_n < last_row
        offs_n64 = offs_n.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        ptrs = buffer_ptr + offs_n64[:, None] * stride_buf_n + offs_v[None, :]
        shifted = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
        tile_max = tl.load(tile_max_ptr + offs_n64 * num_tiles + pid_v, mask=row_mask, other=0.0)
        tile_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
        lse = tl.load(lse_ptr + offs_n, mask=row_mask, other=0.0)
        loss_grad = tl.load(loss_grad_ptr + offs_n, mask=row_mask, other=0.0)
        targets = _target_columns(tl.load(targets_ptr + offs_n, mask=row_mask, other=-1), vocab_size)
        logits = shifted + tile_max[:, None]
        probs = tl.exp(shifted + (tile_max - lse)[:, None])
        is_target = offs_v[None, :] == targets[:, None]
        grad = _grad_logits(
            probs, logits, is_target, lse, loss_grad, loss_grad, loss_grad, loss_grad, inv_vocab_size,
            logit_scale, softcap, label_smoothing, z_loss_scale,
            HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing is not None,
            HAS_Z_LOSS=z_loss_scale is not None, HAS_LSE_GRAD=False, HAS_CLASS_WEIGHT=False,
        )
        grad = tl.where(mask, grad, 0.0)
        tl.store(ptrs, grad.to(buffer_ptr.dtype.element_ty), mask=mask)
        if bias_grad_ptr is not None:
            bias_grad += tl.sum(grad, axis=0)
    if bias_grad_ptr is not None:
        acc = tl.load(bias_grad_ptr + offs_v, mask=col_mask, other=0.0)
        tl.store(bias_grad_ptr + offs_v, acc + bias_grad, mask=col_mask)


@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def _grad_from_kept_kernel(
    # pointers
    buffer_ptr,  # [n_rows, V] in: the rows kept by the per-token forward, out: grad logits (in place)
    tile_max_ptr,  # [n_rows, num_tiles] fp32
    row_ref_ptr,  # [n_rows] fp32 reference B_i (the buffer holds exp(z - reference)), or None: z - tile_max
    lse_ptr,  # [n_rows] fp32
    loss_grad_ptr,  # [n_rows] fp32 d out / d loss_i (minus d out / d log_probs_i), 0 on ignored rows
    lse_grad_ptr,  # [n_rows] fp32 d out / d lse_i (the entropy's -e_i H_i), or None
    entropy_grad_ptr,  # [n_rows] fp32 d out / d entropy_i, or None
    targets_ptr,  # [n_rows] int
    bias_grad_ptr,  # [V] fp32 accumulator, added to; or None: no bias
    # sizes and strides
    n_rows,
    rows_per_program,
    vocab_size,
    stride_buf_n,
    # scalars (None where absent)
    logit_scale,
    softcap,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    """The per-token backward of rows kept by the forward: grad logits [n_rows, V] made in place
    from what the forward's sweep stored, with no logit product.

    The buffer holds ``z - tile_max`` (``_tile_stats_kernel`` with a buffer), or with
    ``row_ref_ptr`` the factored sweep's e = exp(z - r), r the tile's reference
    (``_exp_reference`` of its max and B_i; no bias or softcap there), so that p = e exp(r - lse)
    and log p = log e + r - lse. ``_grad_logits`` then gives G as ``_tile_grad_kernel`` does from
    recomputed logits. A program owns BLOCK_V columns (one logit tile: one tile max a row) and
    walks down ``rows_per_program`` rows; with a bias it walks all of them, which gives the bias
    gradient's column sums without atomics."""
    pid_v = tl.program_id(0)
    first_row = tl.program_id(1) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    num_tiles = tl.cdiv(vocab_size, BLOCK_V)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = offs_v < vocab_size
    bias_grad = tl.zeros((BLOCK_V,), tl.float32)
    for n0 in range(first_row, last_row, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        row_mask = offs_n < last_row
        offs_n64 = offs_n.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        ptrs = buffer_ptr + offs_n64[:, None] * stride_buf_n + offs_v[None, :]
        tile_max = tl.load(tile_max_ptr + offs_n64 * num_tiles + pid_v, mask=row_mask, other=0.0)
        lse = tl.load(lse_ptr + offs_n, mask=row_mask, other=0.0)
        if row_ref_ptr is not None:
            reference = _exp_reference(tile_max, tl.load(row_ref_ptr + offs_n, mask=row_mask, other=0.0),
                                       ROW_REFERENCE=True)
            stored = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            probs = stored * tl.exp(reference - lse)[:, None]
            # (the entries flushed to 0 have p = 0: their log is never weighed). The entropy's
            # gradient needs this log at every entry: the hardware's approximate log2 (relative error
            # about 2^-22) is far inside the 16-bit rounding of the stored e, and spares the
            # precise log's polynomial, which bounds the pass by arithmetic.
            clamped = tl.maximum(stored, 2.0**-126)  # (fp32's least normal: a smaller literal is a float64)
            log_stored = libdevice.fast_logf(clamped) if FAST_LOG else tl.log(clamped)
            logits = log_stored + reference[:, None]
        else:
            tile_max = tl.where(tile_max == float("-inf"), 0.0, tile_max)
            shifted = tl.load(ptrs, mask=mask, other=float("-inf")).to(tl.float32)
            logits = shifted + tile_max[:, None]
            probs = tl.exp(shifted + (tile_max - lse)[:, None])
        loss_grad = tl.load(loss_grad_ptr + offs_n, mask=row_mask, other=0.0)
        lse_grad = loss_grad  # (unused without lse_grad_ptr, as entropy_grad without its pointer)
        if lse_grad_ptr is not None:
            lse_grad = tl.load(lse_grad_ptr + offs_n, mask=row_mask, other=0.0)
        entropy_grad = loss_grad
        if entropy_grad_ptr is not None:
            entropy_grad = tl.load(entropy_grad_ptr + offs_n, mask=row_mask, other=0.0)
        targets = _target_columns(tl.load(targets_ptr + offs_n, mask=row_mask, other=-1), vocab_size)
        is_target = offs_v[None, :] == targets[:, None]
        grad = _grad_logits(
            probs, logits, is_target, lse, loss_grad, lse_grad, loss_grad, loss_grad, 0.0,
            logit_scale, softcap, None, None,
            HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=False, HAS_Z_LOSS=False,
            HAS_LSE_GRAD=lse_grad_ptr is not None, HAS_CLASS_WEIGHT=False,
            entropy_grad=entropy_grad, HAS_ENTROPY_GRAD=entropy_grad_ptr is not None,
        )
        grad = tl.where(mask, grad, 0.0)
        tl.store(ptrs, grad.to(buffer_ptr.dtype.element_ty), mask=mask)
        if bias_grad_ptr is not None:
            bias_grad += tl.sum(grad, axis=0)
    if bias_grad_ptr is not None:
        acc = tl.load(bias_grad_ptr + offs_v, mask=col_mask, other=0.0)
        tl.store(bias_grad_ptr + offs_v, acc + bias_grad, mask=col_mask)


@triton.jit
def _factor_rows(
    buffer_ptr, tile_max_ptr, row_max, row_ref, lse, loss_grad, targets, take_out, offs_r, row_mask,
    vocab_size, logit_scale,
    BLOCK_V: tl.constexpr,
    RESCALE_COLS: tl.constexpr,
):
    """Makes the stored exponentials of rows ``offs_r`` the factored gradient's E' and returns
    (r, c) [BLOCK_R] fp32: G = diag(r) E' + diag(c) T (see the module's notes).

    A row's final reference R is its B (``row_ref``), or its max where a tile passed B by more
    than REFERENCE_GAP; the (rare) rows of the latter kind have their tiles rescaled to R here.
    Then r = s g exp(R - lse). A row whose ``take_out`` flag is OUT_ALWAYS, or OUT_IF_IMPROBABLE
    with p_t < RARE_PROBABILITY, stores 0 at its target and gets c = s g (p_t - 1), p_t =
    exp(B - lse) (B is the target's logit wherever the target is in this weight's columns); any
    other row stores E'_it = E_it - exp(lse - R) there, c = 0, and its r
    takes that entry's 16-bit rounding, so that r E'_it = s g (p_t - 1) exactly. BLOCK_V must be
    the logit kernel's tile width; the buffer [rows, V] is contiguous.
    """
    offs_r64 = offs_r.to(tl.int64)
    moved = row_mask & (row_max > row_ref + REFERENCE_GAP)
    reference = tl.where(moved, row_max, row_ref)
    has_grad = loss_grad != 0.0
    factor = tl.where(has_grad, logit_scale * loss_grad * tl.exp(reference - lse), 0.0)

    if tl.max(moved.to(tl.int32), axis=0) > 0:
        num_tiles = tl.cdiv(vocab_size, BLOCK_V)
        for tile in range(0, num_tiles):
            # a tile's columns RESCALE_COLS (a divisor of BLOCK_V) at a time: with many rows a
            # program, a whole tile's pointers and values are more than 4 warps' registers
            for part in tl.static_range(0, BLOCK_V, RESCALE_COLS):
                offs_v = tile * BLOCK_V + part + tl.arange(0, RESCALE_COLS)
                mask = moved[:, None] & (offs_v < vocab_size)[None, :]
                tile_max = tl.load(tile_max_ptr + offs_r64 * num_tiles + tile, mask=moved, other=0.0)
                rescale = tl.exp(_exp_reference(tile_max, row_ref, True) - reference)  # <= 1
                ptrs = buffer_ptr + offs_r64[:, None] * vocab_size + offs_v[None, :]
                values = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(ptrs, (values * rescale[:, None]).to(buffer_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # the target entries below are read after their rescaled store

    at_target = row_mask & has_grad & (targets >= 0) & (targets < vocab_size)
    p_target = tl.exp(row_ref - lse)
    improbable = (take_out == OUT_IF_IMPROBABLE) & (p_target < RARE_PROBABILITY)
    out_of_products = at_target & ((take_out == OUT_ALWAYS) | improbable)
    target_ptrs = buffer_ptr + offs_r64 * vocab_size + targets
    value = tl.load(target_ptrs, mask=at_target, other=0.0).to(tl.float32)
    value = tl.where(out_of_products, 0.0, value - tl.exp(lse - reference))
    stored = value.to(buffer_ptr.dtype.element_ty)
    tl.store(target_ptrs, stored, mask=at_target)
    target_grad = tl.where(out_of_products, logit_scale * loss_grad * (p_target - 1.0), 0.0)
    # E'_it is about 1 - 1/p_t, far from 16 bits' grid when p_t is small, where PyTorch's p_t - 1
    # lies next to -1 and rounds almost exactly. Scaling r by value / stored makes r E'_it exact
    # and moves the rounding, a relative 2^-8 at most, onto the row's other entries, whose sum
    # (1 - p_t) is the target's and whose sum of squares is at most its square: no larger in
    # either gradient, and much smaller where the row's mass is spread.
    stored = stored.to(tl.float32)
    exact = at_target & (stored != 0.0) & (tl.abs(stored) < float("inf"))  # no 0, inf or NaN
    return tl.where(exact, factor * (value / tl.where(exact, stored, 1.0)), factor), target_grad


@triton.jit(do_not_specialize=["n_rows"])
def _row_factors_kernel(
    # pointers
    buffer_ptr,  # [n_rows, V] contiguous, in: exp(z - tile reference) (the factored sweep's), out: E' (in place)
    tile_max_ptr,  # [n_rows, num_tiles] fp32
    row_max_ptr,  # [n_rows] fp32, the max over this weight's vocabulary
    row_ref_ptr,  # [n_rows] fp32 reference B the logit kernel was given
    lse_ptr,  # [n_rows] fp32
    loss_grad_ptr,  # [n_rows] fp32, 0 on rows without gradient
    targets_ptr,  # [n_rows] int, columns of this weight (out of range: no target here)
    take_out_ptr,  # [n_rows] int8: where the target entry leaves the products (``_factor_rows``)
    row_factor_ptr,  # [n_rows] fp32 out: r
    target_grad_ptr,  # [n_rows] fp32 out: c, the target entry where it left the products, else 0
    # sizes
    n_rows,
    vocab_size,
    # scalars
    logit_scale,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The factored gradient's E' (in place), r and c of a chunk's rows (``_factor_rows``),
    once their lse over the whole vocabulary is known."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = offs_r < n_rows
    row_max = tl.load(row_max_ptr + offs_r, mask=row_mask, other=0.0)
    row_ref = tl.load(row_ref_ptr + offs_r, mask=row_mask, other=0.0)
    lse = tl.load(lse_ptr + offs_r, mask=row_mask, other=0.0)
    loss_grad = tl.load(loss_grad_ptr + offs_r, mask=row_mask, other=0.0)
    targets = tl.load(targets_ptr + offs_r, mask=row_mask, other=-1)
    take_out = tl.load(take_out_ptr + offs_r, mask=row_mask, other=0)
    factor, target_grad = _factor_rows(buffer_ptr, tile_max_ptr, row_max, row_ref, lse, loss_grad, targets, take_out,
                                       offs_r, row_mask, vocab_size, logit_scale, BLOCK_V=BLOCK_V, RESCALE_COLS=64)
    tl.store(row_factor_ptr + offs_r, factor, mask=row_mask)
    tl.store(target_grad_ptr + offs_r, target_grad, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _factored_rows_kernel(
    # pointers
    tile_max_ptr,  # [n_rows, num_tiles] fp32 (the factored sweep's, against row_ref)
    tile_sum_exp_ptr,  # [n_rows, num_tiles] fp32
    tile_entropy_ptr,  # [n_rows, num_tiles] fp32, or None: no metrics
    tile_argmax_ptr,  # [n_rows, num_tiles] int32     (with the metrics)
    row_ref_ptr,  # [n_rows] fp32 B, also the target's logit (``row_reference``)
    target_logit_ptr,  # [n_rows] fp32
    targets_ptr,  # [n_rows] int
    take_out_ptr,  # [n_rows] int8: where the target entry leaves the products (``_factor_rows``)
    loss_grad_ptr,  # [n_rows] fp32, 0 on rows without gradient
    buffer_ptr,  # [n_rows, V] contiguous, in: the factored sweep's exponentials, out: E'
    row_max_ptr,  # [n_rows] fp32 out
    row_sum_exp_ptr,  # [n_rows] fp32 out
    row_entropy_ptr,  # [n_rows] fp32 out               (with the metrics)
    row_argmax_ptr,  # [n_rows] int64 out               (with the metrics)
    lse_ptr,  # [n_rows] fp32 out
    loss_ptr,  # [n_rows] fp32 out, 0 on ignored rows
    correct_ptr,  # [n_rows] int32 out                  (with the metrics)
    entropy_ptr,  # [n_rows] fp32 out                   (with the metrics)
    row_factor_ptr,  # [n_rows] fp32 out: r
    target_grad_ptr,  # [n_rows] fp32 out: c, the target entry where it left the products, else 0
    hidden_ptr,  # [n_rows, H] the chunk's hidden rows, unit column stride
    scaled_hidden_ptr,  # [n_rows, H] out: diag(r) hidden, contiguous; or None
    # sizes, strides and scalars
    n_rows,
    vocab_size,
    hidden_size,
    stride_hn,
    ignore_index,
    logit_scale,
    # meta-parameters
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Everything a factored chunk's rows need after its sweep, in one launch, when its weight
    is the whole vocabulary (no merge across shards): the merged statistics (``_merge_tiles``),
    lse, loss and metrics (``_finalize``), E', r and c (``_factor_rows``), and with
    ``scaled_hidden`` the right-hand side of grad_weight's product, diag(r) hidden. (No
    smoothing, no z-loss: the factored sweep has neither.)"""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = offs_r < n_rows
    num_tiles = tl.cdiv(vocab_size, BLOCK_V)  # of the sweep, whose tile width BLOCK_V is
    row_ref = tl.load(row_ref_ptr + offs_r, mask=row_mask, other=0.0)
    row_max, sum_exp, entropy_term, argmax, logit_sum = _merge_tiles(
        tile_max_ptr, tile_sum_exp_ptr, tile_entropy_ptr, tile_argmax_ptr, None, row_ref,
        offs_r, row_mask, num_tiles, BLOCK_R=BLOCK_R, BLOCK_T=BLOCK_T, ACC_DTYPE=tl.float32,
    )
    _store_row_stats(row_max_ptr, row_sum_exp_ptr, row_entropy_ptr, row_argmax_ptr, None,
                     offs_r, row_mask, row_max, sum_exp, entropy_term, argmax, logit_sum)
    targets = tl.load(targets_ptr + offs_r, mask=row_mask, other=ignore_index)
    target_logit = tl.load(target_logit_ptr + offs_r, mask=row_mask, other=0.0)
    lse, loss, correct, entropy = _finalize(
        row_max, tl.where(row_mask, sum_exp, 1.0), entropy_term, argmax, logit_sum, target_logit, targets,
        targets != ignore_index, 0.0, None, None,
    )
    _store_results(lse_ptr, loss_ptr, correct_ptr, entropy_ptr, offs_r, row_mask, lse, loss, correct, entropy)
    loss_grad = tl.load(loss_grad_ptr + offs_r, mask=row_mask, other=0.0)
    take_out = tl.load(take_out_ptr + offs_r, mask=row_mask, other=0)
    factor, target_grad = _factor_rows(buffer_ptr, tile_max_ptr, row_max, row_ref, lse, loss_grad, targets, take_out,
                                       offs_r, row_mask, vocab_size, logit_scale, BLOCK_V=BLOCK_V,
                                       RESCALE_COLS=BLOCK_V)
    tl.store(row_factor_ptr + offs_r, factor, mask=row_mask)
    tl.store(target_grad_ptr + offs_r, target_grad, mask=row_mask)
    if scaled_hidden_ptr is not None:
        offs_r64 = offs_r.to(tl.int64)
        for k in range(0, hidden_size, BLOCK_H):
            offs_h = k + tl.arange(0, BLOCK_H)
            mask = row_mask[:, None] & (offs_h < hidden_size)[None, :]
            h = tl.load(hidden_ptr + offs_r64[:, None] * stride_hn + offs_h[None, :], mask=mask, other=0.0)
            scaled = h.to(tl.float32) * factor[:, None]
            tl.store(scaled_hidden_ptr + offs_r64[:, None] * hidden_size + offs_h[None, :],
                     scaled.to(scaled_hidden_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _order_rows_kernel(
    targets_ptr,  # [n_rows] int
    order_ptr,  # [n_rows] int64 out: the rows with a loss first, each group in row order
    ordered_targets_ptr,  # [n_rows] int64 out: targets[order]
    count_ptr,  # [1] int64 out: how many rows have a loss
    loss_grad_ptr,  # [n_rows] fp32 out: d loss / d loss_i of the ordered rows (1 / count for a mean)
    n_rows,
    ignore_index,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A stable partition of the rows, those with a loss first, a program per BLOCK rows (a launch
    instead of a sort's several: it sits before the first logit sweep). Each program counts the
    rows with a loss before its block and in all (every program reads every target, from L2 after
    the first), then places its block's rows: those with a loss after the ones before them, the
    others after all rows with a loss and the others before them."""
    block_start = tl.program_id(0) * BLOCK
    kept_before = tl.zeros([BLOCK], dtype=tl.int32)
    kept = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        targets = tl.load(targets_ptr + offs, mask=offs < n_rows, other=ignore_index)
        has_loss = (targets != ignore_index).to(tl.int32)
        kept += has_loss
        kept_before += tl.where(start < block_start, has_loss, 0)
    kept = tl.sum(kept, axis=0)
    kept_before = tl.sum(kept_before, axis=0)
    offs = block_start + tl.arange(0, BLOCK)
    mask = offs < n_rows
    targets = tl.load(targets_ptr + offs, mask=mask, other=ignore_index)
    keep = mask & (targets != ignore_index)
    drop = mask & (targets == ignore_index)
    position = tl.where(keep, kept_before + tl.cumsum(keep.to(tl.int32), axis=0) - 1,
                        kept + (block_start - kept_before) + tl.cumsum(drop.to(tl.int32), axis=0) - 1)
    tl.store(order_ptr + position, offs.to(tl.int64), mask=mask)
    tl.store(ordered_targets_ptr + position, targets.to(tl.int64), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(count_ptr, kept.to(tl.int64))
    row_grad = 1.0
    if MEAN:  # rounded as PyTorch's 1 / n: a trainer's mean gives its rows this weight bit for bit
        row_grad = tl.math.div_rn(1.0, kept.to(tl.float32))
    tl.store(loss_grad_ptr + offs, tl.where(offs < kept, row_grad, 0.0), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _picked_logit_dot_kernel(
    hidden_ptr,  # [n_rows, H]
    weight_ptr,  # [V, H]
    targets_ptr,  # [n_rows] int: columns of this weight (out of range: column 0 instead)
    out_ptr,  # [n_rows] fp32 out: z at column c (s * hidden_i . weight_c, then bias and softcap)
    target_logit_ptr,  # [n_rows] fp32 out: the same, NaN where the target is not a column here
    bias_ptr,  # [V], or None
    rows_ptr,  # [n_rows] int64: row i is hidden[rows[i]]; or None: hidden[i]
    n_rows,
    vocab_size,
    hidden_size,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    logit_scale,
    softcap,  # or None
    INPUT_PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One logit per row, at its target column (column 0 where the target is not a column of this
    weight): the reference B of the factored gradient, a lower bound of the row's max that is
    close to it wherever the target is not extremely unlikely, and the target's logit of the loss
    (NaN where the target is not a column of this weight). Each is taken from a product on the
    tensor cores, hidden[BLOCK_R rows] @ weight[their target columns].T [BLOCK_R, BLOCK_R], which holds them on
    its diagonal. The product adds each logit's H terms in the same order of K steps as the
    logit kernel's tiles (a wgmma output sums its own terms, whatever N; BLOCK_R = 64 keeps the
    product on wgmma), so that z_t carries the rounding of the lse's logits and the loss lse - z_t
    cancels it, where an exact fp32 dot product leaves it (about 1e-5 of the loss on the Llama-3
    head). Bias, scale and softcap follow in ``_tile_logits``'s operations, so that z_t is the
    tiles' value bit for bit."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = offs_r < n_rows
    targets = tl.load(targets_ptr + offs_r, mask=row_mask, other=0)
    local = (targets >= 0) & (targets < vocab_size)
    columns = tl.where(local, targets, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    load_r = (offs_r % n_rows).to(tl.int64)  # rows past the end wrap onto valid ones, not stored
    if rows_ptr is not None:  # the rows of a whole step's order, read in place instead of gathered by chunk
        load_r = tl.load(rows_ptr + load_r)
    h_ptrs = hidden_ptr + load_r[:, None] * stride_hn + offs_k[None, :] * stride_hk  # [BLOCK_R, BLOCK_K]
    w_ptrs = weight_ptr + columns[None, :] * stride_wv + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_R]
    acc = tl.zeros((BLOCK_R, BLOCK_R), tl.float32)
    for k in range(0, tl.cdiv(hidden_size, BLOCK_K)):
        k_mask = offs_k < hidden_size - k * BLOCK_K  # zeros past H, as the copy engine fills them
        h = tl.load(h_ptrs, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(h, w, acc, input_precision=INPUT_PRECISION)
        h_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk
    on_diagonal = tl.arange(0, BLOCK_R)[:, None] == tl.arange(0, BLOCK_R)[None, :]
    picked = tl.sum(tl.where(on_diagonal, acc, 0.0), axis=1)  # exact: one term at most a row is not zero
    if bias_ptr is not None:
        picked = picked + tl.load(bias_ptr + columns).to(tl.float32)
    picked = picked * logit_scale
    if softcap is not None:
        picked = softcap * _tanh(picked / softcap)
    tl.store(out_ptr + offs_r, picked, mask=row_mask)
    tl.store(target_logit_ptr + offs_r, tl.where(local, picked, float("nan")), mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _scale_rows_kernel(
    src_ptr,  # [n_rows, n_cols] any float dtype, any strides
    factor_ptr,  # [n_rows] fp32
    dst_ptr,  # [*, n_cols] out, unit column stride: row i of the result goes to row dst_rows[i] (or i)
    dst_rows_ptr,  # [n_rows] int64, or None: row i
    target_grad_ptr,  # [n_rows] fp32 c, or None: no target terms
    targets_ptr,  # [n_rows] int, columns of weight   (with target_grad_ptr; out of range: no term)
    weight_ptr,  # [V, n_cols] any strides            (with target_grad_ptr)
    n_rows,
    n_cols,
    vocab_size,
    stride_src_row,
    stride_src_col,
    stride_dst,
    stride_wv,
    stride_wk,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dst[dst_rows[i]] = factor[i] * src[i] (+ c[i] * weight[targets[i]] with target terms: the
    factored grad_hidden's target term), computed in fp32 and rounded once to dst's dtype."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = offs_r < n_rows
    mask = row_mask[:, None] & (offs_c < n_cols)[None, :]
    factor = tl.load(factor_ptr + offs_r, mask=row_mask, other=0.0)
    src_ptrs = src_ptr + offs_r.to(tl.int64)[:, None] * stride_src_row + offs_c[None, :] * stride_src_col
    src = tl.load(src_ptrs, mask=mask, other=0.0)
    dst_rows = offs_r.to(tl.int64)
    if dst_rows_ptr is not None:
        dst_rows = tl.load(dst_rows_ptr + offs_r, mask=row_mask, other=0)
    value = src.to(tl.float32) * factor[:, None]
    if target_grad_ptr is not None:
        targets = tl.load(targets_ptr + offs_r, mask=row_mask, other=-1)
        target_grad = tl.load(target_grad_ptr + offs_r, mask=row_mask, other=0.0)
        # only the rows whose target entry left the products (c != 0) read their row of weight
        has_target = row_mask & (targets >= 0) & (targets < vocab_size) & (target_grad != 0.0)
        w_ptrs = (weight_ptr + tl.where(has_target, targets, 0).to(tl.int64)[:, None] * stride_wv
                  + offs_c[None, :] * stride_wk)
        w_t = tl.load(w_ptrs, mask=has_target[:, None] & (offs_c < n_cols)[None, :], other=0.0)
        value += target_grad[:, None] * w_t.to(tl.float32)
    tl.store(dst_ptr + dst_rows[:, None] * stride_dst + offs_c[None, :], value.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _zero_rows_kernel(
    dst_ptr,  # [*, n_cols], unit column stride
    rows_ptr,  # [n_rows] int64 rows of dst
    n_rows,
    n_cols,
    stride_dst,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dst[rows[i]] = 0 for i < n_rows: a program per BLOCK_R rows x BLOCK_C columns, in vector
    stores (the grad_hidden rows of the rows a step skips)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = offs_r < n_rows
    rows = tl.load(rows_ptr + offs_r, mask=row_mask, other=0)
    zeros = tl.zeros((BLOCK_R, BLOCK_C), dtype=dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + rows[:, None] * stride_dst + offs_c[None, :], zeros,
             mask=row_mask[:, None] & (offs_c < n_cols)[None, :])


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _targets_out_of_range_kernel(
    targets_ptr,  # [n_rows] int
    flag_ptr,  # [1] int32, zero on entry: set to 1 if a target is out of range
    n_rows,
    vocab_size,
    ignore_index,
    BLOCK: tl.constexpr,
):
    """flag = 1 where a target is neither a column of the (whole) vocabulary nor
    ``ignore_index``; every program that finds one stores the same 1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    targets = tl.load(targets_ptr + offs, mask=offs < n_rows, other=0)
    bad = (offs < n_rows) & ((targets < 0) | (targets >= vocab_size)) & (targets != ignore_index)
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.store(flag_ptr, 1)


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _mean_grad_ratio_kernel(
    row_grad_ptr,  # [n_rows] fp32: d out / d log_probs_i
    targets_ptr,  # [n_rows] int
    out_ptr,  # [2] fp32 out: 1 if every row with a target has the same gradient c (else 0), then -c / w
    n_rows,
    ignore_index,
    BLOCK: tl.constexpr,
):
    """Whether a per-token backward's gradient of log_probs is one value c on every row with a
    target, and the ratio -c / w, with w = 1 / count the weight of a mean over those rows (both
    divisions rounded as PyTorch's): the sweep's gradients of the mean of -log_probs times the
    ratio are the wanted ones, and the ratio is exactly 1 where c = -1 / count. One program:
    the rows of a call are a few thousand (a NaN gradient is never uniform)."""
    offs = tl.arange(0, BLOCK)
    first = tl.full([BLOCK], n_rows, dtype=tl.int32)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offs
        targets = tl.load(targets_ptr + rows, mask=rows < n_rows, other=ignore_index)
        valid = (rows < n_rows) & (targets != ignore_index)
        count += valid.to(tl.int32)
        first = tl.minimum(first, tl.where(valid, rows, n_rows))
    count = tl.sum(count, axis=0)
    first = tl.min(first, axis=0)
    common = tl.load(row_grad_ptr + first, mask=first < n_rows, other=0.0)
    differ = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offs
        targets = tl.load(targets_ptr + rows, mask=rows < n_rows, other=ignore_index)
        valid = (rows < n_rows) & (targets != ignore_index)
        grad = tl.load(row_grad_ptr + rows, mask=valid, other=0.0)
        differ += (valid & (grad != common)).to(tl.int32)
    weight = tl.math.div_rn(1.0, tl.maximum(count, 1).to(tl.float32))
    tl.store(out_ptr, (tl.sum(differ, axis=0) == 0).to(tl.float32))
    tl.store(out_ptr + 1, tl.math.div_rn(-common, weight))


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _count_targets_kernel(
    targets_ptr,  # [n_rows] int: each row's column of this weight (out of range: none)
    counts_ptr,  # [V] int32, zero on entry: the rows of each column
    n_rows,
    vocab_size,
    ignore_index,
    BLOCK: tl.constexpr,
):
    """counts[t] += 1 for each row whose target t is a column here and not ``ignore_index``.
    Integer atomics are exact, so the counts do not depend on the order the rows come in."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    targets = tl.load(targets_ptr + offs, mask=offs < n_rows, other=-1)
    counted = (offs < n_rows) & (targets >= 0) & (targets < vocab_size) & (targets != ignore_index)
    tl.atomic_add(counts_ptr + tl.where(counted, targets, 0), tl.full([BLOCK], 1, tl.int32), mask=counted)


@triton.jit(do_not_specialize=["n_rows", "ignore_index", "rare_count", "improbable_count"])
def _take_out_flags_kernel(
    targets_ptr,  # [n_rows] int
    counts_ptr,  # [V] int32 from _count_targets_kernel
    flags_ptr,  # [n_rows] int8 out: 0, OUT_ALWAYS or OUT_IF_IMPROBABLE
    n_rows,
    vocab_size,
    ignore_index,
    rare_count,  # OUT_ALWAYS where the target is of at most this many rows
    improbable_count,  # OUT_IF_IMPROBABLE where it is of at most this many (and more than rare_count)
    BLOCK: tl.constexpr,
):
    """Each row's take_out flag (see ``_factor_rows``) from its target's count of rows; 0 for
    rows without a target here."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    targets = tl.load(targets_ptr + offs, mask=offs < n_rows, other=-1)
    counted = (offs < n_rows) & (targets >= 0) & (targets < vocab_size) & (targets != ignore_index)
    count = tl.load(counts_ptr + tl.where(counted, targets, 0), mask=counted, other=0)
    flags = tl.where(count <= rare_count, OUT_ALWAYS, tl.where(count <= improbable_count, OUT_IF_IMPROBABLE, 0))
    tl.store(flags_ptr + offs, tl.where(counted, flags, 0).to(tl.int8), mask=offs < n_rows)


@triton.jit(do_not_specialize=["n_rows"])
def _target_keys_kernel(
    targets_ptr,  # [n_rows] int
    target_grad_ptr,  # [n_rows] fp32 c of each row (0: no term)
    keys_ptr,  # [n_rows] int16 or int32 out: the target where the row has a term, else V
    n_rows,
    vocab_size,
    BLOCK: tl.constexpr,
):
    """The sort keys of ``_target_segments_kernel``: each row's target where it has a term (c != 0
    and a column of this weight), V elsewhere, so that every key lies in [0, V]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_rows
    targets = tl.load(targets_ptr + offs, mask=mask, other=-1)
    target_grad = tl.load(target_grad_ptr + offs, mask=mask, other=0.0)
    has_term = (target_grad != 0) & (targets >= 0) & (targets < vocab_size)
    tl.store(keys_ptr + offs, tl.where(has_term, targets, vocab_size).to(keys_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _target_segments_kernel(
    acc_ptr,  # [V, H] grad_weight's sum (any float dtype, unit column stride), updated in place
    sorted_keys_ptr,  # [n_rows] int16 or int32: ``_target_keys_kernel``'s keys sorted (stably)
    perm_ptr,  # [n_rows] int64: the row of each sorted position
    target_grad_ptr,  # [n_rows] fp32 c of each row
    hidden_ptr,  # [*, H]
    hidden_rows_ptr,  # [n_rows] int64: row i's row of hidden, or None: row i
    n_rows,
    vocab_size,
    hidden_size,
    stride_acc,
    stride_hn,
    stride_hk,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """grad_weight's target terms: acc[t] += sum over the rows i with target t of c_i h_i, for
    columns BLOCK_H x program_id(1). Each program takes BLOCK_P sorted positions at a time
    (grid-stride), and stops at the first block whose keys are all V: past it no row has a term.
    The first position of each target's segment sums its rows in fp32, one a step in the sorted
    order (deterministic), while the BLOCK_P segments of a block go in parallel, and the sum meets
    acc's entry in one rounding. The next key is loaded with each row, so that a segment of one
    row takes one step."""
    offs_p = tl.arange(0, BLOCK_P)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden_size
    start = tl.program_id(0) * BLOCK_P
    keys = tl.load(sorted_keys_ptr + start + offs_p, mask=start + offs_p < n_rows, other=vocab_size)
    while tl.min(keys, axis=0) < vocab_size:
        positions = start + offs_p
        previous = tl.load(sorted_keys_ptr + positions - 1, mask=(positions > 0) & (positions < n_rows), other=-1)
        leader = (keys != previous) & (keys < vocab_size)
        acc_ptrs = acc_ptr + keys.to(tl.int64)[:, None] * stride_acc + offs_h[None, :]  # V * H can pass 2^31
        acc_mask = leader[:, None] & mask_h[None, :]
        acc = tl.load(acc_ptrs, mask=acc_mask, other=0.0).to(tl.float32)
        total = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
        in_segment = leader
        while tl.max(in_segment.to(tl.int32), axis=0) > 0:
            rows = tl.load(perm_ptr + positions, mask=in_segment, other=0)
            following = tl.load(sorted_keys_ptr + positions + 1, mask=in_segment & (positions + 1 < n_rows),
                                other=vocab_size)
            target_grad = tl.load(target_grad_ptr + rows, mask=in_segment, other=0.0)
            if hidden_rows_ptr is not None:
                rows = tl.load(hidden_rows_ptr + rows, mask=in_segment, other=0)
            h = tl.load(hidden_ptr + rows[:, None] * stride_hn + offs_h[None, :] * stride_hk,
                        mask=in_segment[:, None] & mask_h[None, :], other=0.0)
            total += target_grad[:, None] * h.to(tl.float32)
            in_segment = in_segment & (following == keys)
            positions += 1
        tl.store(acc_ptrs, (acc + total).to(acc_ptr.dtype.element_ty), mask=acc_mask)
        start += tl.num_programs(0) * BLOCK_P
        keys = tl.load(sorted_keys_ptr + start + offs_p, mask=start + offs_p < n_rows, other=vocab_size)


@triton.jit
def _scale_kernel(
    x_ptr,  # [numel] any float dtype, scaled in place
    scale_ptr,  # [1] fp32
    numel,
    BLOCK: tl.constexpr,
):
    """x *= scale in place; a no-op without memory traffic when scale == 1 (the usual
    ``loss.backward()``), decided on the device so that no host sync is needed."""
    scale = tl.load(scale_ptr)
    if scale != 1.0:
        # Grid-stride loop with int64 offsets: numel can pass 2^31.
        start = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        offs = tl.arange(0, BLOCK)
        while start < numel:
            mask = start + offs < numel
            x = tl.load(x_ptr + start + offs, mask=mask).to(tl.float32)
            tl.store(x_ptr + start + offs, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)
            start += step
