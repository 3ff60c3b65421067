"""TRL's ``SFTTrainer`` with the fused linear cross-entropy: ``FusedSFTTrainer``.

Imported on first use (``fused_linear_ce.trl``, or ``flce.trl`` on the kernel loaded by
``kernels``): it needs TRL (tested with 1.16) and transformers, which the rest of the package
does not import.

``FusedSFTTrainer`` computes the loss from the backbone's hidden states and the lm_head with the
fused kernel (no (tokens, vocab) logits), and logs TRL's ``mean_token_accuracy`` and ``entropy``
with TRL's definitions: per micro-batch, the counts and sums over the non-ignored next-token
labels, summed over the ranks (``accelerator.gather_for_metrics``), then divided. Its ``loss``,
``num_tokens`` and the training itself match ``SFTTrainer`` (loss_type "nll").
"""

import torch
from accelerate.utils import is_peft_model
from trl import SFTTrainer

from .causal_lm import token_metrics
from .patching import patch_forward

__all__ = ["FusedSFTTrainer"]


class FusedSFTTrainer(SFTTrainer):
    """``SFTTrainer`` whose loss is the fused linear cross-entropy of the model's last hidden states.

    Takes the arguments of ``SFTTrainer``. The loss is the plain NLL (``loss_type="nll"``,
    without label smoothing, a ``compute_loss_func`` or the MoE router loss).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.loss_type != "nll" or self.label_smoother is not None or self.compute_loss_func is not None:
            raise ValueError("FusedSFTTrainer computes the plain NLL loss (loss_type='nll', no label smoothing, "
                             "no compute_loss_func)")
        if self.aux_loss_enabled:
            raise ValueError("FusedSFTTrainer does not add the MoE router loss")
        # SFTTrainer has already patched the forward with its own fused LM head (`fused_lm_head=True`);
        # ours wraps it and takes over only when called with `fused_loss=True`.
        model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        patch_forward(model, when_training=False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        inputs["use_cache"] = False
        if num_items_in_batch is None:
            # As TRL: the micro-batch's own token count, at least 1 (no NaN without tokens)
            targets = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][..., 1:]
            divisor = (targets != -100).sum().clamp(min=1)
        else:
            divisor = num_items_in_batch
        outputs = model(**inputs, fused_loss=True, num_items_in_batch=divisor, return_metrics=True)
        loss = outputs.loss
        # As `Trainer.compute_loss`: `num_items_in_batch` counts every rank's tokens, and DDP averages gradients
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())

        # TRL's metrics: sums over the ranks, then ratios (0 without tokens)
        stats = token_metrics(outputs.metrics, sum_across=lambda t: self.accelerator.gather_for_metrics(t).sum())
        self._metrics[mode]["entropy"].append(stats["entropy"].item())
        self._metrics[mode]["mean_token_accuracy"].append(stats["mean_token_accuracy"].item())
        if mode == "train":
            if "attention_mask" in inputs:
                num_tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            elif "position_ids" in inputs:
                local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
                num_tokens = self.accelerator.gather_for_metrics(local).sum().item()
            else:
                raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
            self._total_train_tokens += num_tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

        if return_outputs:  # evaluation asking for logits: one more forward, without the loss
            with torch.no_grad():
                outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        return (loss, outputs) if return_outputs else loss
