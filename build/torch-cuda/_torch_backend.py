"""The same chunk-level operations as ``_triton_backend``, in plain PyTorch.

Used for CPU tensors outside the Triton interpreter, so that a training script runs on a
laptop or in CI. A chunk's logits are computed whole in fp32 ([rows, V], the bounded
buffer; fp64 for fp64 inputs), never the (N, V) matrix.
"""

import torch

from ._options import LossOptions, RowResults, RowStats, accumulation_dtype, env_int


def chunk_rows(n_rows: int, vocab_size: int, dtype: torch.dtype, training: bool, shards: int = 1) -> int:
    """Rows per chunk: the fp32 logits of a chunk, rows x V, stay under a fixed size
    (a vocabulary slice of one of ``shards`` ranks: ``shards`` times the rows)."""
    budget = env_int("FLCE_BUFFER_MIB", 256) * 2**20
    return max(1, min(n_rows, env_int("FLCE_CHUNK_ROWS", 4096) * shards, budget // (4 * vocab_size)))


def new_buffer(rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The per-chunk buffer [rows, V]: fp32 logits (fp64 for fp64 inputs)."""
    return torch.empty((rows, vocab_size), dtype=accumulation_dtype(dtype), device=device)


def _logits(hidden, weight, bias, opts: LossOptions) -> torch.Tensor:
    """Final fp32 (fp64 for fp64 inputs) logits z [rows, V] of a chunk."""
    acc_dtype = accumulation_dtype(hidden.dtype)
    logits = hidden.to(acc_dtype) @ weight.to(acc_dtype).T
    if bias is not None:
        logits += bias.to(acc_dtype)
    logits *= opts.logit_scale
    if opts.has_softcap:
        logits = opts.softcap * torch.tanh(logits / opts.softcap)
    return logits


def _safe(row_max: torch.Tensor) -> torch.Tensor:
    # A row whose logits are all -inf keeps finite shifts (and a zero sum of exponentials).
    return torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)


def row_stats(hidden, weight, bias, targets, opts: LossOptions, shifted_out=None, row_ref=None, loss_grad=None,
              class_weight=None):
    """Softmax statistics of a chunk of rows; with ``shifted_out`` also keeps the logits.
    ``class_weight`` [V] (with label smoothing only) weights the logit sum. (``row_ref`` and
    ``loss_grad`` belong to the factored gradient, which this backend never takes.)"""
    logits = _logits(hidden, weight, bias, opts)
    if shifted_out is not None:
        shifted_out.copy_(logits)
    vocab_size = logits.shape[1]
    row_max = logits.max(dim=1).values
    shifted = logits - _safe(row_max)[:, None]
    exp_shifted = shifted.exp()
    in_range = (targets >= 0) & (targets < vocab_size)
    picked = logits.gather(1, targets.clamp(0, vocab_size - 1).long()[:, None])[:, 0]
    stats = RowStats(
        row_max=row_max,
        sum_exp=exp_shifted.sum(dim=1),
        target_logit=torch.where(in_range, picked, torch.full_like(picked, float("nan"))),
    )
    if opts.return_metrics:
        terms = torch.where(exp_shifted > 0, -exp_shifted * shifted, torch.zeros_like(shifted))
        stats.entropy_term = terms.sum(dim=1)
        stats.argmax = logits.argmax(dim=1)
    if opts.has_smoothing:
        stats.logit_sum = (logits if class_weight is None else logits * class_weight).sum(dim=1)
    return stats, None


def finalize(stats: RowStats, targets, opts: LossOptions, vocab_size: int, out: RowResults) -> None:
    """Writes lse, loss, correctness and entropy of each row to ``out``."""
    valid = targets != opts.ignore_index
    log_sum_exp = stats.sum_exp.log()
    lse = stats.row_max + log_sum_exp
    if opts.has_smoothing:
        eps = opts.label_smoothing
        loss = lse - (1.0 - eps) * stats.target_logit - eps * opts.inv_vocab_size(vocab_size) * stats.logit_sum
    else:
        loss = lse - stats.target_logit
    if opts.has_z_loss:
        loss = loss + opts.z_loss_scale * lse * lse
    out.lse.copy_(lse)
    out.loss.copy_(torch.where(valid, loss, torch.zeros_like(loss)))
    if opts.return_metrics:
        out.correct.copy_(valid & (stats.argmax == targets))
        entropy = log_sum_exp + stats.entropy_term / stats.sum_exp
        out.entropy.copy_(torch.where(valid, entropy, torch.zeros_like(entropy)))


def _grad_from_logits(logits, targets, lse, loss_grad, lse_grad, opts: LossOptions, class_weight=None,
                      smooth_grad=None) -> torch.Tensor:
    """d out / d u [rows, V] in fp32 from the final logits z (see ``_kernels`` for the maths)."""
    vocab_size = logits.shape[1]
    probs = (logits - lse[:, None]).exp()
    prob_coef = loss_grad
    if opts.has_z_loss:
        prob_coef = prob_coef * (1.0 + 2.0 * opts.z_loss_scale * lse)
    if lse_grad is not None:
        prob_coef = prob_coef + lse_grad
    target_coef = loss_grad * (1.0 - opts.label_smoothing)
    grad = probs * prob_coef[:, None]
    in_range = (targets >= 0) & (targets < vocab_size)
    index = targets.clamp(0, vocab_size - 1).long()[:, None]
    grad.scatter_add_(1, index, -torch.where(in_range, target_coef, torch.zeros_like(target_coef))[:, None])
    if opts.has_smoothing and class_weight is not None:
        grad -= (smooth_grad * (opts.label_smoothing * opts.inv_vocab_size(vocab_size)))[:, None] * class_weight
    elif opts.has_smoothing:
        grad -= (loss_grad * (opts.label_smoothing * opts.inv_vocab_size(vocab_size)))[:, None]
    if opts.has_softcap:
        grad *= 1.0 - (logits / opts.softcap) ** 2
    grad *= opts.logit_scale
    keep = loss_grad != 0
    if lse_grad is not None:
        keep = keep | (lse_grad != 0)
    return torch.where(keep[:, None], grad, torch.zeros_like(grad))


def order_rows(targets: torch.Tensor, ignore_index: int, mean: bool):
    """As ``_triton_backend.order_rows``: (order, targets[order], count [1], loss_grad)."""
    has_loss = targets != ignore_index
    order = torch.argsort(has_loss.logical_not().to(torch.uint8), stable=True)
    count = has_loss.sum().reshape(1)
    row_grad = 1.0 / count.float() if mean else torch.ones(1, device=targets.device)
    loss_grad = torch.where(torch.arange(targets.shape[0], device=targets.device) < count, row_grad, 0.0)
    return order, targets[order].long(), count, loss_grad


def factored_gradient(dtype: torch.dtype, opts: LossOptions, has_bias: bool) -> bool:
    """Never here: this backend's buffer holds fp32 logits, turned into grad logits."""
    return False


def grad_from_stored(buffer, state, targets, lse, loss_grad, opts: LossOptions, bias_grad_acc):
    """Grad logits [rows, V] from the logits kept by ``row_stats``; adds the column sums to
    ``bias_grad_acc`` unless it is None."""
    grad = _grad_from_logits(buffer, targets, lse, loss_grad, None, opts)
    if bias_grad_acc is not None:
        bias_grad_acc += grad.sum(dim=0)
    return grad


def grad_logits(hidden, weight, bias, targets, lse, loss_grad, lse_grad, opts: LossOptions, out, bias_grad_acc,
                class_weight=None, smooth_grad=None):
    """Recomputes a chunk's logits and returns its grad logits [rows, V] (lse known); with label
    smoothing, ``class_weight`` [V] and ``smooth_grad`` [rows] weight the smoothing term."""
    grad = _grad_from_logits(_logits(hidden, weight, bias, opts), targets, lse, loss_grad, lse_grad, opts,
                             class_weight, smooth_grad)
    if bias_grad_acc is not None:
        bias_grad_acc += grad.sum(dim=0)
    return grad


def scale_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x *= scale in place."""
    x.mul_(scale)
