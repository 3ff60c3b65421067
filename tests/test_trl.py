"""The kernel's TRL trainer (``flce.trl.FusedSFTTrainer``, the lazily imported ``trl`` module)
trains and logs as TRL 1.16's own SFTTrainer: same loss, mean_token_accuracy, entropy and
num_tokens at every logged step, in training and evaluation, and the same weights after a few
steps (tiny model, CPU, float32). The package imports neither TRL nor transformers until then."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from _tiny import ROOT

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("trl_sft_fused", ROOT / "examples" / "trl_sft_fused.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(example, trainer_cls, output_dir, checkpointing=False, **kwargs):
    model, tokenizer, dataset = example.tiny_setup(num_examples=16)
    _, _, eval_dataset = example.tiny_setup(num_examples=6, seed=1)
    args = trl.SFTConfig(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        per_device_eval_batch_size=3, optim="sgd", learning_rate=0.5, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, completion_only_loss=True, seed=0,
        activation_checkpointing=checkpointing, disable_tqdm=True,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                          processing_class=tokenizer, **kwargs)
    trainer.train()
    trainer.evaluate()
    return trainer


def test_package_import_leaves_trl_and_transformers_alone():
    """``import fused_linear_ce`` imports no training library; ``fused_linear_ce.trl`` is imported
    on first use, as a submodule or as the attribute."""
    code = ("import sys; import fused_linear_ce as flce; "
            "assert not {'trl', 'transformers', 'accelerate'} & set(sys.modules), sorted(sys.modules); "
            "assert 'trl' not in flce.__all__; "
            "trainer = flce.trl.FusedSFTTrainer; import fused_linear_ce.trl as module; "
            "assert module.FusedSFTTrainer is trainer and 'trl' in sys.modules")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "torch-ext")})
    assert run.returncode == 0, run.stderr


def test_hub_kernel_has_the_trl_module(flce):
    """Loaded by ``kernels`` (a flat folder, a package named by the metadata id), the submodule
    imports too, with the kernel's own functions."""
    module = flce.trl
    assert module.__name__ == f"{flce.__name__}.trl"
    assert issubclass(module.FusedSFTTrainer, trl.SFTTrainer)
    assert module.patch_forward is flce.patch_forward


def test_fused_trainer_logs_as_sft_trainer(flce, example, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch CPU path: the interpreter adds nothing here
    reference = _train(example, trl.SFTTrainer, tmp_path / "reference")
    # with SFTConfig's default activation checkpointing, which changes nothing but memory
    fused = _train(example, flce.trl.FusedSFTTrainer, tmp_path / "fused", checkpointing=True)

    keys = ("loss", "mean_token_accuracy", "entropy", "num_tokens", "grad_norm",
            "eval_loss", "eval_mean_token_accuracy", "eval_entropy")
    ref_logs = [{k: v for k, v in r.items() if k in keys} for r in reference.state.log_history]
    fused_logs = [{k: v for k, v in r.items() if k in keys} for r in fused.state.log_history]
    assert len(ref_logs) == 5  # 3 steps, the evaluation, the summary (without these keys)
    assert [r.keys() for r in fused_logs] == [r.keys() for r in ref_logs]
    for ref, got in zip(ref_logs, fused_logs, strict=True):
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    accuracies = [r[k] for r in ref_logs for k in ("mean_token_accuracy", "eval_mean_token_accuracy") if k in r]
    assert max(accuracies) > 0.1 and min(accuracies) < max(accuracies)  # the metric is not trivially 0

    # SGD: the weights differ by lr times the gradients' fp32 differences (Adam would amplify
    # those of near-zero gradients)
    ref_params = dict(reference.model.named_parameters())
    for name, p in fused.model.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6)


def test_example_script_trains(tmp_path):
    """examples/trl_sft_fused.py as a user runs it: the kernel's trainer on its tiny model."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CPU user's path
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_sft_fused.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    logs = [line for line in run.stdout.splitlines() if "'mean_token_accuracy'" in line and "'step'" in line]
    assert len(logs) == 5, run.stdout  # the script prints the log history: one record a step
