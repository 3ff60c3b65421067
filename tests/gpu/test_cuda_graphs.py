"""CUDA-graph capture of a training step (forward + backward) through the fused loss: after a
warm-up (autotuning included), capture once, then replay with new values copied into the static
inputs; each replay equals an eager step on the same values (loss, metrics, gradients)."""

import pytest
import torch
from conftest import HAS_CUDA
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device"),
]


def _capture(step, zero_grads):
    """Warm up ``step`` on a side stream, then capture it; returns the graph and its outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            zero_grads()
            step()
    torch.cuda.current_stream().wait_stream(side)
    zero_grads()  # the captured backward allocates the gradients in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def _targets(n_rows, vocab, generator):
    targets = torch.randint(0, vocab, (n_rows,), generator=generator)
    targets[torch.rand(n_rows, generator=generator) < 0.2] = -100
    return targets.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_loss_step(flce, dtype):
    n_rows, hidden_size, vocab = 300, 256, 1000
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_rows, hidden_size, generator=g).to("cuda", dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.05).to("cuda", dtype).requires_grad_()
    bias = torch.randn(vocab, generator=g).to("cuda", dtype).requires_grad_()
    targets = _targets(n_rows, vocab, g)
    leaves = (hidden, weight, bias)

    def loss_and_metrics(h, w, b):
        loss, metrics = flce.fused_linear_cross_entropy(h, w, targets, b, softcap=30.0, return_metrics=True)
        return loss, metrics["num_correct_tokens"], metrics["entropy_sum"]

    def step():
        out = loss_and_metrics(*leaves)
        out[0].backward()
        return out

    def zero_grads():
        for t in leaves:
            t.grad = None

    graph, static_out = _capture(step, zero_grads)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in leaves:
                t.copy_(torch.randn(t.shape, generator=g).to("cuda", dtype) * (0.05 if t is weight else 1.0))
        targets.copy_(_targets(n_rows, vocab, g))
        graph.replay()
        torch.cuda.synchronize()

        eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        expected = loss_and_metrics(*eager_leaves)
        expected[0].backward()
        for got, want in zip(static_out, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for t, e in zip(leaves, eager_leaves, strict=True):
            torch.testing.assert_close(t.grad, e.grad)


class _TinyTiedLM(nn.Module):
    """Embedding, two blocks, final norm; the lm_head is the embedding (tied)."""

    def __init__(self, vocab=500, hidden=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.norm = nn.LayerNorm(hidden)

    def forward(self, input_ids):
        return self.norm(self.blocks(self.embed(input_ids)))


def test_graph_replays_model_step_with_causal_lm_loss(flce):
    torch.manual_seed(0)
    model = _TinyTiedLM().cuda()
    input_ids = torch.randint(0, 500, (4, 64), device="cuda")
    labels = input_ids.clone()
    labels[:, :5] = -100
    num_items = torch.tensor(200, device="cuda")

    def loss_and_metrics(m):
        loss, metrics = flce.causal_lm_loss(m(input_ids), m.embed.weight, labels, num_items_in_batch=num_items,
                                            return_metrics=True)
        return loss, *(metrics[k] for k in ("num_correct_tokens", "entropy_sum", "num_valid_tokens"))

    def step():
        out = loss_and_metrics(model)
        out[0].backward()
        return out

    graph, static_out = _capture(step, lambda: model.zero_grad(set_to_none=True))
    eager_model = _TinyTiedLM().cuda()
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        input_ids.copy_(torch.randint(0, 500, input_ids.shape, generator=g))
        labels.copy_(input_ids)
        labels[:, : 3 + seed] = -100
        graph.replay()
        torch.cuda.synchronize()

        eager_model.load_state_dict(model.state_dict())
        eager_model.zero_grad(set_to_none=True)
        expected = loss_and_metrics(eager_model)
        expected[0].backward()
        for got, want in zip(static_out, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for (name, p), e in zip(model.named_parameters(), eager_model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, e.grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replays_an_evaluation_forward(flce, dtype):
    """A forward without gradients (in bf16 on Hopper, the Gluon statistics): a capture computes
    every row (the host cannot read the count of rows with a loss then). Each replay, with new
    targets and so another count, equals an eager forward, which skips the ignored rows."""
    n_rows, hidden_size, vocab = 1000, 128, 1000
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_rows, hidden_size, generator=g).to("cuda", dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.05).to("cuda", dtype)
    targets = _targets(n_rows, vocab, g)

    def forward():
        with torch.no_grad():
            per_row = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
            return per_row, flce.fused_linear_cross_entropy(hidden, weight, targets)

    graph, static_out = _capture(forward, lambda: None)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        hidden.copy_(torch.randn(hidden.shape, generator=g).to("cuda", dtype))
        targets.copy_(_targets(n_rows, vocab, g))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(static_out, forward(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
