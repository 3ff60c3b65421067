"""Supervised fine-tuning with TRL and the fused linear cross-entropy, on a tiny random model.

TRL's trainers (SFT, DPO, GRPO, KTO, RLOO) compute their per-token log-probabilities through a
fused LM head that never materializes the (tokens, vocab) logits. ``flce.trl.use_in_trl()``
(``fused_linear_ce.trl`` when pip-installed) makes that head run fused-linear-ce's kernel: call it
before building the trainer, and ``use_in_trl(False)`` to get TRL's own head back. This script
builds a tiny random Llama, a word-level tokenizer and prompt-completion data in code (nothing
is downloaded) and trains ``SFTTrainer`` a few steps.

    python examples/trl_sft_fused.py        # on the CPU, the kernel from this checkout
"""

import os
import subprocess
import sys
from pathlib import Path

import torch
from trl import SFTConfig, SFTTrainer

ROOT = Path(__file__).resolve().parents[1]

REPO_ID = "qgallouedec/fused-linear-ce"


def load_kernel():
    """The fused-linear-ce kernel through ``kernels``: from the Hub, or from this checkout when
    offline (LOCAL_KERNELS, set here unless already set)."""
    from kernels import get_kernel

    if "LOCAL_KERNELS" not in os.environ:  # this checkout; its build/ (not tracked) is made from torch-ext/ first
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_variants.py")], check=True)
        os.environ["LOCAL_KERNELS"] = f"{REPO_ID}={ROOT}"
    return get_kernel(REPO_ID, version=1, trust_remote_code=True)


def tiny_setup(vocab_size: int = 128, num_examples: int = 16, seed: int = 0, initializer_range: float = 0.02):
    """A tiny random Llama (2 layers, hidden 32), a word-level tokenizer ("w3 w17 ..." -> ids) and a
    pre-tokenized prompt-completion dataset, built in code (nothing is downloaded)."""
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
                         eos_token_id=2, initializer_range=initializer_range)
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
    flce = load_kernel()
    flce.trl.use_in_trl()  # TRL's fused LM head now runs fused-linear-ce
    try:
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
    finally:
        flce.trl.use_in_trl(False)
    for record in trainer.state.log_history:
        print(record)


if __name__ == "__main__":
    main()
