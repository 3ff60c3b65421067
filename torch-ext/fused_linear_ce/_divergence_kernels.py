"""The row kernel of the student/teacher divergence (``distillation.py``), and its launch.

For a row, from the raw logits x (student) and y (teacher) of a chunk, fp32 (fp64 for fp64
inputs) as cuBLAS wrote them, with each side's bias b, scale s and softcap c already divided by
the temperature T (c tanh(s x / c) / T = (c / T) tanh((s / T) x / (c / T))):

    u_j = c tanh(s (x_j + b_j) / c)   (s (x_j + b_j) without a softcap)   student, p = softmax(u)
    v_j = the same of y with the teacher's b, s, c                        teacher, q = softmax(v)
    lp = u - lse(u),  lq = v - lse(v),  entropy = lse(u) - sum_j p_j u_j
    beta = 0:  D = sum_j q_j (lq_j - lp_j)                     dD/du_j = p_j - q_j
    beta = 1:  D = sum_j p_j (lp_j - lq_j)                     dD/du_j = p_j (lp_j - lq_j - D)
    else:      lm = log((1 - beta) p + beta q),  a_j = (1 - beta) (lp_j - lm_j),
               D = beta sum_j q_j (lq_j - lm_j) + sum_j p_j a_j  dD/du_j = p_j (a_j - sum_k p_k a_k)
    du_j/dx_j = s (1 - (u_j / c)^2)   (s without a softcap)

(the JSD's dD/dp_j = (1 - beta) (lp_j - lm_j): the terms of d lm / d p cancel against the
mixture's own weights), and the gradient G_j = f dD/du_j du_j/dx_j, f the row's upstream factor,
goes over the student's logits in place, in the gradient buffer's dtype.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ._kernel_math import _tanh

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2


@triton.jit
def _final_logits(logits_ptr, bias_ptr, cols, mask, scale, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """u = softcap tanh(scale (x + b) / softcap) of one block of a row (scale (x + b) without
    SOFTCAP), -inf on the columns past the row: [BLOCK_V] in the buffer's dtype."""
    x = tl.load(logits_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(x.dtype)
    u = x * scale
    if SOFTCAP:
        u = softcap * _tanh(u / softcap)
    return tl.where(mask, u, float("-inf"))


@triton.jit
def _online(row_max, sum_exp, block):
    """Merges a block [BLOCK_V] into a row's running max and sum of exp(u - max): (new max, new
    sum, the factor exp(old max - new max) that rescales the row's other running sums, and the
    block's exp(u - new max))."""
    new_max = tl.maximum(row_max, tl.max(block, 0))
    rescale = tl.exp(row_max - new_max)
    exp_block = tl.exp(block - new_max)
    return new_max, sum_exp * rescale + tl.sum(exp_block, 0), rescale, exp_block


@triton.jit
def _divergence_rows_kernel(
    student_ptr, teacher_ptr, grad_ptr,  # [rows, V] logits (contiguous), [rows, grad_row_stride]
    student_bias_ptr, teacher_bias_ptr,  # [V] or unused
    row_grad_ptr, divergence_ptr, entropy_ptr,  # [rows]
    n_cols, grad_row_stride,
    beta, student_scale, student_softcap, teacher_scale, teacher_softcap, grad_scale,
    MODE: tl.constexpr, STUDENT_BIAS: tl.constexpr, TEACHER_BIAS: tl.constexpr,
    STUDENT_SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    ROW_GRADS: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program a row: the divergence and the student's entropy of the row (module
    docstring), and with WRITE_GRAD its gradient G over the raw student logits, written to
    ``grad_ptr`` (which may alias ``student_ptr``: each block is read before it is written, and a
    16-bit row written over an fp32 one ends before the part not yet read), times
    ``grad_scale`` (and the row's ``row_grad_ptr`` entry with ROW_GRADS)."""
    row = tl.program_id(0).to(tl.int64)
    student_row = student_ptr + row * n_cols
    teacher_row = teacher_ptr + row * n_cols
    offsets = tl.arange(0, BLOCK_V)
    zero = tl.sum(tl.zeros([BLOCK_V], student_ptr.dtype.element_ty), 0)
    s_max, s_sum, s_dot = zero - float("inf"), zero, zero
    t_max, t_sum, kl_dot = zero - float("inf"), zero, zero
    # Pass 1: both log-sum-exps, sum_j p_j u_j and, for the KLs, their sums over the logits.
    for start in range(0, n_cols, BLOCK_V):
        cols = start + offsets
        mask = cols < n_cols
        u = _final_logits(student_row, student_bias_ptr, cols, mask, student_scale, student_softcap,
                          STUDENT_BIAS, STUDENT_SOFTCAP)
        v = _final_logits(teacher_row, teacher_bias_ptr, cols, mask, teacher_scale, teacher_softcap,
                          TEACHER_BIAS, TEACHER_SOFTCAP)
        gap = tl.where(mask, u - v, 0.0)
        s_max, s_sum, s_rescale, s_exp = _online(s_max, s_sum, u)
        s_dot = s_dot * s_rescale + tl.sum(s_exp * tl.where(mask, u, 0.0), 0)
        t_max, t_sum, t_rescale, t_exp = _online(t_max, t_sum, v)
        if MODE == 1:  # sum_j exp(u_j - max) (u_j - v_j), relative to the student's max
            kl_dot = kl_dot * s_rescale + tl.sum(s_exp * gap, 0)
        elif MODE == 0:  # sum_j exp(v_j - max) (v_j - u_j), relative to the teacher's
            kl_dot = kl_dot * t_rescale - tl.sum(t_exp * gap, 0)
    s_lse = s_max + tl.log(s_sum)
    t_lse = t_max + tl.log(t_sum)
    entropy = s_lse - s_dot / s_sum
    if MODE == 0:
        divergence = kl_dot / t_sum - t_lse + s_lse
    elif MODE == 1:
        divergence = kl_dot / s_sum - s_lse + t_lse
    else:
        # Pass 2 (JSD): the mixture needs both lse's first.
        beta = zero + beta  # (in the rows' dtype: a float argument is fp32, exact where beta is an fp32 number)
        log_keep = tl.log(1.0 - beta)
        log_beta = tl.log(beta)
        teacher_part, mean_a = zero, zero
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            mask = cols < n_cols
            lp = _final_logits(student_row, student_bias_ptr, cols, mask, student_scale, student_softcap,
                               STUDENT_BIAS, STUDENT_SOFTCAP) - s_lse
            lq = _final_logits(teacher_row, teacher_bias_ptr, cols, mask, teacher_scale, teacher_softcap,
                               TEACHER_BIAS, TEACHER_SOFTCAP) - t_lse
            lm = _log_mixture(lp, lq, log_keep, log_beta)
            teacher_part += tl.sum(tl.where(mask, tl.exp(lq) * (lq - lm), 0.0), 0)
            mean_a += tl.sum(tl.where(mask, tl.exp(lp) * (lp - lm), 0.0), 0)
        mean_a = (1.0 - beta) * mean_a
        divergence = beta * teacher_part + mean_a
    tl.store(divergence_ptr + row, divergence)
    tl.store(entropy_ptr + row, entropy)
    if WRITE_GRAD:
        factor = grad_scale
        if ROW_GRADS:
            factor = factor * tl.load(row_grad_ptr + row)
        grad_row = grad_ptr + row * grad_row_stride
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            mask = cols < n_cols
            u = _final_logits(student_row, student_bias_ptr, cols, mask, student_scale, student_softcap,
                              STUDENT_BIAS, STUDENT_SOFTCAP)
            lp = u - s_lse
            p = tl.exp(lp)
            lq = _final_logits(teacher_row, teacher_bias_ptr, cols, mask, teacher_scale, teacher_softcap,
                               TEACHER_BIAS, TEACHER_SOFTCAP) - t_lse
            if MODE == 0:
                grad_u = p - tl.exp(lq)
            elif MODE == 1:
                grad_u = p * (lp - lq - divergence)
            else:
                grad_u = p * ((1.0 - beta) * (lp - _log_mixture(lp, lq, log_keep, log_beta)) - mean_a)
            if STUDENT_SOFTCAP:
                ratio = u / student_softcap
                grad_u = grad_u * (1.0 - ratio * ratio)
            grad_x = tl.where(mask, grad_u * (student_scale * factor), 0.0)
            tl.store(grad_row + cols, grad_x.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _log_mixture(lp, lq, log_keep, log_beta):
    """log((1 - beta) p + beta q) from log p, log q and log(1 - beta), log(beta) (log-add-exp)."""
    a = lp + log_keep
    b = lq + log_beta
    high = tl.maximum(a, b)
    return high + tl.log(1.0 + tl.exp(tl.minimum(a, b) - high))


def interpreted() -> bool:
    """Whether the row kernel runs in Triton's interpreter (TRITON_INTERPRET=1 when this module was
    first imported): CPU tensors can take it then, and only then."""
    return isinstance(_divergence_rows_kernel, InterpretedFunction)


def block_size(n_cols: int, interpreted: bool) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the row kernel: 2048 columns a step on the GPU (a row of the
    Llama-3 head in 63 steps, 16 fp32 columns a thread); 32 in the interpreter, so that its
    tiny test rows still take several blocks and a masked tail."""
    if interpreted:
        return 32, 1
    block = min(2048, triton.next_power_of_2(max(n_cols, 16)))
    return block, 8 if block >= 2048 else 4


def divergence_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, grad_logits: torch.Tensor | None,
                    student_bias: torch.Tensor | None, teacher_bias: torch.Tensor | None,
                    row_grads: torch.Tensor | None, mode: int, beta: float, student_scale: float,
                    student_softcap: float | None, teacher_scale: float, teacher_softcap: float | None,
                    grad_scale: float, interpreted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence, entropy) [rows] of a chunk's logits [rows, V] (contiguous, fp32 or fp64),
    and, given ``grad_logits`` [rows, V] (unit column stride, may alias ``student_logits``'s
    memory), the gradient G over the raw student logits written there, times ``grad_scale``
    and ``row_grads`` [rows] when given. Scales and softcaps are already divided by T."""
    n_rows, n_cols = student_logits.shape
    divergence = student_logits.new_empty(n_rows)
    entropy = student_logits.new_empty(n_rows)
    if n_rows == 0:
        return divergence, entropy
    block, warps = block_size(n_cols, interpreted)
    write = grad_logits is not None
    _divergence_rows_kernel[(n_rows,)](
        student_logits, teacher_logits, grad_logits if write else student_logits,
        student_logits if student_bias is None else student_bias,
        student_logits if teacher_bias is None else teacher_bias,
        divergence if row_grads is None else row_grads, divergence, entropy,
        n_cols, grad_logits.stride(0) if write else 0,
        beta, student_scale, student_softcap or 1.0, teacher_scale, teacher_softcap or 1.0, grad_scale,
        MODE=mode, STUDENT_BIAS=student_bias is not None, TEACHER_BIAS=teacher_bias is not None,
        STUDENT_SOFTCAP=student_softcap is not None, TEACHER_SOFTCAP=teacher_softcap is not None,
        ROW_GRADS=row_grads is not None, WRITE_GRAD=write, BLOCK_V=block, num_warps=warps,
    )
    return divergence, entropy
