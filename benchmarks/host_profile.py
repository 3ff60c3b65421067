"""Where the host's time goes in a training step (cProfile), for heads where the GPU waits for it.

    python benchmarks/host_profile.py --rows llama2 --steps 30 --out host.txt

Runs ``--steps`` training steps back to back under cProfile after a warm-up and prints the
functions by their own time and by cumulative time, per step.
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ROWS, load_flce, make_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="llama2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    flce, _ = load_flce()
    report = io.StringIO()
    for row in args.rows.split(","):
        hidden_size, vocab_size, n_tokens, dtype = ROWS[row]
        hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm")
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

        def step(h=h, w=w, targets=targets):
            h.grad = w.grad = None
            flce.fused_linear_cross_entropy(h, w, targets).backward()

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps * 1e3
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        profile.disable()
        print(f"## {row}: {wall:.2f} ms a step without the profiler", file=report)
        for key in ("tottime", "cumtime"):
            stats = pstats.Stats(profile, stream=report)
            stats.sort_stats(key).print_stats(30)
    text = report.getvalue()
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
