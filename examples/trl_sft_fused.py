"""Supervised fine-tuning with TRL's SFTTrainer and the fused linear cross-entropy.

``FusedSFTTrainer`` computes the loss from the backbone's hidden states and the lm_head with the
fused kernel (no (tokens, vocab) logits), and logs TRL 1.16's ``mean_token_accuracy`` and
``entropy`` with TRL's definitions: per micro-batch, the counts and sums over the non-ignored
next-token labels, summed over the ranks (``accelerator.gather_for_metrics``), then divided.
Its ``loss``, ``num_tokens`` and the training itself match ``SFTTrainer`` (loss_type "nll").

    python examples/trl_sft_fused.py        # a tiny random Llama, a few steps on the CPU

The reusable parts live in the kernel: ``patch_forward`` (the model's forward with a fused loss)
and ``token_metrics`` (the cross-rank ratios); only the TRL wiring is here.
"""

import torch
from accelerate.utils import is_peft_model
from trl import SFTConfig, SFTTrainer

KERNEL_REPO = "qgallouedec/fused-linear-ce"


def load_kernel():
    """The fused-linear-ce kernel: from the Hub through ``kernels`` (or a LOCAL_KERNELS checkout)."""
    from kernels import get_kernel

    return get_kernel(KERNEL_REPO, version=1, trust_remote_code=True)


class FusedSFTTrainer(SFTTrainer):
    """``SFTTrainer`` whose loss is the fused linear cross-entropy of the model's last hidden states.

    Args:
        *args, **kwargs: those of ``SFTTrainer``.
        kernel: the loaded fused-linear-ce module (``load_kernel()`` by default).
    """

    def __init__(self, *args, kernel=None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.loss_type != "nll" or self.label_smoother is not None or self.compute_loss_func is not None:
            raise ValueError("FusedSFTTrainer computes the plain NLL loss (loss_type='nll', no label smoothing, "
                             "no compute_loss_func)")
        if self.aux_loss_enabled:
            raise ValueError("FusedSFTTrainer does not add the MoE router loss")
        self.flce = load_kernel() if kernel is None else kernel
        # SFTTrainer has already patched the forward with its own fused LM head (`fused_lm_head=True`);
        # ours wraps it and takes over only when called with `fused_loss=True`.
        model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        self.flce.patch_forward(model, when_training=False)

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
        stats = self.flce.token_metrics(
            outputs.metrics, sum_across=lambda t: self.accelerator.gather_for_metrics(t).sum()
        )
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


def tiny_setup(vocab_size: int = 128, num_examples: int = 16, seed: int = 0):
    """A tiny random Llama, a word-level tokenizer and a pre-tokenized prompt-completion dataset,
    built in code (nothing is downloaded)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_examples):
        prompt, completion = (int(n) for n in torch.randint(2, 7, (2,), generator=g))
        # a random prompt, then a completion easy to learn: the same words every time
        ids = torch.randint(3, vocab_size, (prompt,), generator=g).tolist() + list(range(7, 7 + completion))
        rows.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * completion})
    return model, tokenizer, Dataset.from_list(rows)


def main():
    model, tokenizer, dataset = tiny_setup()
    args = SFTConfig(
        output_dir="/tmp/trl_sft_fused", max_steps=5, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        completion_only_loss=True,
    )
    trainer = FusedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    for record in trainer.state.log_history:
        print(record)


if __name__ == "__main__":
    main()
