"""benchmarks/bench.py's laps: later laps time every method again, in reversed order every other
lap, and a method's times become the medians of its laps (the helper alone, on the CPU)."""

import argparse
import importlib.util
import sys

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_later_laps_alternate_the_order_and_take_the_medians(bench, monkeypatch):
    calls = []
    times = {"a": iter([(2.0, 20.0), (4.0, 40.0)]), "b": iter([(1.0, 10.0), (1.0, 30.0)])}

    def retime(fn, hidden, weight, targets, rep_ms, warmup_ms):
        calls.append(fn)
        return next(times[fn])

    monkeypatch.setattr(bench, "retime", retime)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    entries = {"a": {"row": "r", "inputs": "lm", "method": "a", "fwd_ms": 3.0, "step_ms": 30.0},
               "b": {"row": "r", "inputs": "lm", "method": "b", "fwd_ms": 1.5, "step_ms": 20.0},
               "c": {"row": "r", "inputs": "lm", "method": "c", "error": "ValueError: no"}}
    methods = [("a", "a"), ("b", "b"), ("c", "c")]
    bench.later_laps(methods, entries, (None, None, None), argparse.Namespace(laps=3, rep_ms=1, warmup_ms=1), 1e12)
    assert calls == ["b", "a", "a", "b"]  # lap 2 reversed, lap 3 in order; the failed method not retimed
    assert entries["a"]["step_ms_laps"] == [30.0, 20.0, 40.0] and entries["a"]["step_ms"] == 30.0
    assert entries["a"]["fwd_ms"] == 3.0 and entries["b"]["fwd_ms"] == 1.0 and entries["b"]["step_ms"] == 20.0
    assert entries["b"]["step_tflops_6nvh"] == pytest.approx(3e12 / 20.0 / 1e9)
    assert "step_ms_laps" not in entries["c"]


def test_the_glue_alone_keeps_the_heads_contract(bench):
    """``trl-glue``: TRL's head around a kernel that does no work still gathers, scatters and runs
    its backward to hidden and weight: its loss is 0, and the gradients are zero, of their shapes,
    on the rows with a label and the others alike (the CPU, without TRL)."""
    import torch

    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    targets = torch.tensor([1, -100, 4, 0, -100, 2])
    loss = bench.trl_head(bench.no_head, "sft")(hidden, weight, targets)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros(6, 4)) and torch.equal(weight.grad, torch.zeros(5, 4))


def test_grpo_heads_with_and_without_the_entropy_bonus(bench):
    """``*-grpo`` and ``*-grpo-coef0``: GRPO's advantage-weighted log-probs at temperature 0.7 over
    the rows with a label, minus the entropy bonus (coefficient 0.01) in the first only, checked in
    float64 against log_softmax with a plain PyTorch kernel in the head (the CPU, without TRL)."""
    import torch

    def plain_head(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        log_p = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        return log_p.gather(1, labels[:, None])[:, 0], entropy, None, None, None

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=g, dtype=torch.float64)
    targets = torch.tensor([1, -100, 4, 0, -100, 2])
    mask = targets != -100
    log_p = torch.log_softmax(hidden[mask] @ weight.T / bench.GRPO_TEMPERATURE, dim=-1)
    advantages = bench._advantages(6, hidden.device)[mask].double()
    policy = -(log_p.gather(1, targets[mask][:, None])[:, 0] * advantages).sum() / 4
    entropy = -(log_p.exp() * log_p).sum()
    assert bench.trl_head(plain_head, "grpo-coef0")(hidden, weight, targets).item() == pytest.approx(policy.item())
    assert bench.trl_head(plain_head, "grpo")(hidden, weight, targets).item() == pytest.approx(
        (policy - bench.GRPO_ENTROPY_COEF * entropy / 4).item())


def test_per_row_loss_weights_each_sequence(bench):
    """``flce-per-row``: the loss per row weighted by its sequence's advantage over the rows with a
    target, checked in float64 against cross_entropy with a plain loss in place of the kernel's
    (the CPU)."""
    import torch

    class Plain:  # the kernel's call, by PyTorch
        @staticmethod
        def fused_linear_cross_entropy(hidden, weight, targets, reduction):
            return torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction=reduction)

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=g, dtype=torch.float64)
    targets = torch.tensor([1, -100, 4, 0, -100, 2])
    advantages = bench._advantages(6, hidden.device).double()
    per_row = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="none")
    assert bench.per_row_loss(Plain)(hidden, weight, targets).item() == pytest.approx(
        (per_row * advantages).sum().item() / 4)
