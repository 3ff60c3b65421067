"""Train a tiny byte-level causal LM twice, from the same initialisation and on the same batches:
once with the fused linear cross-entropy kernel (loaded with the model card's line), once with
plain PyTorch (logits, then F.cross_entropy), and compare loss, token accuracy and entropy.

    python examples/demo.py                  # CUDA GPU (bf16) if there is one, else CPU (fp32)
    python examples/demo.py --interpret      # CPU tensors through the Triton interpreter (slow; needs
                                             # triton and numpy: pip install -e ".[demo,triton]")
    python examples/demo.py --vocab 131072 --batch 32 --seq 256   # on a GPU: see the memory

On CPU tensors the kernel runs its chunked PyTorch path; with --interpret it runs the Triton
kernels themselves in Triton's CPU interpreter. No network access is needed: the kernel is
loaded from this checkout (LOCAL_KERNELS) and the text ships in examples/data/.
"""

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "qgallouedec/fused-linear-ce"
# Both must be set before triton or the kernel are imported.
if "--interpret" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"
if "LOCAL_KERNELS" not in os.environ:  # this checkout; its build/ (not tracked) is made from torch-ext/ first
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_variants.py")], check=True)
    os.environ["LOCAL_KERNELS"] = f"{REPO_ID}={ROOT}"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from kernels import get_kernel  # noqa: E402
from torch import nn  # noqa: E402


# ---- the model: embeddings, a few pre-norm transformer blocks, a final norm, lm_head -------------
class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def hidden_states(self, tokens):  # (B, T) int64 -> (B, T, dim), the input of lm_head
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


# ---- the two losses, each with mean token accuracy and mean entropy ---------------------------
def fused_loss(flce, model, tokens, targets):
    hidden = model.hidden_states(tokens)
    loss, metrics = flce.fused_linear_cross_entropy(hidden, model.lm_head.weight, targets, return_metrics=True)
    n = (targets != -100).sum()  # the metrics are sums over non-ignored positions
    return loss, metrics["num_correct_tokens"] / n, metrics["entropy_sum"] / n


def torch_loss(model, tokens, targets):
    logits = model.lm_head(model.hidden_states(tokens)).float()  # (B, T, V): the tensor the kernel avoids
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    with torch.no_grad():
        valid = targets != -100
        log_probs = logits.log_softmax(-1)
        accuracy = (logits.argmax(-1) == targets)[valid].float().mean()
        entropy = -(log_probs.exp() * log_probs).sum(-1)[valid].mean()
    return loss, accuracy, entropy


# ---- driver ------------------------------------------------------------------------------------
def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="training steps (default 30, 6 with --interpret)")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--dim", type=int, default=64, help="model width H")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256,
                   help="rows of lm_head (>= 256). Bytes use the first 256; a larger value stands in for\n"
                        "a large tokenizer's vocabulary, to show the memory and time effect on a GPU")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: the model is too small to gain from more)")
    p.add_argument("--interpret", action="store_true", help="CPU tensors through the Triton interpreter")
    p.add_argument("--data", type=Path, default=ROOT / "examples" / "data" / "declaration.txt")
    args = p.parse_args()
    if args.steps is None:
        args.steps = 6 if args.interpret else 30
    if args.vocab < 256:
        p.error("--vocab must be >= 256 (byte-level tokens)")
    return args


def _missing_for_interpret() -> list[str]:
    """The packages that --interpret needs (Triton's interpreter runs the kernels with numpy) and lacks."""
    import importlib.util

    return [name for name in ("triton", "numpy") if importlib.util.find_spec(name) is None]


def main():
    args = parse_args()
    if args.interpret and _missing_for_interpret():
        sys.exit(f"--interpret runs the Triton kernels in Triton's CPU interpreter, which needs "
                 f"{' and '.join(_missing_for_interpret())}: pip install -e \".[demo,triton]\" (or drop --interpret: "
                 f"CPU tensors then take the kernel's PyTorch path, which needs neither)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.interpret else "cpu"))
    if args.interpret and device.type != "cpu":
        sys.exit("--interpret runs CPU tensors; drop --device cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    path = "Triton kernels" if device.type == "cuda" else "chunked PyTorch path"
    if args.interpret:
        path = "Triton interpreter"

    flce = get_kernel(REPO_ID, version=1, trust_remote_code=True)
    if args.interpret:
        # Larger tiles than the interpreter's defaults (16/32/16): fewer interpreted programs, 4x
        # faster (the kernel's settings, overridden for the whole run: this block is never left; the
        # context manager is held by a name, as one collected at once would undo the override).
        larger_tiles = sys.modules[f"{flce.__name__}._settings"].override(block_n=64, block_v=64, block_k=32)
        larger_tiles.__enter__()

    data = torch.tensor(list(args.data.read_bytes()), dtype=torch.int64)
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]
    if len(held_out) < args.seq + 2:
        sys.exit(f"--seq {args.seq} is too long for the held-out 10% of {args.data.name} ({len(held_out)} bytes)")
    gen = torch.Generator().manual_seed(args.seed)

    def batch(source):
        starts = torch.randint(0, len(source) - args.seq - 1, (args.batch,), generator=gen)
        window = torch.stack([source[s : s + args.seq + 1] for s in starts.tolist()]).to(device)
        return window[:, :-1], window[:, 1:]  # inputs, next-byte targets

    torch.manual_seed(args.seed)
    kernel_model = TinyLM(args.vocab, args.dim, args.layers, heads=4, context=args.seq).to(device, dtype)
    torch_model = copy.deepcopy(kernel_model)
    runs = {
        "kernel": (kernel_model, torch.optim.AdamW(kernel_model.parameters(), lr=args.lr),
                   lambda m, x, y: fused_loss(flce, m, x, y)),
        "torch": (torch_model, torch.optim.AdamW(torch_model.parameters(), lr=args.lr), torch_loss),
    }

    n_tokens = args.batch * args.seq
    print(f"kernel: {flce.__name__} from {Path(flce.__file__).parent}, running the {path}")
    print(f"device {device}, {str(dtype).removeprefix('torch.')}, "
          f"{sum(p.numel() for p in kernel_model.parameters()) / 1e6:.2f}M parameters, vocabulary {args.vocab}, "
          f"{args.batch} x {args.seq} = {n_tokens} tokens a step, {args.steps} steps of AdamW (lr {args.lr})")
    print(f"text: {args.data.name} ({len(data)} bytes, last 10% held out)")
    print()
    print(f"{'step':>4}  {'loss:kernel':>11} {'torch':>9}  {'accuracy:kernel':>15} {'torch':>7}  "
          f"{'entropy:kernel':>14} {'torch':>7}")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = {name: [] for name in runs}
    peaks = {name: 0 for name in runs}
    max_loss_diff = 0.0
    for step in range(1, args.steps + 1):
        tokens, targets = batch(train)
        values = {}
        for name, (model, optimizer, loss_fn) in runs.items():
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                start_mem = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            loss, accuracy, entropy = loss_fn(model, tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            times[name].append(time.perf_counter() - start)
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) - start_mem)
            values[name] = [float(v.detach()) for v in (loss, accuracy, entropy)]
        k, t = values["kernel"], values["torch"]
        max_loss_diff = max(max_loss_diff, abs(k[0] - t[0]))
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"{step:>4}  {k[0]:>11.5f} {t[0]:>9.5f}  {k[1]:>15.4f} {t[1]:>7.4f}  {k[2]:>14.4f} {t[2]:>7.4f}")

    # Evaluation: no backward follows, so the kernel is called under no_grad (else it would
    # compute the gradients in its forward for nothing).
    tokens, targets = batch(held_out)
    with torch.no_grad():
        k = [float(v) for v in fused_loss(flce, kernel_model, tokens, targets)]
        t = [float(v) for v in torch_loss(torch_model, tokens, targets)]
    print(f"{'eval':>4}  {k[0]:>11.5f} {t[0]:>9.5f}  {k[1]:>15.4f} {t[1]:>7.4f}  {k[2]:>14.4f} {t[2]:>7.4f}"
          "   (held-out batch, torch.no_grad())")
    print()
    print(f"max |loss kernel - loss torch| over the training steps: {max_loss_diff:.2e}")

    def ms(seconds):
        return f"{1e3 * seconds:.1f} ms"

    steady = {name: times[name][1:] or times[name] for name in runs}
    print("time a step (forward, metrics, backward, AdamW), median after step 1: "
          + ", ".join(f"{name} {ms(statistics.median(steady[name]))}" for name in runs)
          + "; step 1: " + ", ".join(f"{name} {ms(times[name][0])}" for name in runs))
    logits_mib = n_tokens * args.vocab * 4 / 2**20
    if device.type == "cuda":
        print("peak GPU memory of a step above its start (torch.cuda.max_memory_allocated): "
              + ", ".join(f"{name} {peaks[name] / 2**20:.1f} MiB" for name in runs)
              + f"; the torch side's fp32 logits alone are {logits_mib:.1f} MiB")
    else:
        print(f"peak memory: n/a on CPU (not measured); the torch side's fp32 logits alone are {logits_mib:.1f} MiB "
              "a step, the kernel's chunk buffer is bounded instead")


if __name__ == "__main__":
    main()
