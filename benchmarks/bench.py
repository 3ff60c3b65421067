"""Benchmark of the fused linear cross-entropy against its peers, on one CUDA GPU.

Methods, side by side in one process (peers are optional imports, used as black boxes through
their public functions): fused-linear-ce; PyTorch eager (bf16 logits, F.cross_entropy in fp32);
torch.compile of the same; QuACK's chunked_linear_cross_entropy (chunk_size 2048, and its
default chunk); Liger-Kernel's CuTe SM90 kernel and its Triton liger_fused_linear_cross_entropy;
cut-cross-entropy's linear_cross_entropy (default, and filter_eps=None).

For each shape, input kind and method: forward time under no_grad, training-step time
(forward + backward, grads for hidden and weight), peak extra memory of one step and of
one forward, and the relative errors of loss, grad_hidden and grad_weight against a
float64 reference on the same inputs (float32 before v6). Times are medians of triton.testing.do_bench after
``--warmup-ms`` of warm-up: these steps hold an H200 at its power limit (700 W, the SM clock
near 1.5 GHz instead of 1.98), which takes about a second of back-to-back steps to reach; a
training loop runs there, so the times are taken there. nvidia-smi's SM clock, power and
throttle reasons during each step timing are recorded with it.

    python benchmarks/bench.py --out results.json [--rows gemma2,llama3] [--methods ...]
"""

import argparse
import datetime
import gc
import importlib.util
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]

# name: (hidden_size, vocab_size, n_tokens, dtype)
ROWS = {
    "gemma2": (2304, 256000, 8192, "bfloat16"),
    "llama3": (4096, 128256, 8192, "bfloat16"),
    "qwen25": (3584, 152064, 8192, "bfloat16"),
    "llama2": (4096, 32000, 8192, "bfloat16"),
    "llama3-n2048": (4096, 128256, 2048, "bfloat16"),
    "llama3-n4096": (4096, 128256, 4096, "bfloat16"),
    "llama3-n32768": (4096, 128256, 32768, "bfloat16"),
    "llama3-n65536": (4096, 128256, 65536, "bfloat16"),
    "llama3-tp2-slice": (4096, 128256 // 2, 8192, "bfloat16"),  # one rank's part of a 2-way vocab split
    "llama3-tp4-slice": (4096, 128256 // 4, 8192, "bfloat16"),
    "llama2-fp32": (4096, 32000, 8192, "float32"),
    "llama2-fp16": (4096, 32000, 8192, "float16"),
}
IGNORE_FRACTION = 0.1  # of the targets, ignored (-100), on every row but the "-no-ignored" ones
# The main heads with every target counted (pretraining without padding): this kernel skips the
# ignored rows' products and the peers compute them, so these rows compare the same work.
# "-masked": half of the targets ignored, as an SFT batch with its prompts masked.
for _head in ("gemma2", "llama3", "qwen25", "llama2"):
    ROWS[f"{_head}-no-ignored"] = ROWS[_head]
    ROWS[f"{_head}-masked"] = ROWS[_head]


def ignore_fraction(row: str) -> float:
    """The share of ``row``'s targets that make_inputs ignores."""
    if row.endswith("-masked"):
        return 0.5
    return 0.0 if row.endswith("-no-ignored") else IGNORE_FRACTION
METHODS = ["fused-linear-ce", "fused-linear-ce-metrics", "torch", "torch.compile", "quack", "quack-default",
           "liger-cute", "liger", "cce", "cce-exact", "flce-sft", "trl-sft", "flce-grpo", "trl-grpo",
           "flce-grpo-coef0", "trl-grpo-coef0", "trl-glue", "flce-per-row"]
# TRL's trainers' LM head (trl.trainer.utils.add_fused_lm_head) as SFTTrainer and GRPOTrainer call it,
# with TRL's own kernel (trl-*) or fused-linear-ce's (flce-*, what flce.trl.use_in_trl() installs): the
# rows with a label gathered, the per-token outputs scattered back, the trainer's loss from them.
# grpo-coef0: GRPO at its default entropy_coef = 0, the entropy logged without a gradient
TRL_OUTPUTS = {"sft": ("log_probs", "entropy", "is_top1"), "grpo": ("log_probs", "entropy"),
               "grpo-coef0": ("log_probs", "entropy")}
GRPO_TEMPERATURE = 0.7
GRPO_ENTROPY_COEF = 0.01
# Methods that bench.py --base also times on an earlier build.
BASE_METHODS = ("fused-linear-ce", "fused-linear-ce-metrics", "flce-sft", "flce-grpo", "flce-grpo-coef0",
                "flce-per-row", "flce-dpo", "flce-kto", "flce-rloo", "flce-dft")
# Methods whose loss is not the mean cross-entropy: no errors against the reference.
OTHER_LOSS = ("flce-grpo", "trl-grpo", "flce-grpo-coef0", "trl-grpo-coef0", "trl-glue", "flce-per-row")


def load_flce():
    """The kernel as users load it: through ``kernels`` when installed, else the sources."""
    try:
        from kernels import get_kernel

        os.environ.setdefault("LOCAL_KERNELS", f"qgallouedec/fused-linear-ce={ROOT}")
        return get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True), "kernels"
    except ImportError:
        sys.path.insert(0, str(ROOT / "torch-ext"))
        import fused_linear_ce

        return fused_linear_ce, "torch-ext"


def load_build(root: str):
    """The Hub build (``build/torch-cuda``) of another checkout ``root``, imported by path as the
    package ``fused_linear_ce_base``, beside the one ``load_flce`` loads (its torch.library
    operators take the package's name as their namespace): a before/after run in one process."""
    import importlib.util

    package = Path(root) / "build" / "torch-cuda"
    spec = importlib.util.spec_from_file_location("fused_linear_ce_base", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---- inputs ----------------------------------------------------------------------------
def make_inputs(n_tokens, hidden_size, vocab_size, dtype, kind, seed=0, ignored_share=IGNORE_FRACTION):
    """hidden [N, H], weight [V, H], targets [N] (``ignored_share`` of them ignored, at random).

    "lm": logits = 8 - 1.2 log(1 + rank_j) + 2 g_ij (a Zipf prior over a random ranking of
    the vocabulary, plus per-row Gaussian noise), targets drawn from that softmax: about
    5 nats of entropy and 26% top-1 accuracy, as a trained LM. The prior rides on hidden
    column 0 (constant) so that logits stay exactly hidden @ weight.T.
    "uniform": logits ~ N(0, 1), targets uniform.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = dict(device="cuda")
    weight = torch.randn(vocab_size, hidden_size, generator=g, **dev)
    hidden = torch.randn(n_tokens, hidden_size, generator=g, **dev) / math.sqrt(hidden_size)
    if kind == "lm":
        rank = torch.randperm(vocab_size, generator=g, **dev).float()
        prior = 8.0 - 1.2 * torch.log1p(rank)
        scale = 4.0
        weight[:, 0] = prior / scale
        hidden[:, 0] = scale
        hidden[:, 1:] *= 2.0 * math.sqrt(hidden_size / (hidden_size - 1))
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    if kind == "lm":
        targets = torch.empty(n_tokens, dtype=torch.long, **dev)
        for start in range(0, n_tokens, 2048):  # sample from the softmax, chunk by chunk
            logits = hidden[start:start + 2048].float() @ weight.float().T
            targets[start:start + 2048] = torch.multinomial(logits.softmax(-1), 1, generator=g)[:, 0]
    else:
        targets = torch.randint(0, vocab_size, (n_tokens,), generator=g, **dev)
    ignored = torch.rand(n_tokens, generator=g, **dev) < ignored_share
    targets[ignored] = -100
    return hidden, weight, targets


# ---- methods ---------------------------------------------------------------------------
def torch_loss(hidden, weight, targets):
    logits = hidden @ weight.T
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)


def _peer(fn, **options):
    """A peer's loss function called as f(hidden, weight, targets) with those of ``options`` its
    signature accepts (a tuple result's first item is the loss)."""
    accepted = inspect.signature(fn).parameters

    def call(h, w, t):
        out = fn(h, w, t, **{k: v for k, v in options.items() if k in accepted})
        return out[0] if isinstance(out, tuple) else out

    return call


def _advantages(n_tokens: int, device, seq_len: int = 512, zero_share: float = 0.0) -> torch.Tensor:
    """GRPO's per-token weights [N]: each sequence of ``seq_len`` tokens its advantage (fixed, N(0, 1)),
    0 for a ``zero_share`` of the sequences (chosen at random: those of groups whose rewards were all
    equal)."""
    g = torch.Generator(device=device).manual_seed(1)
    n_seq = -(-n_tokens // seq_len)
    per_seq = torch.randn(n_seq, generator=g, device=device)
    per_seq[torch.randperm(n_seq, generator=g, device=device)[:round(zero_share * n_seq)]] = 0.0
    return per_seq.repeat_interleave(seq_len)[:n_tokens]


def trl_head(apply, trainer: str, zero_advantages: float = 0.0):
    """A TRL trainer's loss through its fused LM head, with ``apply`` as the head's kernel: SFT's NLL
    (and its entropy and accuracy metrics), or GRPO's advantage-weighted log-probs at temperature 0.7
    with an entropy bonus (``grpo``) or with the entropy logged only (``grpo-coef0``); a
    ``zero_advantages`` share of GRPO's sequences has advantage 0."""
    outputs = TRL_OUTPUTS[trainer]
    temperature = 1.0 if trainer == "sft" else GRPO_TEMPERATURE
    entropy_coef = GRPO_ENTROPY_COEF if trainer == "grpo" else 0.0
    advantages = {}

    def loss(h, w, t):
        mask = t != -100
        per_token = apply(h[mask], w, None, t[mask], temperature, 32768, None, 1.0, outputs)
        log_probs, entropy, *_, is_top1 = (None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)
                                           for x in per_token)
        n = mask.sum().clamp(min=1)
        if trainer == "sft":
            _ = entropy.detach().sum(), is_top1.sum()  # SFTTrainer's logged sums
            return -log_probs.sum() / n
        if t.shape[0] not in advantages:
            advantages[t.shape[0]] = _advantages(t.shape[0], t.device, zero_share=zero_advantages)
        policy_loss = -(log_probs * advantages[t.shape[0]]).sum() / n
        if entropy_coef == 0:
            _ = entropy.detach().sum()  # GRPOTrainer's logged entropy
            return policy_loss
        return policy_loss - entropy_coef * entropy.sum() / n

    return loss


def no_head(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
    """A head kernel that does no work, with ``ChunkedLogProbFunction.apply``'s arguments and outputs:
    log_probs 0 on every row, still a function of hidden and weight (one element of each), entropy 0,
    is_top1 False. As ``trl-glue``, TRL's head timed around it: its gather, scatters, loss and
    backward alone, what both kernels' steps (``trl-sft``, ``flce-sft``) pay beside their own work."""
    log_probs = hidden[:, 0].float() * 0.0 + weight[0, 0].float() * 0.0
    return log_probs, log_probs.detach(), None, None, torch.zeros_like(labels, dtype=torch.bool)


def per_row_loss(flce):
    """The loss per row (``reduction="none"``, all N rows with their ignored ones) weighted by
    GRPO's per-sequence advantages and divided by the rows with a target: a per-token upstream
    gradient, so the backward recomputes the logits of the rows that have one."""
    advantages = {}

    def loss(h, w, t):
        if t.shape[0] not in advantages:
            advantages[t.shape[0]] = _advantages(t.shape[0], t.device)
        per_row = flce.fused_linear_cross_entropy(h, w, t, reduction="none")
        return (per_row * advantages[t.shape[0]]).sum() / (t != -100).sum().clamp(min=1)

    return loss


# ---- TRL's per-token trainers' heads, with kept rows on and off ---------------------------
# DPO, KTO, RLOO, SFT's DFT and GRPO (with and without its entropy bonus): per-token upstream
# gradients, so that both kernels' backwards recompute the logits (8 N V H) but for the rows that
# fused-linear-ce keeps (``_kept``: 6 N V H). Each with TRL's kernel (trl-KIND), ours at the default
# budget (flce-KIND) and ours with FLCE_KEEP_MIB=0 (flce-KIND-keep0: every row recomputed, as before).
# Sequences of 512 tokens; DPO pairs them (chosen, rejected) and KTO labels them (desirable or not),
# so that their upstream gradient is constant within a sequence.
TOKEN_TRAINERS = {
    "dpo": dict(outputs=("log_probs", "entropy", "mean_logits", "is_top1"), temperature=1.0),
    "kto": dict(outputs=("log_probs", "entropy", "mean_logits"), temperature=1.0),
    "rloo": dict(outputs=("log_probs", "entropy"), temperature=GRPO_TEMPERATURE),
    "dft": dict(outputs=("log_probs", "entropy", "is_top1"), temperature=1.0),
}
PREFERENCE_BETA = 0.1
RLOO_BETA = 0.04  # the KL to a reference model's log-probs (its k3 estimator), per token
KEPT_METHODS = [f"{head}-{kind}{budget}" for kind in TOKEN_TRAINERS for head, budget in
                (("trl", ""), ("flce", ""), ("flce", "-keep0"))] + ["flce-grpo-keep0", "flce-grpo-coef0-keep0"]
METHODS += KEPT_METHODS
BASE_METHODS = (*BASE_METHODS, *(m for m in KEPT_METHODS if m.endswith("-keep0")))
OTHER_LOSS = (*OTHER_LOSS, *KEPT_METHODS)


def _per_sequence(values: torch.Tensor, seq_len: int = 512) -> torch.Tensor:
    """Sums [N / seq_len] of consecutive ``seq_len`` rows of ``values`` [N] (zero-padded at the end)."""
    pad = -values.shape[0] % seq_len
    return torch.cat([values, values.new_zeros(pad)]).view(-1, seq_len).sum(-1)


def token_trainer_loss(apply, kind: str):
    """A TRL trainer's loss through its fused LM head (as ``trl_head``) for ``kind`` of
    TOKEN_TRAINERS: DPO's -log sigmoid(beta (margin - reference margin)) over (chosen, rejected)
    sequence pairs; KTO's 1 - sigmoid(beta (+-(log ratio - KL))) per labelled sequence, the KL
    detached; RLOO's advantage-weighted log-probs with the KL to a reference's log-probs; SFT's DFT
    loss, -log p weighted by the detached p."""
    outputs, temperature = TOKEN_TRAINERS[kind]["outputs"], TOKEN_TRAINERS[kind]["temperature"]
    fixed = {}

    def constants(n_rows, device):  # the reference model's offsets and the advantages, fixed per shape
        if n_rows not in fixed:
            g = torch.Generator(device=device).manual_seed(2)
            n_seq = -(-n_rows // 512)
            fixed[n_rows] = dict(seq_offset=torch.randn(n_seq, generator=g, device=device),
                                 token_offset=0.1 * torch.randn(n_rows, generator=g, device=device),
                                 advantages=_advantages(n_rows, device))
        return fixed[n_rows]

    def loss(h, w, t):
        mask = t != -100
        per_token = apply(h[mask], w, None, t[mask], temperature, 32768, None, 1.0, outputs)
        log_probs, entropy, _, mean_logits, is_top1 = (
            None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in per_token)
        _ = entropy.detach().sum(), None if mean_logits is None else mean_logits.sum()  # the trainers' metrics
        c, n = constants(t.shape[0], t.device), mask.sum().clamp(min=1)
        if kind == "dft":
            return -(log_probs * log_probs.detach().exp()).sum() / n
        # the reference model's log-probs: the policy's, detached, moved by fixed offsets (a policy
        # near its reference, so that the sigmoids and the KL do not saturate)
        if kind == "rloo":
            log_ratio = log_probs.detach() + c["token_offset"] - log_probs
            kl = torch.where(mask, log_ratio.exp() - log_ratio - 1, 0.0)
            return (-(log_probs * c["advantages"]) + RLOO_BETA * kl).sum() / n
        sums = _per_sequence(log_probs)
        margins = sums - (sums.detach() + c["seq_offset"])
        if kind == "dpo":
            chosen, rejected = margins[0::2], margins[1::2]
            return -F.logsigmoid(PREFERENCE_BETA * (chosen - rejected[:chosen.shape[0]])).mean()
        desirable = torch.arange(margins.shape[0], device=t.device) % 2 == 0
        kl = margins.detach().mean().clamp(min=0)
        sign = torch.where(desirable, 1.0, -1.0)
        return (1 - torch.sigmoid(PREFERENCE_BETA * sign * (margins - kl))).mean()

    return loss


def without_kept_rows(flce, loss):
    """``loss`` with FLCE_KEEP_MIB=0 (every row of the per-token backward recomputed); ``loss``
    itself for a build before kept rows (``--base``), which recomputes every row: the pair then
    says whether the budget's off switch gives the time and memory of before."""
    settings = sys.modules[flce.__name__ + "._settings"]
    if "keep_mib" not in settings._FIELDS:
        return loss

    def call(h, w, t):
        with settings.override(keep_mib=0):
            return loss(h, w, t)

    return call


def kept_method(name: str, flce, zero_advantages: float = 0.0):
    """The KEPT_METHODS: ``token_trainer_loss`` (or ``trl_head`` for GRPO) with TRL's kernel or ours."""
    head, rest = name.split("-", 1)
    kind = rest.removesuffix("-keep0")
    if head == "trl":
        from trl.kernels import ChunkedLogProbFunction

        apply = ChunkedLogProbFunction.apply
    else:
        apply = flce.trl.FusedLogProbs.apply
    loss = trl_head(apply, kind, zero_advantages) if kind.startswith("grpo") else token_trainer_loss(apply, kind)
    return without_kept_rows(flce, loss) if rest.endswith("-keep0") else loss


def make_method(name, flce, zero_advantages: float = 0.0):
    if name in KEPT_METHODS:
        return kept_method(name, flce, zero_advantages)
    if name in ("trl-sft", "trl-grpo", "trl-grpo-coef0"):
        from trl.kernels import ChunkedLogProbFunction

        return trl_head(ChunkedLogProbFunction.apply, name.split("-", 1)[1], zero_advantages)
    if name == "trl-glue":
        return trl_head(no_head, "sft")
    if name in ("flce-sft", "flce-grpo", "flce-grpo-coef0"):
        return trl_head(flce.trl.FusedLogProbs.apply, name.split("-", 1)[1], zero_advantages)
    if name == "flce-per-row":  # the loss per row (reduction="none") weighted per sequence: the recomputing backward
        return per_row_loss(flce)
    if name == "fused-linear-ce-metrics":
        return lambda h, w, t: flce.fused_linear_cross_entropy(h, w, t, return_metrics=True)[0]
    if name in ("quack", "quack-default"):
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        chunk = {"chunk_size": 2048} if name == "quack" else {}
        return _peer(chunked_linear_cross_entropy, ignore_index=-100, reduction="mean", **chunk)
    if name == "liger-cute":
        from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import (
            liger_fused_linear_cross_entropy_sm90,
        )

        return _peer(liger_fused_linear_cross_entropy_sm90, ignore_index=-100, reduction="mean")
    if name == "fused-linear-ce":
        return lambda h, w, t: flce.fused_linear_cross_entropy(h, w, t)
    if name == "torch":
        return torch_loss
    if name == "torch.compile":
        return torch.compile(torch_loss, dynamic=False)
    if name == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t)
    if name in ("cce", "cce-exact"):
        from cut_cross_entropy import linear_cross_entropy

        if name == "cce":
            return lambda h, w, t: linear_cross_entropy(h, w, t)
        return lambda h, w, t: linear_cross_entropy(h, w, t, filter_eps=None)
    raise ValueError(name)


def reference(hidden, weight, targets, dtype=torch.float64, rows=2048, softcap=None):
    """Loss and gradients in ``dtype`` (float64: far below every method's error, so that the
    errors compared are the methods' own, also at fp32-rounding level), chunked over rows; with
    ``softcap`` c the logits are c tanh(z / c)."""
    w = weight.to(dtype).requires_grad_()
    n_valid = (targets != -100).sum()
    loss = torch.zeros((), device=hidden.device, dtype=dtype)
    grad_h = torch.empty(hidden.shape, device=hidden.device, dtype=dtype)
    for start in range(0, hidden.shape[0], rows):
        h = hidden[start:start + rows].to(dtype).requires_grad_()
        logits = h @ w.T
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        part = F.cross_entropy(logits, targets[start:start + rows], ignore_index=-100, reduction="sum") / n_valid
        part.backward()
        grad_h[start:start + rows] = h.grad
        loss += part.detach()
    return loss, grad_h, w.grad


def rel_err(x, ref):
    return ((x.to(ref.dtype) - ref).norm() / ref.norm()).item()


def _pci_bus_id() -> str | None:
    """The current CUDA device's PCI bus id as NVML and nvidia-smi write it, where
    CUDA_VISIBLE_DEVICES renumbers the GPUs for CUDA (NVML numbers them all); else None, and
    CUDA's index is NVML's."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if "CUDA_VISIBLE_DEVICES" not in os.environ or not hasattr(props, "pci_bus_id"):
        return None
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


class GpuSampler:
    """nvidia-smi's SM clock (MHz), power (W) and throttle reasons, sampled every ``period_ms``
    while the ``with`` block runs: ``summary()`` gives their medians, minimum clock and reasons."""

    def __init__(self, period_ms: int = 100):
        self.query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                      "--format=csv,noheader,nounits", "-lms", str(period_ms),
                      "-i", _pci_bus_id() or str(torch.cuda.current_device())]
        self.samples = []

    def __enter__(self):
        try:
            self.process = subprocess.Popen(self.query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.process = None
        return self

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.terminate()
            for line in self.process.communicate()[0].splitlines():
                parts = [x.strip() for x in line.split(",")]
                if len(parts) == 3:
                    try:
                        self.samples.append((float(parts[0]), float(parts[1]), parts[2]))
                    except ValueError:
                        pass

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks = sorted(s[0] for s in self.samples)
        power = sorted(s[1] for s in self.samples)
        return {"sm_clock_mhz": clocks[len(clocks) // 2], "sm_clock_mhz_min": clocks[0],
                "power_w": power[len(power) // 2], "throttle_reasons": sorted({s[2] for s in self.samples})}


def energy_counter():
    """A function giving the GPU's energy used since the driver loaded, in joules (NVML's counter,
    through nvidia-ml-py), or None where NVML or the counter is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        bus_id = _pci_bus_id()
        handle = (pynvml.nvmlDeviceGetHandleByPciBusId(bus_id) if bus_id
                  else pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception:
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


def joules_per_step(step, step_ms: float, seconds: float = 0.5) -> float | None:
    """The GPU's energy a step over about ``seconds`` of back-to-back steps (the power limit holds a
    step's time at its energy over the limit, so this is what a faster step must spend less of)."""
    read = energy_counter()
    if read is None:
        return None
    steps = max(3, int(seconds * 1e3 / max(step_ms, 1e-3)))
    torch.cuda.synchronize()
    start = read()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (read() - start) / steps


def _calls(fn, hidden, weight, targets):
    """(step, fwd, h, w): a method's training step (forward and backward) and evaluation forward
    on leaf copies h, w of the inputs."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()

    def step():
        h.grad = w.grad = None
        fn(h, w, targets).backward()

    def fwd():
        with torch.no_grad():
            fn(h, w, targets)

    return step, fwd, h, w


def retime(fn, hidden, weight, targets, rep_ms, warmup_ms) -> tuple[float, float]:
    """(fwd ms, step ms) of a method that ``measure`` has run (compiled, tuned): the same
    do_bench medians after the same warm-up, for a later lap."""
    step, fwd, h, w = _calls(fn, hidden, weight, targets)
    fwd_ms = do_bench(fwd, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    step_ms = do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    h.grad = w.grad = None
    return fwd_ms, step_ms


def measure(fn, hidden, weight, targets, ref, rep_ms, warmup_ms=1000):
    """fwd ms, step ms (and the GPU's clock and power meanwhile), peak MiB of a step and of a
    forward, and errors for one method."""
    step, fwd, h, w = _calls(fn, hidden, weight, targets)
    step()  # compile, autotune
    fwd()
    torch.cuda.synchronize()
    out = {}
    out["fwd_ms"] = do_bench(fwd, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    with GpuSampler() as sampler:
        out["step_ms"] = do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    out["step_gpu"] = sampler.summary()
    out["step_joules"] = joules_per_step(step, out["step_ms"])
    # peak extra memory of one step / forward, above what is allocated before it
    for name, f in (("step_peak_mib", step), ("fwd_peak_mib", fwd)):
        h.grad = w.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        f()
        torch.cuda.synchronize()
        out[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    grads_mib = (h.numel() + w.numel()) * h.element_size() / 2**20
    out["step_peak_minus_grads_mib"] = out["step_peak_mib"] - grads_mib
    if ref is not None:
        h.grad = w.grad = None
        loss = fn(h, w, targets)
        loss.backward()
        out["loss_err"] = abs(loss.item() - ref[0].item()) / abs(ref[0].item())
        out["grad_hidden_err"] = rel_err(h.grad, ref[1])
        out["grad_weight_err"] = rel_err(w.grad, ref[2])
        out["loss"] = loss.item()
    h.grad = w.grad = None
    return out


# ---- distillation: the student/teacher divergence (TRL's DistillationTrainer) --------------
# name: (student hidden, teacher hidden, vocab_size, n_tokens, beta), bf16. The student is the
# Llama-3-8B head; beta 1 is TRL's default (reverse KL), 0.5 its JSD. Run with --rows NAME,...
DISTILL_ROWS = {
    f"distill-t{teacher}-b{beta:g}": (4096, teacher, 128256, 8192, beta)
    for teacher in (4096, 8192) for beta in (1.0, 0.5)
}
DISTILL_METHODS = ["flce-distill", "trl-distill", "liger-jsd", "torch.compile-jsd"]


def plain_jsd(student_logits, teacher_logits, beta: float):
    """TRL's generalised JSD per row from materialised logits (in fp32): KL(q || p) at beta 0,
    KL(p || q) at 1, else beta KL(q || m) + (1 - beta) KL(p || m), m = (1 - beta) p + beta q."""
    lp, lq = student_logits.float().log_softmax(-1), teacher_logits.float().log_softmax(-1)
    if beta == 0:
        return F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    lm = torch.logsumexp(torch.stack([lp + math.log1p(-beta), lq + math.log(beta)]), dim=0)
    return (beta * F.kl_div(lm, lq, reduction="none", log_target=True).sum(-1)
            + (1 - beta) * F.kl_div(lm, lp, reduction="none", log_target=True).sum(-1))


def make_distill_method(name: str, flce, beta: float):
    """fn(h, w, (teacher_hidden, teacher_weight)) -> the mean divergence over the rows, as
    TRL reduces it (its sum over the rows it passes, over their count)."""
    if name == "flce-distill":
        return lambda h, w, t: flce.fused_linear_divergence(h, w, *t, beta=beta)[0].sum() / h.shape[0]
    if name == "trl-distill":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        def trl_divergence(h, w, t):
            divergence, _ = ChunkedDivergenceFunction.apply(h, w, None, t[0], t[1], None, beta, 1.0, 1.0, None,
                                                            1.0, None)
            return divergence.sum() / h.shape[0]

        return trl_divergence
    if name == "liger-jsd":  # Liger's mean over the tokens; shift_labels (its 5th argument) None
        try:
            from liger_kernel.transformers import LigerFusedLinearJSD
        except ImportError:
            from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=beta, temperature=1.0)
        return lambda h, w, t: jsd(h, w, t[0], t[1], None)
    if name == "torch.compile-jsd":
        return torch.compile(lambda h, w, t: plain_jsd(h @ w.T, t[0] @ t[1].T, beta).mean(), dynamic=False)
    raise ValueError(name)


def distill_reference(hidden, weight, teacher, beta: float, dtype=torch.float32, rows=1024):
    """(mean divergence, grad_hidden, grad_weight) in ``dtype`` from materialised logits, chunked over rows."""
    w = weight.to(dtype).requires_grad_()
    teacher_weight = teacher[1].to(dtype)
    loss = torch.zeros((), device=hidden.device, dtype=dtype)
    grad_h = torch.empty(hidden.shape, device=hidden.device, dtype=dtype)
    for start in range(0, hidden.shape[0], rows):
        h = hidden[start:start + rows].to(dtype).requires_grad_()
        part = plain_jsd(h @ w.T, teacher[0][start:start + rows].to(dtype) @ teacher_weight.T, beta).sum()
        part = part / hidden.shape[0]
        part.backward()
        grad_h[start:start + rows] = h.grad
        loss += part.detach()
    return loss, grad_h, w.grad


def distill_row(row: str, flce, args, result: dict) -> None:
    """Times the distillation methods on ``row`` (``measure``: the teacher's hidden states and
    weight ride as its ``targets``) and appends their entries to ``result``."""
    student_h, teacher_h, vocab_size, n_tokens, beta = DISTILL_ROWS[row]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def head(h):  # logits of a few units, as a trained head's
        hidden = torch.randn(n_tokens, h, device="cuda", generator=gen, dtype=torch.bfloat16)
        weight = torch.randn(vocab_size, h, device="cuda", generator=gen, dtype=torch.bfloat16) * (2 / h**0.5)
        return hidden, weight

    hidden, weight = head(student_h)
    teacher = head(teacher_h)
    ref = distill_reference(hidden, weight, teacher, beta)
    # 2 N V (Hs + Ht) for both logits, 4 N V Hs for the student's two gradient products
    floor_flops = 2 * n_tokens * vocab_size * (student_h + teacher_h) + 4 * n_tokens * vocab_size * student_h
    names = [m for m in args.distill_methods.split(",") if m]
    for name in names:
        t0 = time.time()
        try:
            out = measure(make_distill_method(name, flce, beta), hidden, weight, teacher, ref, args.rep_ms,
                          args.warmup_ms)
            out["step_tflops_floor"] = floor_flops / out["step_ms"] / 1e9
        except ImportError as e:
            out = {"error": f"skipped: {e}"[:200]}
        except torch.OutOfMemoryError as e:
            out = {"error": f"out of memory: {e}"[:200]}
        except Exception as e:  # a peer failing on a shape is a result, not a crash
            out = {"error": f"{type(e).__name__}: {e}"[:300]}
        torch.cuda.empty_cache()
        out["wall_s"] = time.time() - t0
        entry = {"row": row, "inputs": "randn", "hidden_size": student_h, "teacher_hidden_size": teacher_h,
                 "vocab_size": vocab_size, "n_tokens": n_tokens, "beta": beta, "dtype": "bfloat16",
                 "method": name, "reference": "float32", **out}
        result["results"].append(entry)
        print(json.dumps(entry), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    del hidden, weight, teacher, ref
    torch.cuda.empty_cache()


def kernel_breakdown(step, steps: int = 3) -> dict:
    """Where a step's GPU time goes: per kernel (grouped by name) the milliseconds a step, the
    union of kernel intervals (busy) and the span from the first kernel's start to the last's end."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                     if e.get("cat") == "kernel" and "dur" in e)
    per_name: dict[str, float] = {}
    busy, reach, gaps, before = 0.0, float("-inf"), [], ""
    for start, end, name in kernels:
        per_name[name[:60]] = per_name.get(name[:60], 0.0) + (end - start) / 1e3 / steps
        busy += max(0.0, end - max(start, reach))
        if start > reach > float("-inf"):
            gaps.append(((start - reach) / 1e3, before[:40], name[:40]))
        reach, before = max(reach, end), name
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 / steps if kernels else 0.0
    top = dict(sorted(per_name.items(), key=lambda kv: -kv[1]))  # every kernel: the small ones are levers too
    return {"span_ms": span, "busy_ms": busy / 1e3 / steps, "kernel_ms": top,
            "kernels_per_step": len(kernels) / steps,
            "largest_gaps_ms": sorted(gaps, reverse=True)[:8]}


# (and the per-token trainers' steps, whose idle time the kept backward's host reads made: docs/design.md, "Kept rows")
ANATOMY_METHODS = ("fused-linear-ce", "fused-linear-ce-metrics", "torch.compile", "flce-sft", "trl-sft", "trl-glue",
                   *(f"{head}-{kind}" for kind in ("grpo", "dpo", "kto", "rloo", "dft") for head in ("flce", "trl")))


def anatomy(fn, hidden, weight, targets) -> dict:
    """Where a training step's GPU time goes: ``kernel_breakdown`` of three steps issued back to
    back (span, busy time, each kernel's ms a step)."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()

    def step():
        h.grad = w.grad = None
        fn(h, w, targets).backward()

    step()
    return kernel_breakdown(step)


def environment():
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        driver = None
    versions = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    for pkg in ("liger_kernel", "cut_cross_entropy", "kernels", "quack_kernels", "nvidia_cutlass_dsl", "trl"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg.replace("_", "-"))
        except Exception:
            versions[pkg] = None
    return {
        "gpu": props.name, "sm_count": props.multi_processor_count, "driver": driver,
        "versions": versions, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def matmul_peak_tflops(warmup_ms: float = 100):
    """bf16 8192^3 product through PyTorch on random data: the ceiling used for fractions,
    timed after the same warm-up as the methods (at the same clock)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=warmup_ms, rep=500, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


# ---- sparse distillation rows: top-k teacher targets (issue 48) ---------------------------
# name: (hidden_size, vocab_size, n_tokens, dtype, K); K = 1: the top-1 reverse KL (beta = 1)
SPARSE_ROWS = {
    "sparse-k20": (4096, 128256, 8192, "bfloat16", 20),
    "sparse-k100": (4096, 128256, 8192, "bfloat16", 100),
    "sparse-top1": (4096, 128256, 8192, "bfloat16", 1),
}
SPARSE_TEMPERATURE = 1.0


def sparse_teacher(hidden, weight, k: int, seed: int = 1, noise: float = 1.0):
    """A teacher's top-k (ids [N, k], log-probs [N, k] fp32) and its log-prob of a token sampled
    from it ([N], [N]): the student's logits plus Gaussian noise, chunk by chunk."""
    g = torch.Generator(device=hidden.device).manual_seed(seed)
    ids, log_probs, tokens, token_log_probs = [], [], [], []
    for start in range(0, hidden.shape[0], 2048):
        logits = hidden[start:start + 2048].float() @ weight.float().T
        teacher = torch.log_softmax(logits + noise * torch.randn(logits.shape, generator=g, device=logits.device), -1)
        top = teacher.topk(k, dim=-1)
        token = torch.multinomial(teacher.exp(), 1, generator=g)
        ids.append(top.indices)
        log_probs.append(top.values)
        tokens.append(token[:, 0])
        token_log_probs.append(teacher.gather(-1, token)[:, 0])
    return torch.cat(ids), torch.cat(log_probs), torch.cat(tokens), torch.cat(token_log_probs)


def trl_sparse_loss(student_log_probs, ids, teacher_log_probs, beta: float):
    """TRL 1.16's server losses on the student's full log-softmax [N, V], every row counted:
    ``_compute_server_forward_kl_loss`` (beta 0, the teacher's top-k ``ids``) or the top-1
    divergence at beta 1 (``ids`` [N, 1]: the sampled token), both with the tail bucket (TRL's
    default), through TRL's own ``_add_tail_bucket`` and ``_jsd_divergence``."""
    from trl.experimental.server_distillation.server_distillation_trainer import _add_tail_bucket, _jsd_divergence

    valid = teacher_log_probs > float("-inf")
    student = torch.where(valid, student_log_probs.gather(-1, ids), float("-inf"))
    student, support = _add_tail_bucket(student, valid)
    teacher, _ = _add_tail_bucket(torch.where(valid, teacher_log_probs, float("-inf")), valid)
    return _jsd_divergence(student, teacher, beta, support).sum() / ids.shape[0]


def sparse_methods(flce, k: int, labels, teacher):
    """name: f(hidden, weight, ids) for a sparse row: ours (its gradients made in the forward, and
    through a per-row upstream for comparison), torch.compile of TRL's loss on the materialised
    logits, and our loss alone (cross-entropy against ``labels``) at the shape."""
    ids, log_probs, tokens, token_log_probs = teacher
    beta = 0.0 if k > 1 else 1.0
    support, support_log_probs = (ids, log_probs) if k > 1 else (tokens[:, None], token_log_probs[:, None])

    def ours(h, w, _, reduction="mean"):  # mean: the gradients made in the forward (pipeline "sparse")
        if k > 1:
            return flce.fused_linear_sparse_kl(h, w, ids, log_probs, temperature=SPARSE_TEMPERATURE,
                                               reduction=reduction)
        return flce.fused_linear_top1_divergence(h, w, tokens, token_log_probs, temperature=SPARSE_TEMPERATURE,
                                                 reduction=reduction)

    @torch.compile
    def compiled(h, w, _):
        student = F.log_softmax((h @ w.T) / SPARSE_TEMPERATURE, dim=-1)  # TRL: log_softmax of the model's logits
        return trl_sparse_loss(student, support, support_log_probs, beta)

    # The same loss through a per-row upstream (every row counted: the mean of the rows' terms), for
    # comparison: the (N, K) log-probs' backward, from kept rows within TRL's head's peak or recomputed.
    return {"flce-sparse": ours, "flce-sparse-per-row": lambda h, w, _: ours(h, w, _, reduction="none").mean(),
            "torch.compile-trl-sparse": compiled,
            "fused-linear-ce": lambda h, w, _: flce.fused_linear_cross_entropy(h, w, labels)}


def sparse_reference(hidden, weight, ids, teacher_log_probs, beta: float, rows: int = 1024):
    """(loss, grad_hidden, grad_weight) of ``trl_sparse_loss`` in float64, chunk by chunk of rows."""
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    n_rows = hidden.shape[0]
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        student = torch.log_softmax((h64[start:end] @ w64.T) / SPARSE_TEMPERATURE, dim=-1)
        loss = trl_sparse_loss(student, ids[start:end], teacher_log_probs[start:end].double(), beta)
        loss = loss * (end - start) / n_rows
        loss.backward()
        total += loss.detach()
    return total, h64.grad, w64.grad


def run_sparse_rows(flce, rows: str, args, result) -> None:
    """The sparse rows: each method's fwd and fwd+bwd ms, peak MiB and errors against float64;
    ours against our own loss-only step (``step_vs_loss``, ``peak_vs_loss``). Needs TRL (the peer's
    and the reference's definitions)."""
    if rows and importlib.util.find_spec("trl") is None:
        print("# skipping the sparse rows: TRL is not installed", flush=True)
        return
    for row in filter(None, rows.split(",")):
        hidden_size, vocab_size, n_tokens, dtype, k = SPARSE_ROWS[row]
        hidden, weight, labels = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm",
                                             ignored_share=0.0)
        teacher = sparse_teacher(hidden, weight, k)
        methods = sparse_methods(flce, k, labels, teacher)
        ids, log_probs = (teacher[0], teacher[1]) if k > 1 else (teacher[2][:, None], teacher[3][:, None])
        ref = sparse_reference(hidden, weight, ids, log_probs, 0.0 if k > 1 else 1.0)
        torch.cuda.empty_cache()
        entries = {}
        for name, fn in methods.items():
            try:
                out = measure(fn, hidden, weight, ids, None if name == "fused-linear-ce" else ref, args.rep_ms,
                              args.warmup_ms)
            except Exception as e:  # a peer failing on a shape is a result, not a crash
                out = {"error": f"{type(e).__name__}: {e}"[:300]}
            torch.cuda.empty_cache()
            entries[name] = {"row": row, "inputs": "lm", "method": name, "hidden_size": hidden_size,
                             "vocab_size": vocab_size, "n_tokens": n_tokens, "dtype": dtype, "k": k, **out}
        ours, loss_only = entries["flce-sparse"], entries["fused-linear-ce"]
        if "step_ms" in ours and "step_ms" in loss_only:
            ours["step_vs_loss"] = ours["step_ms"] / loss_only["step_ms"]
            ours["peak_vs_loss"] = ours["step_peak_mib"] / loss_only["step_peak_mib"]
        for entry in entries.values():
            result["results"].append(entry)
            print(json.dumps(entry), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        del hidden, weight, labels, teacher, ref
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows: " + ", ".join(ROWS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--inputs", default="lm,uniform", help="lm, uniform or both")
    parser.add_argument("--uniform-rows", default="gemma2,llama3,qwen25,llama2",
                        help="rows that also run uniform inputs when --inputs has them (the main heads)")
    parser.add_argument("--rep-ms", type=float, default=1000)
    parser.add_argument("--warmup-ms", type=float, default=1000,
                        help="warm-up before each timing: long enough for the GPU to settle at its power limit")
    parser.add_argument("--errors-rows", default="gemma2,llama3,qwen25,llama2,llama2-fp32,llama2-fp16",
                        help="rows whose errors against the fp32 reference are measured")
    parser.add_argument("--anatomy-rows", default="",
                        help="rows whose training step is traced (torch.profiler) for this kernel and torch.compile: "
                             "each kernel's ms, busy time against the span of three steps")
    parser.add_argument("--laps", type=int, default=1,
                        help="times each method is timed on a row, the methods' order reversed every other "
                             "lap; fwd_ms and step_ms are the laps' medians (each lap's in *_ms_laps)")
    parser.add_argument("--zero-advantages", type=float, default=0.0,
                        help="share of the GRPO methods' sequences whose advantage is 0 (groups whose rewards were "
                             "all equal)")
    parser.add_argument("--sparse-rows", default="",
                        help="sparse distillation rows (top-k teacher targets): " + ", ".join(SPARSE_ROWS))
    parser.add_argument("--out", default=None, help="JSON file to write (results appended per row)")
    parser.add_argument("--distill-methods", default=",".join(DISTILL_METHODS),
                        help="methods of the distillation rows (--rows " + ", ".join(DISTILL_ROWS) + ")")
    parser.add_argument("--base", default=None,
                        help="another checkout (e.g. from scripts/export_build) whose build is timed too, as the "
                             "methods NAME@base for the BASE_METHODS among --methods, laps alternating")
    args = parser.parse_args()

    flce, loaded_from = load_flce()
    base = load_build(args.base) if args.base else None
    result = {"environment": environment(), "loaded_from": loaded_from,
              "matmul_tflops": matmul_peak_tflops(args.warmup_ms), "results": []}
    print(f"# {result['environment']['gpu']}, bf16 matmul {result['matmul_tflops']:.0f} TFLOP/s", flush=True)
    methods = []
    names = args.methods.split(",")
    if base is not None:
        names += [f"{name}@base" for name in names if name in BASE_METHODS]
        result["base"] = {"root": args.base, "revision": _revision(args.base)}
    for name in names:
        try:
            built = (make_method(name[:-len("@base")], base, args.zero_advantages) if name.endswith("@base")
                     else make_method(name, flce, args.zero_advantages))
            methods.append((name, built))
        except ImportError as e:
            print(f"# skipping {name}: {e}", flush=True)
            result.setdefault("skipped", {})[name] = str(e)

    for row in args.rows.split(","):
        if row in DISTILL_ROWS:  # the student/teacher divergence: a block of its own
            distill_row(row, flce, args, result)
            continue
        hidden_size, vocab_size, n_tokens, dtype = ROWS[row]
        for kind in args.inputs.split(","):
            if kind == "uniform" and row not in args.uniform_rows.split(","):
                continue
            hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), kind,
                                                  ignored_share=ignore_fraction(row))
            ref = reference(hidden, weight, targets) if row in args.errors_rows.split(",") else None
            with torch.no_grad():
                _, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)
            n_valid = (targets != -100).sum().item()
            info = {"row": row, "inputs": kind, "hidden_size": hidden_size, "vocab_size": vocab_size,
                    "n_tokens": n_tokens, "dtype": dtype, "ignored_share": ignore_fraction(row), "n_valid": n_valid,
                    "mean_entropy": metrics["entropy_sum"].item() / n_valid,
                    "top1_accuracy": metrics["num_correct_tokens"].item() / n_valid,
                    "plan": our_plans(flce, hidden, weight), "kept_rows": kept_rows(flce, hidden[:n_valid], weight)}
            flops = 2 * n_tokens * vocab_size * hidden_size
            entries = {}
            for name, fn in methods:
                t0 = time.time()
                try:
                    out = measure(fn, hidden, weight, targets, None if name in OTHER_LOSS else ref, args.rep_ms,
                                  args.warmup_ms)
                    if row in args.anatomy_rows.split(",") and name.removesuffix("@base") in ANATOMY_METHODS:
                        out["anatomy"] = anatomy(fn, hidden, weight, targets)
                except torch.OutOfMemoryError as e:
                    out = {"error": f"out of memory: {e}"[:200]}
                except Exception as e:  # a peer failing on a shape is a result, not a crash
                    out = {"error": f"{type(e).__name__}: {e}"[:300]}
                torch.cuda.empty_cache()
                if "fwd_ms" in out:
                    out["fwd_tflops"] = flops / out["fwd_ms"] / 1e9
                    out["step_tflops_6nvh"] = 3 * flops / out["step_ms"] / 1e9
                out["wall_s"] = time.time() - t0
                entry = {**info, "method": name, **out}
                if "grpo" in name:
                    entry["zero_advantage_share"] = args.zero_advantages
                entries[name] = entry
                result["results"].append(entry)
                print(json.dumps(entry), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(result, indent=1))
            if args.laps > 1:
                later_laps(methods, entries, (hidden, weight, targets), args, flops)
                if args.out:
                    Path(args.out).write_text(json.dumps(result, indent=1))
            del hidden, weight, targets, ref
            torch.cuda.empty_cache()
    run_sparse_rows(flce, args.sparse_rows, args, result)
    # the logit kernel's configuration per launch key, as the autotuner chose them on this GPU
    backend = sys.modules.get(flce.__name__ + "._triton_backend")
    result["tuned_configs"] = [[repr(key[1:]), str(config)] for key, config in getattr(backend, "_chosen", {}).items()]
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)


def our_plans(flce, hidden, weight) -> dict:
    """The plans (``_plan.Plan.as_dict``) that this kernel's training step (gradients of hidden
    and weight) and forward take on a row's inputs, decided as a call decides them (no kernel runs)."""
    chunked, options = (sys.modules[f"{flce.__name__}.{name}"] for name in ("_chunked", "_options"))
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    forward = options.Request(options.LossOptions())
    step = forward.with_grads((True, True, False))
    return {name: chunked.plan_of(hidden_2d, weight, None, request).as_dict()
            for name, request in (("step", step), ("forward", forward))}


def kept_rows(flce, hidden, weight) -> int | None:
    """Rows that a per-token forward on ``hidden`` [n, H] (the rows with a target, as TRL's head passes
    them) keeps for its backward at the default budget (``_kept.KeptRows``, without a kernel run);
    None where the inputs are not on the GPU."""
    if not hidden.is_cuda:
        return None
    kept, backend = (importlib.import_module(f"{flce.__name__}.{name}") for name in ("_kept", "_triton_backend"))
    n_rows, hidden_size = hidden.shape
    rows = kept.KeptRows.for_call(backend, n_rows, weight.shape[0], hidden_size, hidden.dtype, False)
    return rows.rows_to_keep(n_rows)


def _revision(root: str) -> str | None:
    """The git revision that ``scripts/export_build`` wrote beside a build (REVISION), if any."""
    path = Path(root) / "REVISION"
    return path.read_text().strip() if path.exists() else None


def later_laps(methods, entries, inputs, args, flops):
    """Laps 2 to ``args.laps`` of a row: each method timed again (``retime``), the order of the
    first lap reversed in the even laps so that a drift of the GPU's clock over the row weighs on
    every method alike; each entry's fwd_ms and step_ms become the medians of its laps."""
    for lap in range(2, args.laps + 1):
        for name, fn in (reversed(methods) if lap % 2 == 0 else methods):
            entry = entries[name]
            if "error" in entry:
                continue
            entry.setdefault("fwd_ms_laps", [entry["fwd_ms"]])
            entry.setdefault("step_ms_laps", [entry["step_ms"]])
            fwd_ms, step_ms = retime(fn, *inputs, args.rep_ms, args.warmup_ms)
            entry["fwd_ms_laps"].append(fwd_ms)
            entry["step_ms_laps"].append(step_ms)
            torch.cuda.empty_cache()
    for entry in entries.values():
        if "step_ms_laps" in entry:
            entry["fwd_ms"] = statistics.median(entry["fwd_ms_laps"])
            entry["step_ms"] = statistics.median(entry["step_ms_laps"])
            entry["fwd_tflops"] = flops / entry["fwd_ms"] / 1e9
            entry["step_tflops_6nvh"] = 3 * flops / entry["step_ms"] / 1e9
            print(json.dumps({k: entry[k] for k in ("row", "inputs", "method", "fwd_ms_laps", "step_ms_laps")}),
                  flush=True)


def print_table(result):
    print(f"\n{'row':14} {'in':7} {'method':16} {'fwd ms':>8} {'step ms':>8} {'peak MiB':>9} {'-grads':>8} "
          f"{'loss err':>9} {'gh err':>8} {'gw err':>8}")
    for r in result["results"]:
        if "error" in r:
            print(f"{r['row']:14} {r['inputs']:7} {r['method']:16} {r['error'][:60]}")
            continue
        errs = " ".join(f"{r.get(k, float('nan')):8.1e}" for k in ("loss_err", "grad_hidden_err", "grad_weight_err"))
        print(f"{r['row']:14} {r['inputs']:7} {r['method']:16} {r['fwd_ms']:8.2f} {r['step_ms']:8.2f} "
              f"{r['step_peak_mib']:9.0f} {r['step_peak_minus_grads_mib']:8.0f} {errs}")


if __name__ == "__main__":
    main()
