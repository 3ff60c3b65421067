"""The Hub's benchmark of this kernel: ``kernels benchmark qgallouedec/fused-linear-ce@v1`` (or a checkout's
path) times these workloads, and each one's ``verify_*`` (PyTorch eager on the materialised logits) as its
reference, so that the Hub's view shows the speedup over eager and that the results agree.

- ``LossStep``: a training step (forward and backward, gradients of hidden and weight) of the mean loss on
  the main table's heads, N = 8192 tokens, 10% of the targets ignored.
- ``TokenOutputs``: the per-token outputs that TRL's trainers ask for, with a backward: SFT's (log-probs,
  entropy; the mean negative log-prob) and GRPO's (temperature 0.7, per-token advantages and an entropy
  bonus: an upstream known only in the backward).

On a GPU the tensors are bf16 at the heads' shapes; on a CPU, fp32 at a small shape (a quick check
of the script, not a measurement). benchmarks/bench.py is the full benchmark: peers, memory, laps.
"""

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark

# (hidden size, vocabulary size) of the main table's heads
HEADS = {"llama3": (4096, 128256), "gemma2": (2304, 256000), "qwen25": (3584, 152064), "llama2": (4096, 32000)}
N_TOKENS = 8192
SMALL = (64, 32, 256)  # (tokens, hidden, vocabulary) on a CPU
IGNORED = 0.1
GRPO_TEMPERATURE, ENTROPY_COEF = 0.7, 0.01


def _inputs(device: str, hidden_size: int, vocab_size: int, n_tokens: int):
    """hidden [N, H], weight [V, H] (leaves) and targets [N], a tenth of them -100. The weight's
    scale spreads the logits over a few units, as a trained head's are."""
    on_gpu = device != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if not on_gpu:
        n_tokens, hidden_size, vocab_size = SMALL
    hidden = torch.randn(n_tokens, hidden_size, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, device=device) * 2 / hidden_size**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab_size, (n_tokens,), device=device)
    targets[torch.rand(n_tokens, device=device) < IGNORED] = -100
    return hidden, weight, targets


class LossStep(Benchmark):
    """The mean loss's training step: ``fused_linear_cross_entropy`` against ``F.cross_entropy`` of the logits."""

    seed = 0

    def _setup(self, head: str) -> None:
        self.hidden, self.weight, self.targets = _inputs(self.device, *HEADS[head], N_TOKENS)

    def _step(self) -> None:
        self.hidden.grad = self.weight.grad = None
        loss = self.kernel.fused_linear_cross_entropy(self.hidden, self.weight, self.targets)
        loss.backward()
        self.out = loss.detach().float()

    def _eager(self) -> torch.Tensor:
        self.hidden.grad = self.weight.grad = None
        loss = F.cross_entropy((self.hidden @ self.weight.T).float(), self.targets)
        loss.backward()
        return loss.detach()

    def setup_llama3(self):
        self._setup("llama3")

    def benchmark_llama3(self):
        self._step()

    def verify_llama3(self):
        return self._eager()

    def setup_gemma2(self):
        self._setup("gemma2")

    def benchmark_gemma2(self):
        self._step()

    def verify_gemma2(self):
        return self._eager()

    def setup_qwen25(self):
        self._setup("qwen25")

    def benchmark_qwen25(self):
        self._step()

    def verify_qwen25(self):
        return self._eager()

    def setup_llama2(self):
        self._setup("llama2")

    def benchmark_llama2(self):
        self._step()

    def verify_llama2(self):
        return self._eager()


class TokenOutputs(Benchmark):
    """Per-token log-probs and entropy with a backward, on the Llama-3 head, as TRL's trainers call them
    (the rows with a target only): ``fused_linear_log_probs`` against ``log_softmax`` of the logits.
    ``out`` is the mean log-prob and mean entropy [2]: eager's 16-bit logits are off by up to |z| 2^-8
    each, more than the runner's tolerance (1e-2) on single tokens, but not on their means."""

    seed = 0

    def setup(self) -> None:
        hidden, weight, targets = _inputs(self.device, *HEADS["llama3"], N_TOKENS)
        kept = targets != -100
        self.hidden = hidden.detach()[kept].requires_grad_()
        self.weight, self.targets = weight, targets[kept]
        self.advantages = torch.randn(self.targets.shape[0], device=self.device)

    def _loss(self, log_probs, entropy, grpo: bool) -> torch.Tensor:
        if grpo:
            return -(self.advantages * log_probs).mean() - ENTROPY_COEF * entropy.mean()
        return -log_probs.mean()

    def _step(self, temperature: float, grpo: bool) -> None:
        self.hidden.grad = self.weight.grad = None
        out = self.kernel.fused_linear_log_probs(self.hidden, self.weight, self.targets, temperature=temperature,
                                                 outputs=("log_probs", "entropy"))
        self._loss(out.log_probs, out.entropy, grpo).backward()
        self.out = torch.stack([out.log_probs.detach().mean(), out.entropy.detach().mean()]).float()

    def _eager(self, temperature: float, grpo: bool) -> torch.Tensor:
        self.hidden.grad = self.weight.grad = None
        log_softmax = ((self.hidden @ self.weight.T).float() / temperature).log_softmax(-1)
        log_probs = log_softmax.gather(-1, self.targets[:, None])[:, 0]
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        self._loss(log_probs, entropy, grpo).backward()
        return torch.stack([log_probs.detach().mean(), entropy.detach().mean()])

    def benchmark_sft(self):
        self._step(1.0, grpo=False)

    def verify_sft(self):
        return self._eager(1.0, grpo=False)

    def benchmark_grpo(self):
        self._step(GRPO_TEMPERATURE, grpo=True)

    def verify_grpo(self):
        return self._eager(GRPO_TEMPERATURE, grpo=True)
