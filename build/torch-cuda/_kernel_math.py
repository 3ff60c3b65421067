"""The maths that every Triton kernel of the loss shares: its constants and @triton.jit helpers.

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
"""

import triton
import triton.language as tl

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

# A row's take_out flag (``_row_kernels._factor_rows``): its target entry stays in the bf16 products (0), leaves
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
