"""Tiny randomly initialised transformers causal LMs and batches for the integration tests.

Nothing is downloaded: every model is built from a config in code. The batches have ignored
labels (a prompt, padding) and labels that agree with the model's own argmax at some
positions, so that the token accuracy is not trivially 0.
"""

from dataclasses import dataclass
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


# ---- TRL's trainers -----------------------------------------------------------------------
# TRL 1.16's trainers score tokens through a fused LM head (trl.trainer.utils.add_fused_lm_head),
# which calls the module global ``_ChunkedLogProbFunction``; ``flce.trl.use_in_trl()`` replaces it.
TRAINERS = ("sft", "dft", "dpo", "kto", "grpo", "rloo")
GENERATING = ("grpo", "rloo")
# Logged values that measure the clock, not the training (``train_runtime``, ``eval_steps_per_second``...).
CLOCK_SUFFIXES = ("step_time", "_runtime", "_per_second")


def trl_example():
    """examples/trl_sft_fused.py as a module (its ``tiny_setup`` builds the model, tokenizer and data)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_sft_fused", ROOT / "examples" / "trl_sft_fused.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_tiny_checkpoint(path: Path, seed: int = 0) -> str:
    """Saves the example's tiny Llama and tokenizer to ``path`` and returns it: the trainers load the
    model from there, as users do, and GRPO and RLOO their reference model too."""
    # larger weights than the default 0.02: peaked next-token distributions, so that entropy,
    # accuracy and the rewards' log-ratios are not those of a uniform distribution
    model, tokenizer, _ = trl_example().tiny_setup(seed=seed, initializer_range=0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _words(generator: torch.Generator, n: int, low: int = 3, high: int = VOCAB) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(low, high, (n,), generator=generator))


def trl_dataset(kind: str, num_examples: int, seed: int = 0):
    """A text dataset in the format trainer ``kind`` takes: prompt-completion (sft), preference
    pairs (dpo), labelled completions (kto), prompts alone (grpo, rloo)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num_examples):
        prompt = _words(g, 3)
        # completions easy to learn (the same words every time) against random ones
        good, bad = " w7 w8 w9", " " + _words(g, 2)
        rows.append({
            "sft": {"prompt": prompt, "completion": good},
            "dft": {"prompt": prompt, "completion": good},
            "dpo": {"prompt": prompt, "chosen": good, "rejected": bad},
            "kto": {"prompt": prompt, "completion": good if i % 2 else bad, "label": bool(i % 2)},
            "grpo": {"prompt": prompt},
            "rloo": {"prompt": prompt},
        }[kind])
    return Dataset.from_list(rows)


def completion_length_reward(completions: list[str], **kwargs) -> list[float]:
    """A tiny reward: the completion's length in characters, over 10."""
    return [len(c) / 10 for c in completions]


class CountingHead:
    """Stands for ``_ChunkedLogProbFunction``: counts the calls (with the outputs each asks for)
    and forwards them to the head it wraps."""

    def __init__(self, head):
        self.head, self.outputs = head, []

    def apply(self, *args):
        self.outputs.append(tuple(args[-1]))
        return self.head.apply(*args)


@dataclass
class TrlRun:
    """What a few steps of a TRL trainer produced: the log records (without clock values), the
    parameters after training, the completions the reward function saw (GRPO, RLOO), the head
    that scored the tokens and the outputs of each of its calls."""

    logs: list[dict]
    params: dict[str, torch.Tensor]
    completions: list[str]
    head: object
    head_calls: list[tuple[str, ...]]


def train_trl(kind: str, model_path: str, output_dir: Path, use_in_trl=None, *, steps: int = 3,
              use_cpu: bool = True, bf16: bool = False) -> TrlRun:
    """Trains TRL's trainer ``kind`` (one of TRAINERS) ``steps`` SGD steps from the checkpoint at
    ``model_path``, with TRL's fused head, or, given ``use_in_trl`` (``flce.trl.use_in_trl``), with the
    one it installs (and removes after); the non-generating trainers then evaluate once.

    Everything is seeded (the trainers call ``set_seed(args.seed)``), so two runs draw the same
    batches and, with the same weights, sample the same completions."""
    import trl
    from trl.trainer import utils

    seen = []  # the completions the reward function scored

    def reward(completions: list[str], **kwargs) -> list[float]:
        seen.extend(completions)
        return completion_length_reward(completions)

    common = dict(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        optim="sgd", learning_rate=0.5, logging_steps=1, report_to="none", save_strategy="no", use_cpu=use_cpu,
        bf16=bf16, seed=0, disable_tqdm=True,
    )
    # GRPO: the entropy bonus, the reference model's KL (beta) and two iterations on each generation
    # (the second with the old log-probs, importance ratios != 1); at temperature 0.7, a few tokens
    sampling = dict(use_vllm=False, num_generations=2, max_completion_length=4, temperature=0.7, beta=0.04)
    configs = {
        "sft": (trl.SFTConfig, trl.SFTTrainer, dict(completion_only_loss=True)),
        # SFT's DFT loss: each token's -log p_t weighted by its detached p_t (per-token upstreams)
        "dft": (trl.SFTConfig, trl.SFTTrainer, dict(completion_only_loss=True, loss_type="dft")),
        "dpo": (trl.DPOConfig, trl.DPOTrainer, {}),
        "kto": (trl.KTOConfig, trl.KTOTrainer, {}),
        "grpo": (trl.GRPOConfig, trl.GRPOTrainer, dict(**sampling, entropy_coef=0.1, num_iterations=2)),
        "rloo": (trl.RLOOConfig, trl.RLOOTrainer, sampling),
    }
    config_cls, trainer_cls, extra = configs[kind]
    kwargs = dict(model=model_path, args=config_cls(**common, **extra), train_dataset=trl_dataset(kind, 16))
    if kind in GENERATING:
        kwargs["reward_funcs"] = reward
    else:
        kwargs["eval_dataset"] = trl_dataset(kind, 4, seed=1)

    trl_head = utils._ChunkedLogProbFunction
    if use_in_trl is not None:
        use_in_trl()
    try:
        head = CountingHead(utils._ChunkedLogProbFunction)
        utils._ChunkedLogProbFunction = head
        try:
            trainer = trainer_cls(**kwargs)
            trainer.train()
            if kind not in GENERATING:
                trainer.evaluate()
        finally:
            utils._ChunkedLogProbFunction = head.head
    finally:
        if use_in_trl is not None:
            use_in_trl(False)
    assert utils._ChunkedLogProbFunction is trl_head, "use_in_trl(False) did not restore TRL's head"

    logs = [{k: v for k, v in record.items() if not k.endswith(CLOCK_SUFFIXES)} for record in trainer.state.log_history]
    params = {name: p.detach().cpu().clone() for name, p in trainer.model.named_parameters()}
    return TrlRun(logs, params, seen, head.head, head.outputs)


def abs_floor(key: str) -> float:
    """The scale of a logged value's terms, for values that are differences of larger terms (near 0
    while their terms are not, so their rounding error is relative to the terms): DPO's and KTO's
    rewards are beta (0.1) times sums of a few log-probs of a few units (scale 1); the KL is a
    log-ratio of such sums (KTO) or of per-token log-probs (GRPO, RLOO), scale 10; the mean logits
    average O(1) logits; the GRPO and RLOO losses sum O(1) advantages times ratios near 1."""
    name = key.removeprefix("eval_")
    if name.startswith(("rewards/", "logits/")) or name.endswith("loss"):
        return 1.0
    return 10.0 if name == "kl" else 0.0


# Logged fractions of tokens, pairs or ratios: a near-tie that rounds the other way moves them by a step.
FRACTIONS = ("mean_token_accuracy", "rewards/accuracies", "clip_ratio/")


def assert_runs_match(reference: TrlRun, run: TrlRun, rel: float, fraction_tol: float = 0.0) -> None:
    """``run`` logged the same keys at the same steps as ``reference``, each value within ``rel`` of
    the reference's (of ``abs_floor(key)`` for values that are differences of larger terms, within
    ``fraction_tol`` for FRACTIONS), sampled the same completions, and ended with the same
    parameters within ``rel`` of each tensor's largest entry. The first step that differs is named."""
    same_completions = run.completions == reference.completions
    assert [r.keys() for r in run.logs] == [r.keys() for r in reference.logs], "other logged keys"
    for ref, got in zip(reference.logs, run.logs, strict=True):
        for key, expected in ref.items():
            name = key.removeprefix("eval_")
            if fraction_tol and name.startswith(FRACTIONS):
                tol = fraction_tol
            else:
                tol = rel * max(abs(expected), abs_floor(key))
            assert abs(got[key] - expected) <= tol, (
                f"step {ref.get('step')}: {key} = {got[key]!r}, TRL's head gives {expected!r} (tolerance {tol:.3g})"
                + ("" if same_completions else "; the runs sampled different completions"))
    assert same_completions, "the two runs sampled different completions"
    for name, expected in reference.params.items():
        got = run.params[name]
        scale = expected.abs().max().item()
        err = (got.double() - expected.double()).abs().max().item()
        assert err <= rel * scale, f"parameter {name}: max error {err:.3g} > {rel:g} x {scale:.3g}"
