"""TRL 1.16's trainers train and log the same with the kernel as with TRL's own fused LM head.

Each test trains one trainer (SFT, SFT's DFT loss, DPO, KTO, GRPO, RLOO) a few SGD steps on a tiny
random Llama loaded from a local checkpoint, from the same weights, data and seed: with TRL's head,
then with ``flce.trl.use_in_trl()`` (the kernel as ``get_kernel`` loads it). Every value TRL logs
(loss, grad_norm and the head's metrics, listed in HEAD_METRICS) and every parameter after the
steps must agree; GRPO and RLOO must sample the same completions. The trainers whose upstream
gradients differ per token (all but SFT's NLL, whose gradients the sweep makes) train with the
kernel twice: with kept rows (FLCE_KEEP_MIB large enough for all) and without (every row
recomputed), each checked against TRL's run.

Tolerance, float32 on the CPU: rel 1e-5. Both heads compute in float32 from the same hidden
states and weights, and differ only in the order of their sums over the vocabulary (TRL's
chunks against the kernel's): a few float32 ulps (6e-8) on each log-prob and entropy, amplified
through the backward of two layers and 2-3 SGD steps; a float64 stand-in for either head moves
every logged value and parameter by at most 3e-6 of its scale. Values that are differences of
larger terms (rewards, KL, mean logits, near-zero losses) are held to the scale of their terms
(``abs_floor`` in _tiny.py). The trainers run the PyTorch path (TRITON_INTERPRET=0): the
interpreter would take minutes a step.
"""

import os
import subprocess
import sys

import pytest
from _tiny import ROOT, assert_runs_match, save_tiny_checkpoint, train_trl
from conftest import submodule

trl = pytest.importorskip("trl")

REL = 1e-5  # float32 rounding, see the module docstring

# What each trainer logs from the head's outputs (log-probs, entropy, mean logits, top-1): the
# comparison covers every logged key; these must be among them.
HEAD_METRICS = {
    "sft": ("loss", "grad_norm", "entropy", "mean_token_accuracy", "eval_loss", "eval_entropy",
            "eval_mean_token_accuracy"),
    "dft": ("loss", "grad_norm", "entropy", "mean_token_accuracy", "eval_loss", "eval_entropy",
            "eval_mean_token_accuracy"),
    "dpo": ("loss", "grad_norm", "entropy", "mean_token_accuracy", "logps/chosen", "logps/rejected",
            "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logits/chosen",
            "logits/rejected", "eval_loss", "eval_logps/chosen", "eval_rewards/margins", "eval_logits/chosen"),
    "kto": ("loss", "grad_norm", "kl", "entropy", "logps/chosen", "logps/rejected", "rewards/chosen",
            "rewards/rejected", "rewards/margins", "logits/chosen", "logits/rejected", "eval_loss", "eval_kl",
            "eval_logps/chosen"),
    "grpo": ("loss", "grad_norm", "policy_loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
             "clip_ratio/region_mean"),
    "rloo": ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean"),
}
# The head's outputs each trainer asks for (its policy, then its reference model's log-probs)
HEAD_OUTPUTS = {
    "sft": {("log_probs", "entropy", "is_top1")},
    "dft": {("log_probs", "entropy", "is_top1")},
    "dpo": {("log_probs", "entropy", "mean_logits", "is_top1"), ("log_probs",)},
    "kto": {("log_probs", "entropy", "mean_logits"), ("log_probs",)},
    "grpo": {("log_probs", "entropy"), ("log_probs",)},
    "rloo": {("log_probs", "entropy"), ("log_probs",)},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def test_package_import_leaves_trl_and_transformers_alone():
    """``import fused_linear_ce`` imports no training library; ``fused_linear_ce.trl`` is imported
    on first use, as a submodule or as the attribute."""
    code = ("import sys; import fused_linear_ce as flce; "
            "assert not {'trl', 'transformers', 'accelerate'} & set(sys.modules), sorted(sys.modules); "
            "assert 'trl' not in flce.__all__; "
            "use = flce.trl.use_in_trl; import fused_linear_ce.trl as module; "
            "assert module.use_in_trl is use")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "torch-ext")})
    assert run.returncode == 0, run.stderr


def test_use_in_trl_swaps_the_head_and_back(flce):
    """Loaded by ``kernels``, ``use_in_trl()`` puts the kernel's head in TRL's module global (once,
    however often called) and ``use_in_trl(False)`` TRL's own back."""
    from trl.trainer import utils

    trl_head = utils._ChunkedLogProbFunction
    try:
        flce.trl.use_in_trl()
        flce.trl.use_in_trl()
        ours = utils._ChunkedLogProbFunction
        assert ours is not trl_head and ours.__module__ == f"{flce.__name__}.trl"
    finally:
        flce.trl.use_in_trl(False)
    assert utils._ChunkedLogProbFunction is trl_head
    flce.trl.use_in_trl(False)
    assert utils._ChunkedLogProbFunction is trl_head


def _train_with_kernel(flce, kind, checkpoint, output_dir, steps, keep_mib, monkeypatch):
    """``train_trl`` with the kernel's head at the kept-rows budget ``keep_mib``; (run, rows that
    the backwards made from kept buffers)."""
    backend = submodule(flce, "_torch_backend")
    kept_rows, grad_from_kept = [], backend.grad_from_kept
    monkeypatch.setattr(backend, "grad_from_kept", lambda buffer, *a: kept_rows.append(buffer.shape[0])
                        or grad_from_kept(buffer, *a))
    with submodule(flce, "_settings").override(keep_mib=keep_mib):
        run = train_trl(kind, checkpoint, output_dir, use_in_trl=flce.trl.use_in_trl, steps=steps)
    monkeypatch.setattr(backend, "grad_from_kept", grad_from_kept)
    return run, sum(kept_rows)


@pytest.mark.parametrize("kind", ["sft", "dft", "dpo", "kto", "grpo", "rloo"])
def test_trainer_trains_as_with_trls_head(flce, checkpoint, kind, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch path for CPU tensors
    # GRPO and RLOO sample their completions every num_iterations (2) steps: two steps score one
    # round of completions, sampled from the same weights in both runs (a later round would sample
    # from weights that differ by the heads' fp32 rounding, and a near-tie can draw another token)
    steps = 2 if kind in ("grpo", "rloo") else 3
    reference = train_trl(kind, checkpoint, tmp_path / "trl", steps=steps)
    logged = set().union(*(record.keys() for record in reference.logs))
    assert set(reference.head_calls) == HEAD_OUTPUTS[kind]
    assert set(HEAD_METRICS[kind]) <= logged, sorted(set(HEAD_METRICS[kind]) - logged)
    # SFT's equal weights take the sweep's gradients (no row kept); the others keep rows once their
    # first backward found unequal weights (64 MiB hold every row here), or none with the budget off
    budgets = (None,) if kind == "sft" else (64, 0)
    for keep_mib in budgets:
        fused, kept_rows = _train_with_kernel(flce, kind, checkpoint, tmp_path / f"flce-{keep_mib}", steps, keep_mib,
                                              monkeypatch)
        # the kernel scored every token of the second run, TRL's of the first, with the same requests
        assert fused.head.__module__ == f"{flce.__name__}.trl" and reference.head.__module__.startswith("trl.")
        assert fused.head_calls == reference.head_calls
        assert (kept_rows > 0) == bool(keep_mib), kept_rows
        assert_runs_match(reference, fused, REL)

    # metrics that say something: the trainers learn and the accuracy is not trivially 0
    values = {key: [r[key] for r in reference.logs if key in r] for key in HEAD_METRICS[kind]}
    assert len(set(values["loss"])) > 1 and len(set(values["grad_norm"])) > 1
    if kind == "sft":
        assert max(values["mean_token_accuracy"] + values["eval_mean_token_accuracy"]) > 0.1
    if kind in ("grpo", "rloo"):
        assert len(set(reference.completions)) > 1 and max(values["kl"]) > 0
        assert max(values["clip_ratio/region_mean"]) > 0 or kind == "rloo"  # GRPO's second iteration clips


def test_example_script_trains(tmp_path):
    """examples/trl_sft_fused.py as a user runs it: SFTTrainer with the kernel's head, tiny model."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU user's path
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_sft_fused.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    logs = [line for line in run.stdout.splitlines() if "'mean_token_accuracy'" in line and "'step'" in line]
    assert len(logs) == 5, run.stdout  # the script prints the log history: one record a step
