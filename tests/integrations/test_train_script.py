"""scripts/train_fsdp.py, the FSDP2 training run of the fused and the logits loss, end to end at a
toy size on 2 gloo CPU processes (on GPUs, scripts/gpu_distributed.py runs it at full size)."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytest.importorskip("transformers")


def _script():
    spec = importlib.util.spec_from_file_location("train_fsdp", ROOT / "scripts" / "train_fsdp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("threshold", [1, 5, 16, 1000])
def test_largest_size_search(threshold):
    """Doubling then bisection finds the largest size that holds, to the granularity, within the limit."""
    largest = _script().largest
    tried = []

    def holds(size):
        tried.append(size)
        return size <= threshold

    assert largest(holds, 1, 64, 1) == min(threshold, 64)
    assert len(tried) == len(set(tried)) <= 2 * math.ceil(math.log2(64)) + 1  # no size tried twice
    # coarse granularity: the largest multiple of it that holds
    assert largest(lambda s: s <= 10_000, 4096, 262144, 1024) == 9216
    assert largest(lambda s: s <= 100, 128, 1024, 16) == 0


def test_generated_language_uses_the_vocabulary():
    """The generated data: odd positions repeat a fixed successor of the token before, 9 times in 10;
    the tokens spread over the vocabulary (Zipf), and ranks (seeds) get different batches."""
    generated_tokens = _script().generated_tokens
    a, b = generated_tokens(1000, 8, 256, seed=0), generated_tokens(1000, 8, 256, seed=1)
    assert a.shape == (8, 256) and not a.equal(b)
    assert int(a.min()) >= 0 and int(a.max()) < 1000 and a.unique().numel() > 300
    # the successor map is the same in every call: pairs (even, odd) that follow it agree across batches
    pairs = {}
    for tokens in (a, b):
        for first, second in zip(tokens[:, 0::2].flatten().tolist(), tokens[:, 1::2].flatten().tolist(), strict=True):
            pairs.setdefault(first, []).append(second)
    agree = sum(max(seconds.count(s) for s in set(seconds)) for seconds in pairs.values())
    assert 0.85 < agree / sum(len(s) for s in pairs.values()) < 0.97


def _run(out_dir, *extra):
    # The engine is tested, not the backend; no GPU visible, so that on a one-GPU machine rank 1's
    # device mesh does not look for a second CUDA device.
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               str(ROOT / "scripts" / "train_fsdp.py"), "--tiny", "--device", "cpu", "--out", str(out_dir), *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_train_fsdp_runs_on_cpu(tmp_path):
    """Both variants train from the same initialisation on the same batches: the same global loss at
    every step (fp32: within rounding), recorded with timing, and a loss plot; --max-seq records its tries."""
    _run(tmp_path, "--steps", "3")
    record = json.loads((tmp_path / "train_fsdp.json").read_text())
    fused, logits = record["variants"]["fused"], record["variants"]["logits"]
    assert len(fused["loss"]) == len(logits["loss"]) == 3
    for a, b in zip(fused["loss"], logits["loss"], strict=True):
        assert math.isfinite(a) and abs(a - b) <= 1e-5 * abs(b)  # fp32 sums in another order
    assert logits["loss"][0] == pytest.approx(math.log(1024), rel=0.05)  # random init: about log V
    assert fused["tokens_per_s"] > 0 and record["processes"] == 2
    assert (tmp_path / "train_fsdp_loss.png").stat().st_size > 0

    _run(tmp_path, "--max-seq", "--seq-limit", "128", "--batch-limit", "2")
    sizes = json.loads((tmp_path / "train_fsdp_maxseq.json").read_text())["max_sizes"]
    assert sizes["max_seq_at_batch_1"] == {"fused": 128, "logits": 128}  # no memory limit on the CPU
    assert sizes["at_logits_max_seq"]["tokens_per_gpu"] == {"fused": 256, "logits": 256}
