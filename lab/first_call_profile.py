"""Where a first call's time goes besides compiling: cProfile of the first Llama-3 training call
in a fresh process (with the Triton cache as the environment leaves it: run it twice on one
TRITON_CACHE_DIR for a first call whose kernels are all in the cache).

    TRITON_CACHE_DIR=$(mktemp -d) python lab/first_call_profile.py --call loss [--top 30]
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import ROWS, load_flce, make_inputs  # noqa: E402


class ImportTracer:
    """A finder that finds nothing: it prints the stack of the first import of each watched module."""

    def __init__(self, watched):
        self.watched, self.seen = watched, set()

    def find_spec(self, name, path=None, target=None):
        if name in self.watched and name not in self.seen:
            self.seen.add(name)
            frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                      if "importlib" not in f.filename]
            print(f"import {name}:\n  " + "\n  ".join(frames[-14:]))
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--call", default="loss", choices=["loss", "metrics"])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--trace-imports", default="torch._dynamo,torch._higher_order_ops.triton_kernel_wrap,"
                        "torch.distributed.fsdp,sympy")
    args = parser.parse_args()
    flce, _ = load_flce()
    hidden_size, vocab_size, n_tokens, dtype = ROWS["llama3"]
    hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm")
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    torch.cuda.synchronize()
    sys.meta_path.insert(0, ImportTracer(set(args.trace_imports.split(","))))
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    out = flce.fused_linear_cross_entropy(h, w, targets, return_metrics=args.call == "metrics")
    (out[0] if isinstance(out, tuple) else out).backward()
    torch.cuda.synchronize()
    profile.disable()
    print(f"{args.call}: first call {time.perf_counter() - start:.2f} s")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue()[-9000:])


if __name__ == "__main__":
    main()
