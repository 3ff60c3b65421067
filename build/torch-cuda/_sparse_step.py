"""Sparse targets' rows: the K logits of a row's ids, their gradient terms, and the top-k losses'
training step, whose gradients are made in the forward.

For row n with ids t_n1..t_nK, s_nk = z[n, t_nk] - lse_n. A top-k loss sums per-row terms
l_n(s_n.) (TRL's forward KL with the tail bucket, or the top-1 divergence with it), so that with
g_nk = d l_n / d s_nk, which depends on row n alone,

    d l_n / d z_nj = sum_k g_nk [j = t_nk] - (sum_k g_nk) p_nj

the sparse backward's form for the upstream g (``sparse._sparse_backward_grads``). Reduced by
"mean" or "sum" the loss is a scalar, its upstream known up to one factor: so a chunk of rows is
its sweep, storing the chunk's buffer in the training step's form (``_kept.sweep_part``), the
rows' lse and s, g from the loss's own graph on the chunk's (rows, K) tensors (``row_grads``), the
grad logits made from the buffer in place (``grad_from_kept``, the first id as the row's target,
-sum_k g_nk as p's coefficient) with the other ids' entries scattered in, and the two products:
6 N V H flops and the memory of the loss's training step, where a backward that takes g only then
recomputes the logits (8 N V H) or keeps rows within TRL's head's peak. The backward scales the
gradients by the upstream scalar.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _kept
from ._options import LossOptions, accumulation_dtype
from ._plan import backend_for
from ._row_order import chunk_of

_GATHER_ELEMENTS = 1 << 24  # the most weight elements gathered at once by the PyTorch picked logits


def first_ids(ids: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(column [N, 1] of each row's first id that is not ``ignore_index``, 0 where none; that id
    [N], ``ignore_index`` where none): the row's target in the sweep."""
    first = (ids != ignore_index).to(torch.int8).argmax(-1, keepdim=True)
    return first, ids.gather(-1, first).squeeze(-1)


def picked_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, opts: LossOptions) -> Tensor:
    """The final logits z[n, ids[n, k]] [N, K] fp32 (fp64 for fp64 inputs); ``ids`` all columns of
    ``weight``. The Triton backend sums each as its logit tiles do (``step_target_logits``, the K
    ids of a row reading its hidden row in place); otherwise dot products in the accumulation
    dtype over chunks of rows, as the PyTorch backend's logits."""
    n_rows, k = ids.shape
    acc_dtype = accumulation_dtype(hidden.dtype)
    if n_rows * k == 0:
        return hidden.new_zeros((n_rows, k), dtype=acc_dtype)
    rows = torch.arange(n_rows, device=hidden.device).repeat_interleave(k)
    picked = backend_for(hidden.device).step_target_logits(hidden, weight, ids.reshape(-1), opts, bias, rows=rows)
    if picked is not None:
        return picked.view(n_rows, k)
    logits = hidden.new_empty((n_rows, k), dtype=acc_dtype)
    step = max(1, _GATHER_ELEMENTS // (k * weight.shape[1]))
    for start in range(0, n_rows, step):
        end = min(start + step, n_rows)
        picked_rows = weight[ids[start:end]].to(acc_dtype)  # [rows, K, H]
        torch.bmm(picked_rows, hidden[start:end, :, None].to(acc_dtype), out=logits[start:end, :, None])
    if bias is not None:
        logits += bias.to(acc_dtype)[ids]
    if opts.logit_scale != 1.0:
        logits *= opts.logit_scale
    if opts.has_softcap:
        logits.div_(opts.softcap).tanh_().mul_(opts.softcap)
    return logits


def logit_chain(logits: Tensor, opts: LossOptions) -> Tensor:
    """dz/du [N, K] at the final logits z = c tanh(s u / c) (z = s u without a softcap)."""
    if not opts.has_softcap:
        return torch.full_like(logits, opts.logit_scale)
    return (logits / opts.softcap).square_().neg_().add_(1.0).mul_(opts.logit_scale)


def log_probs_at(logits: Tensor, lse: Tensor, row_log_probs: Tensor, valid: Tensor, first: Tensor) -> Tensor:
    """The log-probs [rows, K] at the ids: ``logits`` [rows, K] less ``lse`` [rows], 0 where not
    ``valid``, and at each row's ``first`` column [rows, 1] the sweep's own ``row_log_probs`` [rows]."""
    log_probs = torch.where(valid, logits - lse[:, None], 0.0)
    return log_probs.scatter_(-1, first, row_log_probs[:, None])


def add_sparse_terms(grads: list, hidden: Tensor, weight: Tensor, ids: Tensor, coef: Tensor) -> None:
    """The sparse term of the gradients, in place: grad_hidden[n] += sum_k coef[n, k] weight[ids[n, k]],
    grad_weight[ids[n, k]] += coef[n, k] hidden[n], grad_bias[ids[n, k]] += coef[n, k]; ``coef``
    [N, K] (0: no term), ``ids`` columns of weight; a None gradient is not wanted."""
    grad_hidden, grad_weight, grad_bias = grads
    n_rows, k = ids.shape
    if grad_hidden is not None:
        # a bag of K rows of weight per row, weighted by the coefficients in weight's dtype (one
        # kernel, no [N, K, H] gather)
        grad_hidden += F.embedding_bag(ids, weight, per_sample_weights=coef.to(weight.dtype), mode="sum")
    if grad_bias is not None:
        terms = coef.new_zeros(grad_bias.shape[0]).index_add_(0, ids.reshape(-1), coef.reshape(-1))
        grad_bias.copy_(grad_bias.to(terms.dtype) + terms)
    if grad_weight is None:
        return
    flat_coef, flat_ids = coef.reshape(-1), ids.reshape(-1)
    add_target_rows = getattr(backend_for(hidden.device), "add_target_rows", None)
    if add_target_rows is not None and coef.dtype == torch.float32:
        # each id's terms summed in fp32 in a fixed order, one rounding into grad_weight
        rows = torch.arange(n_rows, device=hidden.device).repeat_interleave(k)
        add_target_rows(grad_weight, flat_coef, flat_ids, hidden, rows)
        return
    # the ids' terms summed in the accumulation dtype, over chunks of rows, then one rounding
    touched, slot = torch.unique(ids, return_inverse=True)
    sums = coef.new_zeros((touched.shape[0], hidden.shape[1]))
    step = max(1, _GATHER_ELEMENTS // (k * hidden.shape[1]))
    for start in range(0, n_rows, step):
        end = min(start + step, n_rows)
        terms = coef[start:end, :, None] * hidden[start:end, None, :].to(coef.dtype)  # [rows, K, H]
        sums.index_add_(0, slot[start:end].reshape(-1), terms.reshape(-1, hidden.shape[1]))
    grad_weight[touched] = (grad_weight[touched].to(sums.dtype) + sums).to(grad_weight.dtype)


# ---- the top-k losses' training step (pipeline "sparse") ------------------------------------
@dataclass
class SparseLoss:
    """A top-k loss on each row's log-probs at its ids, as the chunk loop of pipeline "sparse"
    takes it: loss = sum_n row_weight[n] divergence(s_n, teacher_n, support_n) over the ``rows``."""

    ids: Tensor  # [N, K] int64, ignore_index where absent
    first: Tensor  # [N, 1] the column of each row's first id (``first_ids``)
    teacher: Tensor  # [N, K] the teacher's log-probs, in the accumulation dtype
    support: Tensor  # [N, K] bool, the elements of each row's divergence
    rows: Tensor  # [N] bool, the rows that take part
    row_weight: Tensor  # [N] d loss / d divergence_n: 1 / their count ("mean") or 1 ("sum"); 0 elsewhere
    divergence: Callable[[Tensor, Tensor, Tensor], Tensor]  # (student, teacher, support) [rows, K] -> [rows]


def row_grads(loss: SparseLoss, log_probs: Tensor, take) -> tuple[Tensor, Tensor]:
    """(each row's divergence [rows], g = d loss / d log_probs [rows, K]) of a chunk of rows whose
    log-probs at the ids are ``log_probs`` [rows, K] and whose rows of the loss's [N, ...] tensors
    ``take`` gives: the loss's own graph on the chunk's (rows, K) tensors, backpropagated once (the
    rows' terms are separable, so a chunk's g is the whole loss's)."""
    rows, row_weight = take(loss.rows), take(loss.row_weight)
    with torch.enable_grad():
        student = log_probs.detach().requires_grad_()
        divergence = loss.divergence(student, take(loss.teacher), take(loss.support))
        total = torch.where(rows, divergence * row_weight, 0.0).sum()
        (grad,) = torch.autograd.grad(total, student, allow_unused=True, materialize_grads=True)
    return divergence.detach(), grad


def forward_chunks(step, loss: SparseLoss) -> Tensor:
    """The chunks of a top-k loss's forward that makes its gradients (``_chunked._ForwardStep`` of
    pipeline "sparse", whose targets are the rows' first ids): each chunk swept into one buffer
    (``_kept.sweep_part``), its rows' g (``row_grads``), its grad logits from the buffer in place
    with the other ids' entries scattered in (at G's rounding), then the two products into
    ``step.gradients``. Returns each row's divergence [N] in the rows' own order (0 where not
    computed)."""
    backend, opts, gradients, row_order = step.backend, step.opts, step.gradients, step.row_order
    hidden, weight = step.hidden, step.weight
    valid = loss.ids != opts.ignore_index
    ids = torch.where(valid, loss.ids, 0)
    logits = picked_logits(hidden, weight, step.bias, ids, opts)  # [N, K], every row's before the chunks
    buffer = backend.new_buffer(step.first, step.vocab_size, hidden.dtype, hidden.device)
    divergence = logits.new_zeros(hidden.shape[0])  # in the computed order
    for start, end, hidden_c, targets_c, _, _ in step.chunks():
        part = _kept.sweep_part(step, start, end, hidden_c, targets_c, buffer[: end - start])
        out = step.results_of(start, end)

        def take(t, start=start, end=end):
            return chunk_of(t, row_order, start, end)

        ids_c, valid_c, first_c, logits_c = take(ids), take(valid), take(loss.first), take(logits)
        log_probs = log_probs_at(logits_c, out.lse, out.loss.neg(), valid_c, first_c)
        divergence[start:end], grad = row_grads(loss, log_probs, take)
        grad = torch.where(valid_c, grad, 0.0)
        rest = grad.scatter(-1, first_c, 0.0)  # the other ids' entries: the first is the sweep's target's
        # lse_i - z_it is the sweep's loss: its coefficient is -g at the first id, lse's the others' -sum
        grad_logits = backend.grad_from_kept(part.buffer, part.state, part.row_ref, targets_c, out.lse,
                                             -grad.gather(-1, first_c).squeeze(-1), -rest.sum(-1), None, opts,
                                             gradients.bias_acc)
        part = None
        coef = rest * logit_chain(logits_c, opts)
        grad_logits.scatter_add_(1, ids_c, coef.to(grad_logits.dtype))
        if gradients.bias_acc is not None:  # (the kernel's column sums came before the entries)
            gradients.bias_acc.index_add_(0, ids_c.reshape(-1), coef.reshape(-1).to(gradients.bias_acc.dtype))
        gradients.add(start, end, hidden_c, grad_logits, weight)
    return divergence if row_order is None else row_order.unorder(divergence)
