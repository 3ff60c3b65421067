"""The same chunk-level operations as ``_triton_backend``, in plain PyTorch.

Used for CPU tensors outside the Triton interpreter, so that a training script runs on a
laptop or in CI. A chunk's logits are computed whole in fp32 (fp64 for fp64 inputs) into the
chunk buffer ([rows, V], never the (N, V) matrix) and then transformed in place: into exponentials relative to the row
max in the forward, into grad logits once the lse is known. Besides the buffer a chunk needs
at most one array of its size (the softcap's derivative) and vectors of [rows]; the entropy
term of the metrics is summed over blocks of a few rows.
"""

import torch

from ._options import LossOptions, RowResults, RowStats, accumulation_dtype

# Elements of the per-block temporaries of the entropy term (4 MiB of fp32).
_BLOCK_ELEMENTS = 2**20


def hardware(device: torch.device):
    """This backend's facts for the plan (``_plan.Hardware``): no tiles, no rounds."""
    from . import _plan

    return _plan.TORCH


def out_of_range(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """[N] bool: the targets neither in [0, vocab_size) nor ``ignore_index``."""
    return ((targets < 0) | (targets >= vocab_size)) & (targets != ignore_index)


def targets_out_of_range(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """A [] int32 flag, 1 if a target is neither in [0, vocab_size) nor ``ignore_index``."""
    return out_of_range(targets, vocab_size, ignore_index).any().to(torch.int32)


def precompile(kind: str, device: torch.device) -> None:
    """Nothing: PyTorch's operators need no compilation."""


def new_buffer(rows: int, vocab_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The per-chunk buffer [rows, V]: fp32 logits (fp64 for fp64 inputs)."""
    return torch.empty((rows, vocab_size), dtype=accumulation_dtype(dtype), device=device)


def _logits(hidden, weight, bias, opts: LossOptions, out=None) -> torch.Tensor:
    """Final fp32 (fp64 for fp64 inputs) logits z [rows, V] of a chunk, written into ``out`` when given."""
    acc_dtype = accumulation_dtype(hidden.dtype)
    if out is None:
        out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=acc_dtype, device=hidden.device)
    torch.mm(hidden.to(acc_dtype), weight.to(acc_dtype).T, out=out)
    if bias is not None:
        out += bias.to(acc_dtype)
    if opts.logit_scale != 1.0:
        out *= opts.logit_scale
    if opts.has_softcap:
        out.div_(opts.softcap).tanh_().mul_(opts.softcap)
    return out


def _softcap_grad(logits, opts: LossOptions) -> torch.Tensor:
    """dz/du = 1 - (z / softcap)^2 [rows, V] of the soft-capped logits z."""
    return torch.div(logits, opts.softcap).square_().neg_().add_(1.0)


def _safe(row_max: torch.Tensor) -> torch.Tensor:
    # A row whose logits are all -inf keeps finite shifts (and a zero sum of exponentials).
    return torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)


def _exp_with_entropy_term_(shifted: torch.Tensor) -> torch.Tensor:
    """Turns s = z - max [rows, V] into exp(s) in place; returns -sum_j exp(s_j) * s_j [rows]
    (terms with exp(s_j) = 0 count 0, also where s_j = -inf), one block of rows at a time."""
    rows, vocab_size = shifted.shape
    entropy_term = torch.empty(rows, dtype=shifted.dtype, device=shifted.device)
    block = max(1, _BLOCK_ELEMENTS // max(vocab_size, 1))
    lowest = torch.finfo(shifted.dtype).min
    for start in range(0, rows, block):
        s = shifted[start:start + block]
        e = s.exp()
        torch.sum(e * s.clamp_min_(lowest), dim=1, out=entropy_term[start:start + block])
        s.copy_(e)
    return entropy_term.neg_()


def row_stats(hidden, weight, bias, targets, opts: LossOptions, shifted_out=None, row_ref=None, loss_grad=None,
              class_weight=None, target_logit=None, return_metrics=False, logit_sum=False, sum_sq=False):
    """Softmax statistics of a chunk of rows. With ``shifted_out`` (the chunk buffer) the
    buffer keeps exp(z - row max) for ``grad_from_stored``, and the state carries the row max
    (and the softcap's derivative). ``class_weight`` [V] (with label smoothing only) weights
    the logit sum; ``return_metrics`` adds each row's entropy term and argmax; ``logit_sum`` the
    sum of each row's logits and ``sum_sq`` its sum_j exp(2 (z_j - row max)). (``row_ref``,
    ``loss_grad`` and ``target_logit`` belong to the factored gradient, which this backend never
    takes.)"""
    logits = _logits(hidden, weight, bias, opts, out=shifted_out)
    vocab_size = logits.shape[1]
    argmax = None
    if return_metrics:
        row_max, argmax = logits.max(dim=1)  # the first index of the max, as argmax
    else:
        row_max = logits.amax(dim=1)
    in_range = (targets >= 0) & (targets < vocab_size)
    picked = logits.gather(1, targets.clamp(0, vocab_size - 1).long()[:, None])[:, 0]
    summed = None
    if opts.has_smoothing or logit_sum:
        summed = (logits.sum(dim=1) if class_weight is None
                  else torch.mv(logits, class_weight.to(logits.dtype)))
    # The gradient needs the softcap's derivative at z, which the exponentials overwrite.
    softcap_grad = _softcap_grad(logits, opts) if shifted_out is not None and opts.has_softcap else None
    logits.sub_(_safe(row_max)[:, None])
    entropy_term = _exp_with_entropy_term_(logits) if return_metrics else None
    if entropy_term is None:
        logits.exp_()
    squares = torch.linalg.vector_norm(logits, dim=1).square() if sum_sq else None
    stats = RowStats(
        row_max=row_max,
        sum_exp=logits.sum(dim=1),
        target_logit=torch.where(in_range, picked, torch.full_like(picked, float("nan"))),
        entropy_term=entropy_term,
        argmax=argmax,
        logit_sum=summed,
        sum_sq=squares,
    )
    return stats, (row_max, softcap_grad)


def finalize(stats: RowStats, targets, opts: LossOptions, vocab_size: int, out: RowResults,
             return_metrics: bool = False) -> None:
    """Writes lse and loss of each row to ``out``, and with ``return_metrics`` its correctness
    and entropy."""
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
    if return_metrics:
        out.correct.copy_(valid & (stats.argmax == targets))
        entropy = log_sum_exp + stats.entropy_term / stats.sum_exp
        out.entropy.copy_(torch.where(valid, entropy, torch.zeros_like(entropy)))


def _grad_in_place(probs, probs_scale, targets, lse, loss_grad, lse_grad, opts: LossOptions, softcap_grad,
                   bias_grad_acc, class_weight=None, smooth_grad=None, entropy_grad=None,
                   log_probs=None) -> torch.Tensor:
    """Turns ``probs`` [rows, V] (the softmax, times ``probs_scale`` [rows] when given) into
    d out / d u in place (see ``_kernel_math`` for the maths); adds its column sums to
    ``bias_grad_acc`` unless it is None. With label smoothing, ``class_weight`` [V] and
    ``smooth_grad`` [rows] weight the smoothing term. With ``entropy_grad`` [rows] (d out / d H_i,
    its -e_i H_i part already in ``lse_grad``), ``log_probs`` [rows, V] (log p, overwritten) adds
    the entropy's -e_i p_ij log p_ij."""
    vocab_size = probs.shape[1]
    scale = opts.logit_scale
    prob_coef = loss_grad
    if opts.has_z_loss:
        prob_coef = prob_coef * (1.0 + 2.0 * opts.z_loss_scale * lse)
    if lse_grad is not None:
        prob_coef = prob_coef + lse_grad
    if probs_scale is not None:
        prob_coef = prob_coef * probs_scale
    if entropy_grad is not None:  # p_j (c - e log p_j), with ``probs`` p_j / probs_scale
        entropy_coef = entropy_grad if probs_scale is None else entropy_grad * probs_scale
        probs.mul_(log_probs.mul_(-entropy_coef[:, None]).add_(prob_coef[:, None]).mul_(scale))
    else:
        probs.mul_((prob_coef * scale)[:, None])
    in_range = (targets >= 0) & (targets < vocab_size)
    target_coef = torch.where(in_range, loss_grad * ((1.0 - opts.label_smoothing) * scale), 0.0)
    probs.scatter_add_(1, targets.clamp(0, vocab_size - 1).long()[:, None], -target_coef[:, None])
    if opts.has_smoothing and class_weight is not None:
        smoothing = smooth_grad * (opts.label_smoothing * opts.inv_vocab_size(vocab_size) * scale)
        probs.sub_(smoothing[:, None] * class_weight.to(probs.dtype))
    elif opts.has_smoothing:
        probs.sub_((loss_grad * (opts.label_smoothing * opts.inv_vocab_size(vocab_size) * scale))[:, None])
    if softcap_grad is not None:
        probs.mul_(softcap_grad)
    # Rows without a gradient get exactly 0, even next to non-finite logits.
    keep = loss_grad != 0
    if lse_grad is not None:
        keep = keep | (lse_grad != 0)
    if entropy_grad is not None:
        keep = keep | (entropy_grad != 0)
    dropped = (~keep).nonzero()[:, 0]
    if dropped.numel():
        probs.index_fill_(0, dropped, 0.0)
    if bias_grad_acc is not None:
        bias_grad_acc += probs.sum(dim=0)
    return probs


def order_rows(targets: torch.Tensor, ignore_index: int, mean: bool):
    """As ``_triton_backend.order_rows``: (order, targets[order], count [1], loss_grad)."""
    has_loss = targets != ignore_index
    order = torch.argsort(has_loss.logical_not().to(torch.uint8), stable=True)
    count = has_loss.sum().reshape(1)
    row_grad = 1.0 / count.float() if mean else torch.ones(1, device=targets.device)
    loss_grad = torch.where(torch.arange(targets.shape[0], device=targets.device) < count, row_grad, 0.0)
    return order, targets[order].long(), count, loss_grad


def mean_grad_ratio(row_grad: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """[2] fp32: 1 if ``row_grad`` is one value c on every row with a target (else 0), then -c / w
    with w = 1 / their count (``_target_kernels._mean_grad_ratio_kernel``)."""
    valid = targets != ignore_index
    # c: the first row with a target's gradient, 0 where none has one (an empty batch too), as the kernel
    first = torch.argmax(torch.cat([valid, valid.new_ones(1)]).to(torch.int8))
    common = torch.cat([row_grad.float(), row_grad.new_zeros(1, dtype=torch.float32)])[first]
    uniform = torch.where(valid, row_grad == common, True).all()
    weight = 1.0 / valid.sum().clamp(min=1).float()
    return torch.stack([uniform.float(), -common / weight])


def step_target_logits(hidden, weight, targets, opts: LossOptions, bias=None, rows=None) -> None:
    """None: ``row_stats`` picks each chunk's target logits from the chunk's own logits."""
    return None


def grad_from_stored(buffer, state, targets, lse, loss_grad, opts: LossOptions, bias_grad_acc):
    """Grad logits [rows, V], in place in the buffer that ``row_stats`` filled with
    exp(z - row max): the softmax is that times exp(row max - lse)."""
    row_max, softcap_grad = state
    probs_scale = (_safe(row_max) - lse).exp()
    return _grad_in_place(buffer, probs_scale, targets, lse, loss_grad, None, opts, softcap_grad, bias_grad_acc)


def kept_row_bytes(vocab_size: int, dtype: torch.dtype, has_softcap: bool) -> int:
    """A kept row's bytes: its fp32 exponentials and, with a softcap, the derivative beside them."""
    return vocab_size * accumulation_dtype(dtype).itemsize * (2 if has_softcap else 1)


def grad_from_kept(buffer, state, row_ref, targets, lse, loss_grad, lse_grad, entropy_grad, opts: LossOptions,
                   bias_grad_acc):
    """Grad logits [rows, V] of kept rows, in place in ``buffer`` (exp(z - row max) from
    ``row_stats``; ``row_ref`` belongs to the factored sweep, never taken here):
    p = e exp(row max - lse) and log p = log e + row max - lse."""
    row_max, softcap_grad = state
    log_scale = _safe(row_max) - lse
    log_probs = None
    if entropy_grad is not None:  # (an e flushed to 0 has p = 0: its log, clamped, is never weighed)
        log_probs = buffer.clamp_min(torch.finfo(buffer.dtype).tiny).log_().add_(log_scale[:, None])
    return _grad_in_place(buffer, log_scale.exp(), targets, lse, loss_grad, lse_grad, opts, softcap_grad,
                          bias_grad_acc, entropy_grad=entropy_grad, log_probs=log_probs)


def grad_logits(hidden, weight, bias, targets, lse, loss_grad, lse_grad, opts: LossOptions, out, bias_grad_acc,
                class_weight=None, smooth_grad=None, entropy_grad=None):
    """Recomputes a chunk's logits into ``out`` and turns them into its grad logits [rows, V]
    (lse known, for the z-loss term); with label smoothing, ``class_weight`` [V] and
    ``smooth_grad`` [rows] weight the smoothing term.

    The softmax is normalised by the recomputed logits' own sum, not by the forward's lse: BLAS
    rounds a row's logits differently in another matrix shape or at another row position (the
    forward's chunks gather the rows with a loss and are planned otherwise), and exp(z - lse)
    turns a rounding of z into the same relative error of p: 1e-3 at |z| ~ 1e4 in fp32. A slice of
    a sharded vocabulary (``opts.group``) holds only part of each row's sum: it takes the
    forward's merged lse."""
    logits = _logits(hidden, weight, bias, opts, out=out)
    softcap_grad = _softcap_grad(logits, opts) if opts.has_softcap else None
    if opts.group is not None:  # a slice of the vocabulary: normalised by the merged lse
        log_probs = logits.sub_(lse[:, None])
        saved_log_probs = log_probs.clone() if entropy_grad is not None else None
        probs = log_probs.exp_()
        return _grad_in_place(probs, None, targets, lse, loss_grad, lse_grad, opts, softcap_grad, bias_grad_acc,
                              class_weight, smooth_grad, entropy_grad, saved_log_probs)
    row_max = _safe(logits.amax(dim=1))
    shifted = logits.sub_(row_max[:, None])
    saved_log_probs = shifted.clone() if entropy_grad is not None else None
    exp_shifted = shifted.exp_()
    sum_exp = exp_shifted.sum(dim=1)
    if saved_log_probs is not None:  # log p = z - max - log sum_j exp(z_j - max)
        saved_log_probs.sub_(sum_exp.log()[:, None])
    return _grad_in_place(exp_shifted, sum_exp.reciprocal(), targets, lse, loss_grad, lse_grad, opts, softcap_grad,
                          bias_grad_acc, class_weight, smooth_grad, entropy_grad, saved_log_probs)


def zero_rows(dst: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[rows] = 0 in place (rows int64 [n])."""
    dst.index_fill_(0, rows, 0)


def scale_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x *= scale in place."""
    x.mul_(scale)
