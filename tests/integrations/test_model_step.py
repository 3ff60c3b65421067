"""benchmarks/model_step.py, on a tiny model and the CPU: the patched model's fused loss is the
model's own loss on the same batch (fp32: within fp32 rounding of a mean over 30 tokens), in a
training step and in an evaluation forward."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytest.importorskip("transformers")


def test_model_step_runs_both_paths_on_the_same_loss(tmp_path):
    out = tmp_path / "model-step.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model_step.py"), "--tiny", "--batch", "2",
                          "--seq", "16", "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    results = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"transformers", "fused-linear-ce"}
    theirs, ours = results["transformers"]["loss"], results["fused-linear-ce"]["loss"]
    assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    # the evaluation forward (no gradients, eval mode): the same loss by either path, and the step's
    for r in results.values():
        assert abs(r["eval_loss"] - theirs) <= 1e-5 * abs(theirs)
    assert all(r["step_ms"] > 0 and r["eval_ms"] > 0 for r in results.values())
