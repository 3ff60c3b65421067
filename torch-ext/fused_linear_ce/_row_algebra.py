"""The per-row algebra of class weights, label smoothing and the z-loss around the chunk loops.

Class weights w (PyTorch's ``weight=``) stay outside the chunk loop's kernels but for label
smoothing: a row's cross-entropy and its gradient are those of the unweighted row times w_t (see
``weight_row_losses`` and ``kernel_row_grads``), and a mean divides them by the sum of w_t. The
z-loss is not weighted, as in Liger-Kernel (whose fused linear cross-entropy takes both options):
k lse_i^2 summed over the non-ignored rows, a mean divides it by their count (``z_loss_rows``,
``recomputed_row_grads``).
"""

import torch

from ._distributed import Shard
from ._options import LossOptions, RowResults, RowStats


def row_weights(targets, class_weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor | None:
    """w_t [N]: the class weight of each row's target (global index), 0 on ignored rows;
    None without class weights."""
    if class_weight is None:
        return None
    valid = targets != ignore_index
    picked = class_weight[torch.where(valid, targets, 0).clamp(0, class_weight.shape[0] - 1)]
    return torch.where(valid, picked, torch.zeros((), device=targets.device, dtype=class_weight.dtype))


def row_loss_grad(targets, opts: LossOptions, reduction: str, grad_output: torch.Tensor,
                  row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """d out / d loss_i [N] fp32 (fp64 for an fp64 loss): grad_output spread over the rows, 0 on
    ignored rows. A mean divides by the number of non-ignored rows, or with class weights by
    the sum of their ``row_weight`` (as F.cross_entropy)."""
    valid = targets != opts.ignore_index
    grad_output = grad_output.to(torch.promote_types(grad_output.dtype, torch.float32))
    if reduction == "mean":
        grad_output = grad_output / (valid.sum() if row_weight is None else row_weight.sum())
    return torch.where(valid, grad_output, torch.zeros((), device=targets.device, dtype=grad_output.dtype))


def z_loss_rows(lse: torch.Tensor, targets: torch.Tensor, opts: LossOptions) -> torch.Tensor | None:
    """The z-loss k lse_i^2 [N] of each row, 0 on ignored rows; None without a z-loss."""
    if not opts.has_z_loss:
        return None
    return torch.where(targets != opts.ignore_index, opts.z_loss_scale * lse * lse, 0.0)


def recomputed_row_grads(targets, opts: LossOptions, reduction: str, grad_output: torch.Tensor, lse_grad, lse,
                         row_weight: torch.Tensor | None):
    """(loss_grad, lse_grad) [N] for ``backward``: d out / d loss_i (``row_loss_grad``) and
    d out / d lse_i (``lse_grad`` [N] of the returned lse, or None). With class weights and a
    z-loss, the z-loss's gradient 2 k lse_i g_i joins lse_grad, with g_i = d out / d (k lse_i^2)
    unweighted (grad_output, over the non-ignored rows' count for a mean); the rows' loss_grad
    then stands for their weighted cross-entropy alone."""
    loss_grad = row_loss_grad(targets, opts, reduction, grad_output, row_weight)
    if row_weight is None or not opts.has_z_loss:
        return loss_grad, lse_grad
    z_grad = row_loss_grad(targets, opts, reduction, grad_output)
    extra = (2.0 * opts.z_loss_scale) * lse * z_grad.to(lse.dtype)
    return loss_grad, extra if lse_grad is None else lse_grad + extra


def kernel_row_grads(loss_grad, lse_grad, row_weight, weight_sum, opts: LossOptions, vocab_size: int):
    """The kernels' per-row (loss_grad, lse_grad, smooth_grad) for d out / d loss_i = ``loss_grad``
    when rows carry class weights ``row_weight`` (w_t; ``weight_sum`` = sum_j w_j).

    Row i's cross-entropy is w_t (lse - z_t), so the kernels take loss_grad w_t (and no z-loss:
    its gradient is in lse_grad, ``recomputed_row_grads``). With label smoothing,
    (1 - eps) w_t (lse - z_t) + (eps / V) sum_j w_j (lse - z_j) has the gradient
    p_j ((1 - eps) w_t + eps W / V) - (1 - eps) w_t [j = t] - (eps / V) w_j: the kernels'
    coefficient of p gets loss_grad eps (W / V - w_t) through lse_grad, and their smoothing term
    the column weights w_j, for smooth_grad = loss_grad."""
    if row_weight is None:
        return loss_grad, lse_grad, None
    weighted = loss_grad * row_weight
    if not opts.has_smoothing:
        return weighted, lse_grad, None
    extra = loss_grad * opts.label_smoothing * (weight_sum * opts.inv_vocab_size(vocab_size) - row_weight)
    return weighted, extra if lse_grad is None else lse_grad + extra, loss_grad


def weight_row_losses(out: RowResults, stats: RowStats, targets, row_weight, weight_sum, opts: LossOptions,
                      vocab_size: int) -> None:
    """Rewrites ``out.loss`` with class weights as F.cross_entropy(weight=...) gives it per row:
    w_t (lse - z_t), and with label smoothing (1 - eps) w_t (lse - z_t) + (eps / V) (W lse - sum_j w_j z_j)
    (W = sum_j w_j; ``stats.logit_sum`` holds sum_j w_j z_j then); 0 on ignored rows. The z-loss,
    unweighted, is left out: ``_forward_result`` adds it (``z_loss_rows``)."""
    if not opts.has_smoothing and not opts.has_z_loss:
        out.loss.mul_(row_weight)  # 0 on ignored rows already
        return
    lse = out.lse
    if opts.has_smoothing:
        eps = opts.label_smoothing
        loss = ((1.0 - eps) * row_weight * (lse - stats.target_logit)
                + eps * opts.inv_vocab_size(vocab_size) * (weight_sum * lse - stats.logit_sum))
    else:
        loss = row_weight * (lse - stats.target_logit)
    out.loss.copy_(torch.where(targets != opts.ignore_index, loss, torch.zeros_like(loss)))


def local_class_weight(class_weight, opts: LossOptions, vocab_size: int, shard: Shard | None):
    """The class weights of this vocabulary slice [V], for the kernels: only label smoothing
    needs them there (None otherwise)."""
    if class_weight is None or not opts.has_smoothing:
        return None
    if shard is None:
        return class_weight
    return class_weight[shard.vocab_start: shard.vocab_start + vocab_size].contiguous()


def sweep_loss_grad(targets, opts: LossOptions, reduction: str, row_order, row_weight,
                     weight_sum, vocab_size: int) -> torch.Tensor:
    """d loss / d loss_i [N] of the rows in the computed order, for the gradients made in the
    sweep (grad_output 1): the row order's own, or with class weights (or every row computed)
    from the targets."""
    if row_order is not None and row_weight is None:
        return row_order.loss_grad
    loss_grad = row_loss_grad(targets, opts, reduction, torch.ones((), device=targets.device), row_weight)
    return kernel_row_grads(loss_grad, None, row_weight, weight_sum, opts, vocab_size)[0]
