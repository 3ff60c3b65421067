"""Row finalisation and the gradient passes over a chunk's buffer: lse, loss and metrics from
the merged statistics; grad logits made in place from what the sweep stored; and the factored
gradient's per-row factors. See ``_kernel_math`` for the notation.

Factored gradients (``_tile_kernels._tile_stats_kernel`` with a buffer and row references). Given a reference
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

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._kernel_math import (
    OUT_ALWAYS,
    OUT_IF_IMPROBABLE,
    RARE_PROBABILITY,
    REFERENCE_GAP,
    _exp_reference,
    _grad_logits,
    _target_columns,
)
from ._launch import contiguous_rows, interpreting, scale_and_cap, smoothing_and_z_loss, unit_columns
from ._options import LossOptions, RowResults, RowStats
from ._tile_kernels import _merge_tiles, _store_row_stats


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

    The buffer holds ``z - tile_max`` (``_tile_kernels._tile_stats_kernel`` with a buffer), or with
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
    targets_ptr,  # [n_rows] int
    take_out_ptr,  # [n_rows] int8: where the target entry leaves the products (``_factor_rows``)
    loss_grad_ptr,  # [n_rows] fp32, 0 on rows without gradient
    buffer_ptr,  # [n_rows, V] contiguous, in: the factored sweep's exponentials, out: E'
    row_max_ptr,  # a row pair out: row_max, then sum_exp (relative to it), both [n_rows] fp32
    row_entropy_ptr,  # [n_rows] fp32 out               (with the metrics)
    row_argmax_ptr,  # [n_rows] int64 out               (with the metrics)
    lse_ptr,  # [n_rows] fp32 out
    loss_ptr,  # [n_rows] fp32 out, 0 on ignored rows
    correct_ptr,  # [n_rows] int32 out                  (with the metrics)
    entropy_ptr,  # [n_rows] fp32 out                   (with the metrics)
    row_factor_ptr,  # a row pair out: r, then c (the target entry where it left the products, else 0)
    hidden_ptr,  # [n_rows, H] the chunk's hidden rows, contiguous
    scaled_hidden_ptr,  # [n_rows, H] out: diag(r) hidden, contiguous; or None
    # sizes and scalars
    n_rows,
    vocab_size,
    hidden_size,
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
    smoothing, no z-loss: the factored sweep has neither.) The target's logit is B where the
    target is a column (every target of a row with a loss, on the whole vocabulary), NaN elsewhere,
    as ``row_reference`` gives it. A row pair is two [n_rows] arrays in one buffer, the second
    ``row_pair_stride(n_rows)`` entries after the first (``row_pair``)."""
    pair_stride = tl.cdiv(n_rows, 4) * 4  # (``row_pair_stride``)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = offs_r < n_rows
    num_tiles = tl.cdiv(vocab_size, BLOCK_V)  # of the sweep, whose tile width BLOCK_V is
    row_ref = tl.load(row_ref_ptr + offs_r, mask=row_mask, other=0.0)
    row_max, sum_exp, entropy_term, argmax, logit_sum = _merge_tiles(
        tile_max_ptr, tile_sum_exp_ptr, tile_entropy_ptr, tile_argmax_ptr, None, row_ref,
        offs_r, row_mask, num_tiles, BLOCK_R=BLOCK_R, BLOCK_T=BLOCK_T, ACC_DTYPE=tl.float32,
    )
    _store_row_stats(row_max_ptr, row_max_ptr + pair_stride, row_entropy_ptr, row_argmax_ptr, None,
                     offs_r, row_mask, row_max, sum_exp, entropy_term, argmax, logit_sum)
    targets = tl.load(targets_ptr + offs_r, mask=row_mask, other=ignore_index)
    target_logit = tl.where((targets >= 0) & (targets < vocab_size), row_ref, float("nan"))
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
    tl.store(row_factor_ptr + pair_stride + offs_r, target_grad, mask=row_mask)
    if scaled_hidden_ptr is not None:
        offs_r64 = offs_r.to(tl.int64)
        for k in range(0, hidden_size, BLOCK_H):
            offs_h = k + tl.arange(0, BLOCK_H)
            mask = row_mask[:, None] & (offs_h < hidden_size)[None, :]
            offs = offs_r64[:, None] * hidden_size + offs_h[None, :]
            scaled = tl.load(hidden_ptr + offs, mask=mask, other=0.0).to(tl.float32) * factor[:, None]
            tl.store(scaled_hidden_ptr + offs, scaled.to(scaled_hidden_ptr.dtype.element_ty), mask=mask)


# ---- launches ---------------------------------------------------------------------------
class TileState(NamedTuple):
    """What a chunk's sweep leaves for its gradient: each (row, tile)'s max [rows, num_tiles]
    and the tile width it was swept with, which the passes over its buffer must use too."""

    tile_max: torch.Tensor
    block_v: int


class FactoredSweep(NamedTuple):
    """What a factored chunk's sweep leaves for its rows' pass (``factored_rows``)."""

    tile_stats: tuple  # (max, sum_exp, entropy term, argmax) [rows, num_tiles], the last two None without metrics
    row_ref: torch.Tensor  # [rows] fp32 B
    target_logit: torch.Tensor  # [rows] fp32
    block_v: int
    num_tiles: int


def finalize(stats: RowStats, targets, opts: LossOptions, vocab_size: int, out: RowResults,
             return_metrics: bool = False) -> None:
    """Writes lse and loss of each row to ``out`` from its merged statistics, and with
    ``return_metrics`` its correctness and entropy."""
    n_rows = targets.shape[0]
    entropy_term, argmax, correct, entropy = ((stats.entropy_term, stats.argmax, out.correct, out.entropy)
                                              if return_metrics else (None,) * 4)
    block_r = 128
    _finalize_rows_kernel[(triton.cdiv(n_rows, block_r),)](
        stats.row_max, stats.sum_exp, entropy_term, argmax, stats.logit_sum if opts.has_smoothing else None,
        stats.target_logit, targets, out.lse, out.loss, correct, entropy,
        n_rows, opts.ignore_index, opts.inv_vocab_size(vocab_size), *smoothing_and_z_loss(opts),
        BLOCK_R=block_r,
    )


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
    _grad_from_shifted_kernel[grid](
        buffer, state.tile_max, lse, loss_grad, targets, bias_grad_acc,
        n_rows, rows_per_program, vocab_size, buffer.stride(0),
        float(opts.logit_scale), scale_and_cap(opts)[1], *smoothing_and_z_loss(opts), opts.inv_vocab_size(vocab_size),
        BLOCK_N=16 if interpreting() else 32,
        BLOCK_V=block_v,
        num_warps=8,
    )
    return buffer


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
    _grad_from_kept_kernel[grid](
        buffer, state.tile_max, row_ref, lse, loss_grad, lse_grad, entropy_grad, targets, bias_grad_acc,
        n_rows, rows_per_program, vocab_size, buffer.stride(0), *scale_and_cap(opts),
        BLOCK_N=16 if interpreting() else 32,
        BLOCK_V=state.block_v,
        FAST_LOG=not interpreting(),  # (the interpreter has no libdevice)
        num_warps=8,
    )
    return buffer


def _take_out(take_out: torch.Tensor | None, n_rows: int, device: torch.device) -> torch.Tensor:
    """The rows' take_out flags [rows] int8 (``_kernel_math``: 0, OUT_ALWAYS, OUT_IF_IMPROBABLE);
    zeros (every target entry in the products) for None."""
    return take_out if take_out is not None else torch.zeros(n_rows, device=device, dtype=torch.int8)


def row_factors(buffer, state, row_max, row_ref, lse, loss_grad, targets, opts: LossOptions,
                take_out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Turns the exponentials stored by ``row_stats(row_ref=...)`` into E' in place and returns
    (r, c) [rows] fp32 such that the chunk's grad logits are diag(r) E' + diag(c) T (see this
    module's notes); ``take_out`` [rows] int8 (None: none) flags the rows whose target entry
    leaves the products (``_factor_rows``)."""
    n_rows, vocab_size = buffer.shape
    assert buffer.stride() == (vocab_size, 1), "the kernel reads a contiguous buffer"
    row_factor = torch.empty(n_rows, device=buffer.device, dtype=torch.float32)
    target_grad = torch.empty_like(row_factor)
    block_r = 16  # more rows a program take more registers than 4 warps have (compile_sm90.py)
    _row_factors_kernel[(triton.cdiv(n_rows, block_r),)](
        buffer, state.tile_max, row_max, row_ref, lse, loss_grad, targets, _take_out(take_out, n_rows, buffer.device),
        row_factor, target_grad,
        n_rows, vocab_size, float(opts.logit_scale),
        BLOCK_R=block_r, BLOCK_V=state.block_v, num_warps=4,
    )
    return row_factor, target_grad


def row_pair_stride(n_rows: int) -> int:
    """Entries from the first array of a row pair (``row_pair``) to the second: ``n_rows`` rounded up
    to a multiple of 4, so that the second starts 16-byte aligned, as the kernels that read it
    later specialise on."""
    return triton.cdiv(n_rows, 4) * 4


def row_pair(n_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 arrays [n_rows] in one buffer, the second ``row_pair_stride(n_rows)`` entries after
    the first: one pointer of a kernel for both."""
    pair = torch.empty((2, row_pair_stride(n_rows)), device=device, dtype=torch.float32)
    return pair[0, :n_rows], pair[1, :n_rows]


def factored_rows(sweep: FactoredSweep, hidden, targets, opts: LossOptions, buffer, loss_grad, out: RowResults,
                  scaled_hidden=None, return_metrics=False, take_out=None):
    """The pass over a factored chunk's rows after its sweep, in one launch: what ``row_stats``'
    merge, ``finalize`` (into ``out``) and ``row_factors`` do, and with ``scaled_hidden`` [rows, H]
    (contiguous) also diag(r) hidden written there. ``take_out`` [rows] int8 (None: none) flags the
    rows whose target entry leaves the products. Returns (stats, r, c): r and c [rows] fp32,
    G = diag(r) E' + diag(c) T (see this module's notes). ``sweep.target_logit`` must be
    ``row_reference``'s (the kernel takes it from B)."""
    n_rows, hidden_size = hidden.shape
    vocab_size = buffer.shape[1]
    device = hidden.device
    assert unit_columns(hidden) and buffer.stride() == (vocab_size, 1)
    assert sweep.num_tiles == triton.cdiv(vocab_size, sweep.block_v)
    assert scaled_hidden is None or scaled_hidden.is_contiguous()
    f32 = dict(device=device, dtype=torch.float32)
    row_max, sum_exp = row_pair(n_rows, device)
    stats = RowStats(row_max=row_max, sum_exp=sum_exp, target_logit=sweep.target_logit,
                     entropy_term=torch.empty(n_rows, **f32) if return_metrics else None,
                     argmax=torch.empty(n_rows, device=device, dtype=torch.int64) if return_metrics else None)
    row_factor, target_grad = row_pair(n_rows, device)
    # Two rows a program and 1024 columns a step: the hidden rows' scaling is bound by memory, and
    # the more programs the more loads in flight (half the time of 8 rows and 256 columns;
    # docs/design.md).
    block_r = 2
    _factored_rows_kernel[(triton.cdiv(n_rows, block_r),)](
        *sweep.tile_stats, sweep.row_ref, targets, _take_out(take_out, n_rows, device), loss_grad,
        buffer, stats.row_max, stats.entropy_term, stats.argmax,
        out.lse, out.loss, out.correct, out.entropy, row_factor, contiguous_rows(hidden), scaled_hidden,
        n_rows, vocab_size, hidden_size, opts.ignore_index, float(opts.logit_scale),
        BLOCK_R=block_r,
        BLOCK_T=min(128, triton.next_power_of_2(sweep.num_tiles)),
        BLOCK_V=sweep.block_v,
        BLOCK_H=32 if interpreting() else 1024,
    )
    return stats, row_factor, target_grad
