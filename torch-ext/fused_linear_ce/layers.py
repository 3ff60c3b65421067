"""Layers for ``kernels.kernelize``: stateless modules whose ``forward`` replaces a model's.

The kernels library (0.17) accepts a layer that subclasses ``nn.Module`` with no ``__init__``
and no members besides ``can_torch_compile`` and ``has_backward``, and whose ``forward`` has as
many parameters, of the same kinds, as the forward it replaces. ``kernelize`` binds that
``forward`` to the original module, so it must not read ``self``.
"""

import torch.nn.functional as F
from torch import Tensor, nn

from .causal_lm import causal_lm_loss, shift_labels_for_causal_lm

# Keyword arguments of a loss call that the fused path understands; the others (the model's
# own kwargs, which transformers forwards to its loss) are ignored, as ForCausalLMLoss does.
_LOSS_KWARGS = ("return_metrics", "label_smoothing", "z_loss_scale", "return_lse")


class ForCausalLMLoss(nn.Module):
    """transformers' ``ForCausalLMLoss``, from the hidden states and the lm_head when given.

    For a loss module registered with ``@use_kernel_forward_from_hub("ForCausalLMLoss")`` whose
    forward has this signature. With ``hidden_states`` and ``lm_head_weight``, computes the loss
    with ``causal_lm_loss`` (no logits); the final-logit transform comes from the kwargs
    ``logit_scale`` and ``final_logit_softcapping`` (names of the transformers config
    attributes), and ``return_metrics``, ``label_smoothing``, ``z_loss_scale``, ``return_lse``
    are passed through. Given only ``logits``, computes what transformers does from them.
    """

    can_torch_compile = True
    has_backward = True

    def forward(
        self,
        logits: Tensor | None = None,
        labels: Tensor | None = None,
        vocab_size: int | None = None,
        num_items_in_batch: Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: Tensor | None = None,
        hidden_states: Tensor | None = None,
        lm_head_weight: Tensor | None = None,
        lm_head_bias: Tensor | None = None,
        **kwargs,
    ):
        """Loss (0-d float32), or a tuple with metrics/lse as ``causal_lm_loss`` returns it.

        Shapes: logits (B, S, V); labels / shift_labels (B, S); hidden_states (B, S, H);
        lm_head_weight (V, H); lm_head_bias (V,).
        """
        if hidden_states is not None and lm_head_weight is not None:
            softcap = kwargs.get("final_logit_softcapping")
            logit_scale = kwargs.get("logit_scale")
            return causal_lm_loss(
                hidden_states, lm_head_weight, labels, lm_head_bias, num_items_in_batch, ignore_index, shift_labels,
                logit_scale=1.0 if logit_scale is None else float(logit_scale),
                softcap=float(softcap) if softcap else None,
                **{k: kwargs[k] for k in _LOSS_KWARGS if k in kwargs},
            )
        if logits is None:
            raise ValueError("ForCausalLMLoss needs logits, or hidden_states and lm_head_weight")
        return _logits_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels)


def _logits_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels) -> Tensor:
    # transformers 5.x's ForCausalLMLoss, for a caller that only has the logits.
    logits = logits.float()
    if shift_labels is None:
        shift_labels = shift_labels_for_causal_lm(labels, ignore_index)
    vocab_size = logits.shape[-1] if vocab_size is None else vocab_size
    targets = shift_labels.reshape(-1).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.view(-1, vocab_size), targets, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
