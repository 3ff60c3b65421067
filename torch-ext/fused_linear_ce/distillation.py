"""A student/teacher divergence of two LM heads, without their (N, V) logits.

For each row i the student's logits are ``hidden_s @ weight_s.T (+ bias_s)`` and the teacher's
``hidden_t @ weight_t.T (+ bias_t)`` (the hidden sizes may differ, the vocabulary must not);
each side's logits are multiplied by its ``logit_scale``, capped by its softcap
(``c * tanh(z / c)``), then divided by the temperature T; p and q are the student's and the
teacher's softmax. The divergence is TRL 1.16's generalised JSD (``DistillationTrainer``):

    beta = 0:  KL(q || p)              (forward KL)
    beta = 1:  KL(p || q)              (reverse KL)
    else:      beta KL(q || m) + (1 - beta) KL(p || m),  m = (1 - beta) p + beta q

and the student's entropy -sum_j p_j log p_j comes with it. Gradients flow to the student's
hidden, weight and bias only.

The rows are taken a chunk at a time: both chunks of logits by cuBLAS in fp32, one row kernel
(``_divergence_kernels``) for the divergence, the entropy and the gradient over the student's
logits, in place, then the gradient's two products. The gradient is made in the forward, for an
upstream gradient of 1 / N on every row (a mean, TRL's ``sum / num_items`` over the rows it
passes), and scaled in the backward when the upstream is another value equal on every row;
any other upstream (e.g. TRL's masked rows on devices where it passes them all) recomputes the
chunks of the rows whose upstream is not 0, and the next forwards recompute too until a backward
finds the upstream uniform again (docs/design.md, "The distillation divergence").
"""

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import _torch_backend
from ._chunked import _cdiv, _Gradients, _mm_f32, backend_for, weight_group
from ._options import accumulation_dtype
from ._settings import current as settings
from ._validation import autocast_inputs, check_head, check_heads_match, checked_divergence_options, refuse_dtensor

__all__ = ["fused_linear_divergence", "TrlDivergence"]

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2  # as in _divergence_kernels
BUFFER_MIB = 512  # the two fp32 chunk buffers together, unless settings().buffer_mib says otherwise


class _Spec(NamedTuple):
    """The divergence and each side's transforms, with the temperature folded into them:
    c tanh(s z / c) / T = (c / T) tanh((s / T) z / (c / T))."""

    mode: int
    beta: float
    student_scale: float
    student_softcap: float | None
    teacher_scale: float
    teacher_softcap: float | None


def _spec(beta, temperature, student_scale, student_softcap, teacher_scale, teacher_softcap) -> _Spec:
    mode = FORWARD_KL if beta == 0 else REVERSE_KL if beta == 1 else JSD
    return _Spec(mode, beta, student_scale / temperature, None if student_softcap is None else student_softcap
                 / temperature, teacher_scale / temperature,
                 None if teacher_softcap is None else teacher_softcap / temperature)


def _logits(hidden: Tensor, weight: Tensor, acc: torch.dtype) -> Tensor:
    """hidden @ weight.T [rows, V], contiguous, in ``acc`` (fp32: 16-bit products summed in fp32)."""
    if acc == torch.float64:
        return torch.mm(hidden.double(), weight.double().t())
    return _mm_f32(hidden, weight.t())


def _final(logits: Tensor, bias: Tensor | None, scale: float, softcap: float | None) -> Tensor:
    z = logits if bias is None else logits + bias.to(logits.dtype)
    z = z * scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _torch_rows(student_logits, teacher_logits, grad_logits, student_bias, teacher_bias, row_grads, spec: _Spec,
                grad_scale: float) -> tuple[Tensor, Tensor]:
    """The row kernel's results (``_divergence_kernels.divergence_rows``) in PyTorch ops."""
    u = _final(student_logits, student_bias, spec.student_scale, spec.student_softcap)
    v = _final(teacher_logits, teacher_bias, spec.teacher_scale, spec.teacher_softcap)
    lp, lq = u.log_softmax(-1), v.log_softmax(-1)
    p = lp.exp()
    entropy = -(p * lp).sum(-1)
    if spec.mode == FORWARD_KL:
        q = lq.exp()
        divergence = (q * (lq - lp)).sum(-1)
        grad_u = p - q
    elif spec.mode == REVERSE_KL:
        divergence = (p * (lp - lq)).sum(-1)
        grad_u = p * (lp - lq - divergence[:, None])
    else:
        beta = spec.beta
        lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
        a = (1 - beta) * (lp - lm)
        mean_a = (p * a).sum(-1)
        divergence = beta * (lq.exp() * (lq - lm)).sum(-1) + mean_a
        grad_u = p * (a - mean_a[:, None])
    if grad_logits is not None:
        if spec.student_softcap is not None:
            grad_u = grad_u * (1 - (u / spec.student_softcap) ** 2)
        factor = spec.student_scale * grad_scale
        grad_u = grad_u * (factor if row_grads is None else factor * row_grads[:, None])
        grad_logits.copy_(grad_u)
    return divergence, entropy


def _chunk_rows(n_rows: int, vocab_size: int, hidden_size: int, acc: torch.dtype, dtype: torch.dtype,
                training: bool) -> int:
    """Rows per chunk: the two logit buffers within BUFFER_MIB (``buffer_mib``), at most
    ``chunk_rows``; a 16-bit training step of more than ``weight_group`` chunks takes that many
    larger ones where their buffers are smaller than the fp32 sum of grad_weight they then spare
    (``_chunked._Gradients``). The rows are spread evenly over the chunks."""
    tuning = settings()
    row_bytes = 2 * vocab_size * acc.itemsize
    most = max(1, ((tuning.buffer_mib or BUFFER_MIB) * 2**20) // row_bytes)
    most = most // 128 * 128 if most >= 128 else most
    group = weight_group(dtype)
    if training and group is not None and _cdiv(n_rows, most) > group:
        grown = _cdiv(_cdiv(n_rows, group), 128) * 128
        if grown * row_bytes <= vocab_size * hidden_size * 4 and grown * vocab_size < 2**31:
            most = grown
    if tuning.chunk_rows is not None:
        most = min(most, tuning.chunk_rows)
    return _cdiv(n_rows, _cdiv(n_rows, most)) if n_rows else 1


def _sweep(student, teacher, spec: _Spec, want: tuple[bool, bool, bool], grad_scale: float,
           row_grads: Tensor | None = None):
    """(divergence, entropy, grad_hidden, grad_weight, grad_bias) of the rows of ``student``
    (hidden, weight, bias) against ``teacher``'s, a chunk at a time; the gradients (those
    ``want``ed, else None) of sum_i f_i D_i with f_i = ``grad_scale`` (times ``row_grads[i]``)."""
    hidden, weight, bias = student
    n_rows, vocab_size = hidden.shape[0], weight.shape[0]
    acc = accumulation_dtype(hidden.dtype)
    backend = backend_for(hidden.device)
    interpreted = hidden.device.type == "cpu"
    if backend is not _torch_backend:
        from . import _divergence_kernels as kernels

        if interpreted and not kernels.interpreted():  # (decorated before TRITON_INTERPRET=1 was set)
            backend = _torch_backend
    chunk = _chunk_rows(n_rows, vocab_size, hidden.shape[1], acc, hidden.dtype, any(want))
    n_chunks = _cdiv(n_rows, chunk)
    gradients = _Gradients(hidden, vocab_size, want, chunk, n_chunks, None, None) if any(want) else None
    divergence = hidden.new_empty(n_rows, dtype=acc)
    entropy = hidden.new_empty(n_rows, dtype=acc)
    if row_grads is not None:
        row_grads = row_grads.to(acc).contiguous()
    for start in range(0, n_rows, chunk):
        end = min(n_rows, start + chunk)
        student_logits = _logits(hidden[start:end], weight, acc)
        teacher_logits = _logits(teacher[0][start:end], teacher[1], acc)
        grad_logits = None
        if gradients is not None:  # written over the student's logits (16-bit: their first half)
            grad_logits = student_logits if hidden.dtype.itemsize >= 4 else \
                student_logits.view(hidden.dtype)[:, :vocab_size]
        rows_grad = None if row_grads is None else row_grads[start:end]
        if backend is _torch_backend:
            out = _torch_rows(student_logits, teacher_logits, grad_logits, bias, teacher[2], rows_grad, spec,
                              grad_scale)
        else:
            out = kernels.divergence_rows(student_logits, teacher_logits, grad_logits, bias, teacher[2],
                                          rows_grad, *spec, grad_scale, interpreted)
        divergence[start:end], entropy[start:end] = out
        if gradients is not None:
            gradients.add(start, end, hidden[start:end], grad_logits, weight)
            if gradients.bias_acc is not None:
                gradients.bias_acc += grad_logits.sum(0, dtype=acc)
        del student_logits, teacher_logits, grad_logits
    if gradients is None:
        return divergence, entropy, None, None, None
    grad_hidden, grad_weight, grad_bias = gradients.finish(hidden.dtype, bias)
    return divergence, entropy, grad_hidden, grad_weight, grad_bias


# Whether the last backward found its upstream gradient equal on every row: then the forward
# makes the gradients in its sweep; otherwise the backward recomputes them.
_uniform_upstream = True


class _FusedDivergence(torch.autograd.Function):
    """(divergence, entropy) [N] of ``_sweep``; gradients to the student's hidden, weight, bias."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, spec: _Spec):
        needs = ctx.needs_input_grad
        want = (needs[0], needs[1], bias is not None and needs[2])
        n_rows = hidden.shape[0]
        ctx.spec, ctx.want, ctx.n_rows = spec, want, n_rows
        ctx.grad_scale = float(torch.tensor(1.0 / max(n_rows, 1), dtype=torch.float32))  # PyTorch's mean
        speculate = any(want) and _uniform_upstream and n_rows > 0
        divergence, entropy, *grads = _sweep((hidden, weight, bias), (teacher_hidden, teacher_weight, teacher_bias),
                                             spec, want if speculate else (False,) * 3, ctx.grad_scale)
        ctx.grads = grads if speculate else None
        ctx.save_for_backward(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias)
        ctx.mark_non_differentiable(entropy)
        return divergence, entropy

    @staticmethod
    def backward(ctx, grad_divergence, grad_entropy):
        global _uniform_upstream
        nones = (None,) * 4
        hidden, weight, bias, *teacher = ctx.saved_tensors
        if grad_divergence is None or ctx.n_rows == 0:
            zeros = [torch.zeros_like(t) if w else None for w, t in zip(ctx.want, (hidden, weight, bias), strict=True)]
            return (*zeros, *nones)
        speculated, ctx.grads = ctx.grads, None  # (a second backward, retain_graph=True, recomputes)
        if speculated is not None and not (ctx.want[1] or ctx.want[2]):
            # grad_hidden alone (a frozen head, e.g. under LoRA): exact for any upstream, row by row
            grad_hidden = speculated[0]
            grad_hidden.mul_((grad_divergence / ctx.grad_scale).unsqueeze(-1).to(grad_hidden.dtype))
            return (grad_hidden, None, None, *nones)
        low, high = torch.stack(torch.aminmax(grad_divergence)).tolist()
        _uniform_upstream = low == high
        if speculated is not None and low == high:
            ratio = low / ctx.grad_scale  # 1 for a mean over the N rows: no pass over the gradients
            for g in speculated:
                if g is not None and ratio != 1.0:
                    g.mul_(ratio)
            return (*speculated, *nones)
        return (*_recomputed(hidden, weight, bias, teacher, grad_divergence, ctx.spec, ctx.want), *nones)


def _apply(*args) -> tuple[Tensor, Tensor]:
    """``_FusedDivergence.apply``, run eagerly under torch.compile (a graph break): the sweep's
    chunk loop, its host-side plan and the backward's host read of the upstream gradient are not
    traceable as they are. (``torch.compiler.disable`` only there: it imports torch._dynamo.)"""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_FusedDivergence.apply)(*args)
    return _FusedDivergence.apply(*args)


def _recomputed(hidden, weight, bias, teacher, grad_divergence, spec: _Spec, want) -> tuple:
    """The gradients for any upstream [N]: the chunks of the rows whose upstream is not 0 again."""
    rows = (grad_divergence != 0).nonzero().squeeze(1)
    if rows.numel() == hidden.shape[0]:
        _, _, *grads = _sweep((hidden, weight, bias), teacher, spec, want, 1.0, grad_divergence)
        return tuple(grads)
    _, _, grad_kept, grad_weight, grad_bias = _sweep(
        (hidden.index_select(0, rows), weight, bias), (teacher[0].index_select(0, rows), *teacher[1:]), spec, want,
        1.0, grad_divergence.index_select(0, rows))
    grad_hidden = None
    if want[0]:
        grad_hidden = torch.zeros_like(hidden).index_copy_(0, rows, grad_kept)
    return grad_hidden, grad_weight, grad_bias


def fused_linear_divergence(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token divergence between a student's and a teacher's next-token distributions, and
    the student's entropy, without either model's logits (module docstring for the maths).

    Args:
        student_hidden: (..., Hs) float32, bfloat16, float16 or float64.
        student_weight: (V, Hs), student_hidden's dtype; student_bias (V,) or None.
        teacher_hidden: (..., Ht), the same leading shape; teacher_weight (V, Ht), teacher_bias
            (V,) or None, in teacher_hidden's dtype (which may differ from the student's).
        beta: in [0, 1]; 0 the forward KL(teacher || student), 1 the reverse KL(student ||
            teacher), in between TRL's generalised JSD with mixture (1 - beta) p + beta q.
        temperature: > 0, divides both sides' final logits.
        student_logit_scale, teacher_logit_scale: multiply each side's logits (before the softcap).
        student_softcap, teacher_softcap: if set (> 0), that side's logits become c tanh(z / c).

    Returns:
        (divergence, entropy), each of the leading shape, in float32 (float64 for float64
        student inputs), in nats. The divergence takes gradients (to the student's hidden,
        weight and bias) from any per-token upstream gradient; the entropy has none. Exact:
        fp32 logits and fp32 sums for 16-bit inputs, the student's gradient over its logits
        rounded to the inputs' dtype before its two products, as the loss's.
    """
    refuse_dtensor("fused_linear_divergence", student_hidden, student_weight, student_bias, teacher_hidden,
                   teacher_weight, teacher_bias)
    student_hidden, student_weight, student_bias = autocast_inputs(student_hidden, student_weight, student_bias)
    teacher_hidden, teacher_weight, teacher_bias = autocast_inputs(teacher_hidden, teacher_weight, teacher_bias)
    check_head("student", student_hidden, student_weight, student_bias)
    check_head("teacher", teacher_hidden, teacher_weight, teacher_bias)
    check_heads_match(student_hidden, student_weight, teacher_hidden, teacher_weight)
    spec = _spec(*checked_divergence_options(beta, temperature, student_logit_scale, student_softcap,
                                             teacher_logit_scale, teacher_softcap))
    leading = student_hidden.shape[:-1]
    divergence, entropy = _apply(
        student_hidden.reshape(-1, student_hidden.shape[-1]), student_weight, student_bias,
        teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach(), teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(), spec)
    return divergence.reshape(leading), entropy.reshape(leading)


# ---- TRL 1.16's DistillationTrainer --------------------------------------------------------
class TrlDivergence:
    """Stands in for TRL's ``ChunkedDivergenceFunction``: the same ``apply`` arguments and outputs
    (``flce.trl.use_in_trl()`` puts it in ``trl.trainer.distillation_trainer``)."""

    @staticmethod
    def apply(student_hidden: Tensor, student_weight: Tensor, student_bias: Tensor | None, teacher_hidden: Tensor,
              teacher_weight: Tensor, teacher_bias: Tensor | None, beta: float, temperature: float = 1.0,
              student_logit_scale: float = 1.0, student_final_logit_softcapping: float | None = None,
              teacher_logit_scale: float = 1.0,
              teacher_final_logit_softcapping: float | None = None) -> tuple[Tensor, Tensor]:
        """(per-token divergence, per-token student entropy) [N] of the rows TRL passes. Each
        side's weight and bias take its hidden states' dtype, as TRL's kernel accepts them (a
        teacher's fp32 master weight beside bf16 states, say; the cast is differentiable)."""
        student_weight, student_bias, teacher_weight, teacher_bias = (
            None if t is None else t.to(like.dtype) for t, like in (
                (student_weight, student_hidden), (student_bias, student_hidden), (teacher_weight, teacher_hidden),
                (teacher_bias, teacher_hidden)))
        return fused_linear_divergence(
            student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias, beta=beta,
            temperature=temperature, student_logit_scale=student_logit_scale,
            student_softcap=student_final_logit_softcapping or None, teacher_logit_scale=teacher_logit_scale,
            teacher_softcap=teacher_final_logit_softcapping or None)


_trl_own_divergence = None  # TRL's own, while ours stands in for it


def use_in_distillation_trainer(enabled: bool = True) -> None:
    """Makes TRL's ``DistillationTrainer`` compute its divergence with ``TrlDivergence`` (or,
    ``enabled=False``, with TRL's kernel again); its masking, gathers and ``num_items_in_batch``
    stay TRL's. Called by ``flce.trl.use_in_trl``, after its version check."""
    global _trl_own_divergence
    from trl.trainer import distillation_trainer as module

    if not hasattr(module, "ChunkedDivergenceFunction"):
        raise RuntimeError("this TRL's DistillationTrainer has no divergence kernel to replace")
    if enabled and module.ChunkedDivergenceFunction is not TrlDivergence:
        _trl_own_divergence = module.ChunkedDivergenceFunction
        module.ChunkedDivergenceFunction = TrlDivergence
    elif not enabled and module.ChunkedDivergenceFunction is TrlDivergence:
        module.ChunkedDivergenceFunction = _trl_own_divergence
        _trl_own_divergence = None
