"""The public loss: its inputs checked (``_validation``), shaped, and the choice of the gradient path."""


import torch
import torch.nn.functional as F
from torch import Tensor

from ._chunked import backend_for
from ._distributed import check_ranks_agree, vocabulary_layout
from ._dtensor import dtensor_loss, has_dtensor
from ._ops import FunctorchLoss, loss_forward
from ._options import LossOptions, accumulation_dtype
from ._validation import (
    INT32,
    autocast_inputs,
    check_class_weight,
    check_process_group,
    checked_loss_arguments,
    finish_target_check,
    start_target_check,
    targets_checked,
    under_functorch,
)


def _shift_targets(targets: Tensor, shift: int, ignore_index: int) -> Tensor:
    """Position i's target becomes ``targets[..., i + shift]``; the last ``shift`` positions get
    ``ignore_index``, which is the same loss as dropping them from hidden (without a copy of it)."""
    return F.pad(targets[..., shift:], (0, min(shift, targets.shape[-1])), value=ignore_index)


def _drop_shifted(per_row: Tensor, shift: int) -> Tensor:
    """The positions that have a shifted target: all but the last ``shift``."""
    return per_row[..., : max(per_row.shape[-1] - shift, 0)] if shift else per_row


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_metrics: bool = False,
    *,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    return_lse: bool = False,
    class_weight: Tensor | None = None,
    process_group: "torch.distributed.ProcessGroup | None" = None,
    vocab_start: int | None = None,
    shift: int = 0,
):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, without the logits.

    The logits are ``z = (hidden @ weight.T + bias) * logit_scale``, then
    ``softcap * tanh(z / softcap)`` when ``softcap`` is set; the loss equals
    ``F.cross_entropy(z.float(), targets, weight=class_weight, ignore_index=...,
    reduction=..., label_smoothing=...)``, plus the z-loss ``z_loss_scale * logsumexp(z)**2`` of
    each non-ignored row (summed, or averaged over those rows for "mean"; never class-weighted).

    Args:
        hidden: (..., H) float32, bfloat16, float16 or float64.
        weight: (V, H), hidden's dtype.
        targets: hidden's leading shape, int64 (or int32, compared in int64); ``ignore_index``
            marks rows without a loss.
        bias: (V,) in hidden's dtype, or None.
        ignore_index: target value of ignored rows.
        logit_scale: multiplies the logits (before the softcap).
        softcap: if set (> 0), logits become ``softcap * tanh(z / softcap)``. This option and
            the other float ones take a number or a 0-d tensor (read on the host, no gradient).
        reduction: "mean" (over non-ignored rows, or weighted by ``class_weight``; NaN when all
            are ignored, as PyTorch), "sum", or "none" (float32 of targets' shape, 0 at ignored
            rows).
        return_metrics: also return ``{"num_correct_tokens": int64, "entropy_sum": float32,
            "num_valid_tokens": int64, "predictions": int64}``: sums over non-ignored rows of
            (argmax == target) and of the softmax entropy in nats, the count of those rows
            (``token_metrics`` turns them into means), and the argmax of each row (targets'
            shape, -1 at ignored rows); with reduction "none" also per row ``"correct_tokens"``
            (bool, False at ignored rows) and ``"entropy"`` (float32, 0 at ignored rows).
            Forward-only, unweighted by ``class_weight``; the loss and gradients are
            bit-identical either way.
        label_smoothing: PyTorch's label smoothing, in [0, 1].
        z_loss_scale: weight of the z-loss ``logsumexp(z)**2`` (PaLM), >= 0.
        return_lse: also return the per-row ``logsumexp(z)`` (float32, targets' shape),
            which receives gradients too.
        class_weight: (V,) of the whole vocabulary (every rank passes all of it under
            ``process_group``), any float dtype, or None: ``F.cross_entropy``'s ``weight``. Row i's
            cross-entropy counts w[t_i] times and a mean divides it by the sum of w[t_i] over the
            non-ignored rows; label smoothing combines with it as in PyTorch. The z-loss is not
            weighted, as in Liger-Kernel's fused linear cross-entropy (the same loss for users who
            switch): "mean" is ``sum_i w[t_i] CE_i / sum_i w[t_i] + z_loss_scale * sum_i lse_i**2 /
            n_valid``, "none" ``w[t_i] CE_i + z_loss_scale * lse_i**2``. No gradient.
        process_group: vocabulary parallelism. ``weight`` (and ``bias``) hold this rank's
            contiguous slice of the vocabulary's rows; ``hidden`` and ``targets`` (global
            indices) are the same on every rank. Every rank gets the loss and metrics of the
            whole vocabulary and the full grad of ``hidden``; weight and bias get their
            slice's gradients. Ranks whose arguments disagree (N, H, dtype, options, targets,
            class_weight, which inputs take gradients, slices that do not tile the vocabulary)
            all raise the same ValueError: one all-reduce of a few int64 per rank and a host
            sync per call, skipped where the targets' range check is (torch.compile, CUDA-graph
            capture, ``FLCE_CHECK_TARGETS=0``).
        vocab_start: index of this rank's first vocabulary row; by default the slices are
            taken to lie in rank order.
        shift: the causal-LM shift along the last dim of ``targets`` (the sequence dim of
            ``hidden``): with ``shift=1``, position i is scored against ``targets[..., i + 1]``,
            i.e. the last position of hidden and the first target are dropped, as
            transformers does for ``labels``. With ``reduction="none"`` and ``return_lse`` the
            outputs have ``shift`` fewer positions.

    DTensor inputs: ``weight`` (and ``bias``) placed ``Shard(0)`` on a 1-D device mesh, with
    ``hidden`` and ``targets`` plain or ``Replicate()`` on that mesh, is vocabulary parallelism
    over the mesh (group and ``vocab_start`` from the placement); ``weight.grad`` comes back
    sharded as ``weight``. Other layouts raise an error that says what is supported.

    Returns:
        ``loss``, or a tuple ``(loss, metrics)``, ``(loss, lse)`` or ``(loss, metrics, lse)``.
        float64 inputs give float64 loss, lse and entropy.

    Under ``torch.autocast`` the three take the autocast dtype first, as ``F.linear``'s
    inputs would; outside it they must share one dtype.

    Gradients reach ``hidden``, ``weight`` and ``bias``. When they are needed and the
    reduction is "mean" or "sum" (without ``return_lse``), they are computed during the
    forward and only scaled by the backward, so call it under ``torch.no_grad()`` when no
    backward will follow. The gradients are not differentiable: a backward with
    ``create_graph=True`` (e.g. for a gradient penalty) raises a ``RuntimeError``, and so does a
    grad of a grad under ``torch.func``. An in-place change of ``hidden``, ``weight``,
    ``targets`` or ``class_weight`` before the backward raises there, as with ``F.linear`` +
    ``F.cross_entropy``.

    Under ``torch.func`` transforms, ``grad``, ``grad_and_value``, ``vjp``, ``jacrev`` and
    ``vmap`` (and their compositions, e.g. per-sample gradients) work, with the gradients
    recomputed in the backward; forward-mode AD (``jvp``, ``jacfwd``, ``hessian``) raises.
    """
    if has_dtensor(hidden, weight, targets, bias):
        return dtensor_loss(
            fused_linear_cross_entropy, hidden, weight, targets, bias, ignore_index, logit_scale, softcap,
            reduction, return_metrics, label_smoothing=label_smoothing, z_loss_scale=z_loss_scale,
            return_lse=return_lse, class_weight=class_weight, process_group=process_group, vocab_start=vocab_start,
            shift=shift,
        )
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    logit_scale, softcap, label_smoothing, z_loss_scale, ignore_index = checked_loss_arguments(
        hidden, weight, targets, bias, ignore_index, logit_scale, softcap, reduction, label_smoothing, z_loss_scale,
        return_metrics, return_lse, shift)
    if targets.dtype == torch.int32 and not (INT32.min <= ignore_index <= INT32.max):
        # No int32 target equals this ignore_index: compare in int64 (before the shift pads with it).
        targets = targets.long()
    if shift:
        targets = _shift_targets(targets, shift, ignore_index)
    vocab_size, hidden_size = weight.shape
    functorch = under_functorch()
    group_name, total_vocab_size = None, vocab_size
    if process_group is not None:
        check_process_group(process_group)
        if targets_checked(targets):  # the ranks' agreement, the slices' tiling and the targets' range, at once
            options = dict(ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap, reduction=reduction,
                           return_metrics=return_metrics, return_lse=return_lse, label_smoothing=label_smoothing,
                           z_loss_scale=z_loss_scale, shift=shift)
            vocab_start, total_vocab_size = check_ranks_agree(process_group, hidden, weight, targets, bias,
                                                              class_weight, vocab_start, options)
        else:
            layout_start, total_vocab_size = vocabulary_layout(process_group, vocab_size, weight.device)
            vocab_start = layout_start if vocab_start is None else int(vocab_start)
        group_name = process_group.group_name
    elif vocab_start is not None:
        raise ValueError("vocab_start needs a process_group")
    if class_weight is not None:
        check_class_weight(class_weight, total_vocab_size, hidden)
        class_weight = class_weight.to(accumulation_dtype(hidden.dtype)).contiguous()  # (itself if it can)
    leading_shape = targets.shape
    hidden_2d = hidden.reshape(-1, hidden_size)  # any strides: columns made adjacent once (_chunked.unit_columns)
    targets_1d = targets.reshape(-1).contiguous()  # the kernels index these two densely
    # The targets' range flag is queued first and read once the loss's work is queued behind
    # it: the host never waits for the loss itself, so the GPU does not idle at the check.
    if not functorch:
        backend_for(hidden.device).precompile("metrics" if return_metrics else "loss", hidden.device)
    target_check = start_target_check(targets_1d, total_vocab_size, ignore_index) if process_group is None else None
    if bias is not None:
        bias = bias.contiguous()
    options = LossOptions(
        ignore_index=int(ignore_index), logit_scale=float(logit_scale),
        softcap=None if softcap is None else float(softcap), label_smoothing=float(label_smoothing),
        z_loss_scale=float(z_loss_scale), total_vocab_size=total_vocab_size, group_name=group_name,
        vocab_start=int(vocab_start or 0),
    )
    if functorch:
        loss, lse, num_correct, entropy_sum, prediction, correct, entropy = FunctorchLoss.apply(
            hidden_2d, weight, targets_1d, bias, class_weight, options, reduction, bool(return_metrics))
    else:
        grad_wanted = torch.is_grad_enabled()
        needs = [grad_wanted and t is not None and t.requires_grad for t in (hidden, weight, bias)]
        # Gradients in the forward's sweep (6 N V H flops) when the backward will only scale
        # them; otherwise recomputed in the backward (8 N V H flops in all). float64 (for
        # verification: gradcheck backpropagates more than once) and class weights with label
        # smoothing or a z-loss (terms the stored-logits pass does not weight) always recompute.
        in_forward = (any(needs) and reduction != "none" and not return_lse and hidden.dtype != torch.float64
                      and not (class_weight is not None and (label_smoothing != 0 or z_loss_scale != 0)))
        loss, lse, num_correct, entropy_sum, _, _, _, prediction, correct, entropy = loss_forward(
            hidden_2d, weight, targets_1d, bias, class_weight, *options.op_args(), reduction, bool(return_metrics),
            *(in_forward and n for n in needs),
            bool(return_lse),
        )
    finish_target_check(target_check)
    if reduction == "none":
        loss = _drop_shifted(loss.reshape(leading_shape), shift)
    outputs = [loss]
    if return_metrics:
        metrics = {"num_correct_tokens": num_correct, "entropy_sum": entropy_sum,
                   "num_valid_tokens": (targets_1d != ignore_index).sum(),
                   "predictions": _drop_shifted(prediction.reshape(leading_shape), shift)}
        if reduction == "none":
            metrics["correct_tokens"] = _drop_shifted(correct.reshape(leading_shape), shift)
            metrics["entropy"] = _drop_shifted(entropy.reshape(leading_shape), shift)
        outputs.append(metrics)
    if return_lse:
        outputs.append(_drop_shifted(lse.reshape(leading_shape), shift))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
