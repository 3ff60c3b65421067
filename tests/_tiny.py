"""Tiny randomly initialised transformers causal LMs and batches for the integration tests.

Nothing is downloaded: every model is built from a config in code. The batches have ignored
labels (a prompt, padding) and labels that agree with the model's own argmax at some
positions, so that the token accuracy is not trivially 0.
"""

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # the kernel repository (build/ inside)
VOCAB = 128
HIDDEN = 32

# name -> (config class, model class, config overrides): the final-logit transforms and
# lm_head variants that the causal-LM loss must reproduce.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "gemma2-softcap": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 3.0, "head_dim": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "cohere-logit-scale": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
    "granite-logits-scaling": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
    "phi-bias": ("PhiConfig", "PhiForCausalLM", {}),
}


def tiny_causal_lm(arch: str = "llama", seed: int = 0, **overrides):
    """A float32 ``*ForCausalLM`` with 2 layers, hidden 32, vocab 128, in train mode (no dropout)."""
    import transformers

    config_name, model_name, arch_overrides = ARCHS[arch]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        # larger weights than the default 0.02: peaked logits, so softcap, accuracy and entropy matter
        **{"initializer_range": 0.5, **arch_overrides, **overrides},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    return model.train()


def tiny_batch(model, batch: int = 2, seq: int = 12, seed: int = 0) -> dict:
    """``{"input_ids", "attention_mask", "labels"}``: a prompt masked with -100 in row 0, right
    padding in row 1, and labels equal to the model's argmax prediction at every other position."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    input_ids[1, -3:] = 0
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    labels = input_ids.clone()
    labels[:, 2::2] = logits.argmax(-1)[:, 1:-1:2]  # position i predicts labels[i + 1]
    labels[0, :4] = -100
    labels[attention_mask == 0] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def logits_metrics(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> dict:
    """Reference metrics of ``ForCausalLMLoss``'s positions from the model's logits, in float64:
    correct-token count, entropy sum and count of the non-ignored shifted labels."""
    targets = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    valid = targets != ignore_index
    logp = logits.double().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return {
        "num_correct_tokens": int((logits.argmax(-1) == targets)[valid].sum()),
        "entropy_sum": float(entropy[valid].sum()),
        "num_valid_tokens": int(valid.sum()),
    }


def assert_grads_close(model, reference: dict, rel: float = 1e-5) -> None:
    """Every parameter's gradient equals ``reference[name]`` within ``rel`` of its largest entry."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert set(names) == set(reference), "not every parameter got a gradient"
    for name, p in model.named_parameters():
        ref = reference[name]
        assert p.grad is not None, f"{name} got no gradient"
        scale = ref.abs().max().item()
        torch.testing.assert_close(p.grad, ref, rtol=rel, atol=rel * scale + 1e-12, msg=lambda m, n=name: f"{n}: {m}")


def assert_grads_as_accurate(model, exact: dict, fp32: dict, factor: float = 2.0, rel: float = 1e-5) -> None:
    """Every parameter's gradient is within ``factor`` times the fp32 model's own error of the
    float64 model's gradient ``exact[name]`` (largest entries, over the parameter), or within
    ``rel`` of its largest entry. Deep in a model, fp32's rounding is amplified by the backward
    (about 1e-4 of the first layers' gradients in these tiny models): two fp32 computations
    that add in different orders then differ by that much, so the fp32 model is not the truth."""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert p.grad is not None, f"{name} got no gradient"
        truth = exact[name]
        scale = truth.abs().max().item()
        ours = (p.grad.double() - truth).abs().max().item()
        theirs = (fp32[name].double() - truth).abs().max().item()
        assert ours <= factor * theirs + rel * scale + 1e-12, f"{name}: error {ours:.3g}, the fp32 model's {theirs:.3g}"


def grads(model) -> dict:
    """Copies of the parameters' gradients, by name (tied parameters appear once)."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
