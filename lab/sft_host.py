"""Where the host's time goes in SFT's step through TRL's head wrapper (``bench.trl_head``), for
our kernel and TRL's: the GPU waits for the host after each of the step's syncs.

    python lab/sft_host.py --out DIR [--rows llama3] [--methods flce-sft,trl-sft] [--steps 20]

Writes DIR/sft-host.json (wall ms a step, back to back; the profiler's busy and span) and, per
method and row, a cProfile listing (DIR/cprofile-METHOD-ROW.txt) and a gzipped chrome trace of
three steps with Python stacks (DIR/trace-METHOD-ROW.json.gz).
"""

import argparse
import cProfile
import gzip
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import ROWS, environment, kernel_breakdown, load_flce, make_inputs, make_method  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="llama3")
    parser.add_argument("--methods", default="flce-sft,trl-sft")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flce, _ = load_flce()
    records = []
    for row in args.rows.split(","):
        hidden_size, vocab_size, n_tokens, dtype = ROWS[row]
        hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm")
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        for method in args.methods.split(","):
            fn = make_method(method, flce)

            def step(fn=fn, h=h, w=w, targets=targets):
                h.grad = w.grad = None
                fn(h, w, targets).backward()

            for _ in range(5):
                step()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / args.steps
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(60)
            (out / f"cprofile-{method}-{row}.txt").write_text(text.getvalue())
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as trace:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            path = out / f"trace-{method}-{row}.json"
            trace.export_chrome_trace(str(path))
            with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
                dst.write(src.read())
            path.unlink()
            records.append({"row": row, "method": method, "wall_ms": wall_ms, **kernel_breakdown(step)})
            print(json.dumps({k: records[-1][k] for k in ("row", "method", "wall_ms", "span_ms", "busy_ms")}),
                  flush=True)
    (out / "sft-host.json").write_text(json.dumps({"environment": environment(), "records": records}, indent=1))


if __name__ == "__main__":
    main()
