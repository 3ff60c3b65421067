"""Causal-LM loss straight from the hidden states, as transformers computes it from the logits.

transformers' ``ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index,
shift_labels)`` shifts the labels (pads them with ``ignore_index`` and drops the first), takes
the cross-entropy of the fp32 logits, and divides the sum by ``num_items_in_batch`` when it is
given (so that gradient accumulation is exact), else takes the mean. ``causal_lm_loss`` does the
same from ``hidden_states`` and the lm_head, without the (tokens, vocab) logits.

``token_metrics`` turns the metric sums of ``return_metrics=True`` into accuracy and entropy
across ranks. The model-level helpers (``logit_options``, ``fused_forward``, ``patch_forward``)
live in ``patching``.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .interface import fused_linear_cross_entropy


def shift_labels_for_causal_lm(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Targets of each position, as ``ForCausalLMLoss`` makes them: ``labels[..., 1:]`` with one
    ``ignore_index`` appended, so the result has ``labels``' shape (B, S) and position i predicts
    ``labels[..., i + 1]``."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def causal_lm_loss(
    hidden_states: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    return_metrics: bool = False,
    *,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    return_lse: bool = False,
    reduction: str = "mean",
):
    """transformers' ``ForCausalLMLoss`` of the logits ``lm_head(hidden_states)``, without the logits.

    The logits are ``z = (hidden_states @ lm_head_weight.T + lm_head_bias) * logit_scale``, then
    ``softcap * tanh(z / softcap)`` when ``softcap`` is set (Gemma-2/3's final_logit_softcapping).

    Args:
        hidden_states: (B, S, H) (any leading shape), the backbone's last hidden states.
        lm_head_weight: (V, H), hidden_states' dtype (the embedding matrix when tied).
        labels: (B, S) int64, unshifted: position i is scored against ``labels[..., i + 1]``.
            Ignored when ``shift_labels`` is given.
        lm_head_bias: (V,) or None.
        num_items_in_batch: if given, the loss is the sum over the non-ignored positions divided
            by it (a count over all micro-batches, as the HF Trainer passes it), else their mean.
        ignore_index: label of positions without a loss.
        shift_labels: (B, S) targets already shifted (context/sequence parallelism); used as is.
        logit_scale, softcap: see above.
        return_metrics: also return ``{"num_correct_tokens": int64, "entropy_sum": float32,
            "num_valid_tokens": int64}``, 0-d sums over the non-ignored positions (see
            ``token_metrics`` to turn them into accuracy and mean entropy across ranks), and
            ``"predictions"``, the argmax at each scored position (int64, the labels' shape, -1
            where the label is ignored).
        label_smoothing, z_loss_scale: passed to ``fused_linear_cross_entropy`` (0 = off).
        return_lse: also return the per-position ``logsumexp(z)``, float32 of the targets' shape.
        reduction: "mean" (transformers' loss, as above), "sum" (the sum over the non-ignored
            positions) or "none" (float32 (B, S): position i's loss against ``labels[..., i + 1]``,
            0 at ignored positions and at the last one); ``num_items_in_batch`` divides "mean" only.

    Returns:
        ``loss`` (0-d float32, or (B, S) with "none"), or ``(loss, metrics)``, ``(loss, lse)``,
        ``(loss, metrics, lse)``. With mean reduction and no valid position the loss is NaN, as in
        transformers.
    """
    given_shifted = shift_labels is not None
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss needs labels or shift_labels")
        shift_labels = shift_labels_for_causal_lm(labels, ignore_index)
    hidden_size = hidden_states.shape[-1]
    hidden_2d = hidden_states.reshape(-1, hidden_size)
    targets = shift_labels.reshape(-1).to(hidden_2d.device)
    if targets.shape[0] != hidden_2d.shape[0]:
        given, shape = ("shift_labels", shift_labels.shape) if given_shifted else ("labels", labels.shape)
        raise ValueError(f"{given} of shape {tuple(shape)} do not match hidden_states of shape "
                         f"{tuple(hidden_states.shape)}: one label per position of its leading shape "
                         f"{tuple(hidden_states.shape[:-1])}")
    # (under torch.autocast, fused_linear_cross_entropy casts as lm_head's F.linear would)
    divide = reduction == "mean" and num_items_in_batch is not None
    out = fused_linear_cross_entropy(
        hidden_2d, lm_head_weight, targets, lm_head_bias, ignore_index, logit_scale, softcap,
        "sum" if divide else reduction, return_metrics,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, return_lse=return_lse,
    )
    out = list(out) if isinstance(out, tuple) else [out]
    if divide:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(out[0].device)
        out[0] = out[0] / num_items_in_batch
    if return_metrics:
        per_row = ("predictions", "correct_tokens", "entropy")
        out[1] = {**out[1], **{k: out[1][k].reshape(shift_labels.shape) for k in per_row if k in out[1]}}
    if reduction == "none":
        out[0] = out[0].reshape(shift_labels.shape)
    if return_lse:
        out[-1] = out[-1].reshape(shift_labels.shape)
    return out[0] if len(out) == 1 else tuple(out)


def token_metrics(
    metrics: dict[str, Tensor], sum_across: Callable[[Tensor], Tensor] | None = None
) -> dict[str, Tensor]:
    """Token accuracy and mean entropy from the metric sums of ``return_metrics=True``.

    Each sum is first summed over ranks, then divided, so that the result is the ratio over all the
    ranks' tokens (not a mean of per-rank ratios). 0 when there is no valid token (as TRL logs).

    Args:
        metrics: ``{"num_correct_tokens", "entropy_sum", "num_valid_tokens"}``, 0-d tensors, as
            ``fused_linear_cross_entropy`` and ``causal_lm_loss`` return them with ``return_metrics=True``.
        sum_across: sums a 0-d tensor over the ranks, e.g.
            ``lambda t: accelerator.gather_for_metrics(t).sum()``. By default an all-reduce of the
            default ``torch.distributed`` group when one is initialised, else the identity.

    Returns:
        ``{"mean_token_accuracy": float32 0-d, "entropy": float32 0-d}`` (entropy in nats).
    """
    if sum_across is None:
        sum_across = _all_reduce_sum
    missing = {"num_correct_tokens", "entropy_sum", "num_valid_tokens"} - metrics.keys()
    if missing:
        raise KeyError(f"token_metrics needs the metrics of return_metrics=True; missing {sorted(missing)}")
    num_valid = sum_across(metrics["num_valid_tokens"].detach()).float()
    correct = sum_across(metrics["num_correct_tokens"].detach()).float()
    entropy = sum_across(metrics["entropy_sum"].detach()).float()
    has_tokens = num_valid > 0
    denominator = torch.where(has_tokens, num_valid, torch.ones_like(num_valid))
    zero = torch.zeros_like(num_valid)
    return {
        "mean_token_accuracy": torch.where(has_tokens, correct / denominator, zero),
        "entropy": torch.where(has_tokens, entropy / denominator, zero),
    }


def _all_reduce_sum(t: Tensor) -> Tensor:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t

