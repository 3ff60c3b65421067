"""What a cold first call compiles: each Triton compilation's kernel, constants and seconds, in a
fresh process with an empty Triton cache (run it so: ``TRITON_CACHE_DIR=$(mktemp -d)``).

    TRITON_CACHE_DIR=$(mktemp -d) python lab/cold_profile.py --call loss --out cold-profile.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.compiler.compiler as compiler_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import ROWS, load_flce, make_inputs  # noqa: E402

compilations = []
_compile = compiler_module.compile


def timed_compile(src, *args, **kwargs):
    start = time.perf_counter()
    try:
        return _compile(src, *args, **kwargs)
    finally:
        fn = getattr(src, "fn", None)
        name = getattr(fn, "__name__", None) or getattr(src, "name", str(type(src)))
        constants = {str(k): str(v) for k, v in getattr(src, "constants", {}).items()}
        compilations.append({"kernel": name, "s": time.perf_counter() - start, "constants": constants})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", default="llama3")
    parser.add_argument("--call", default="loss", choices=["loss", "metrics", "sft"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    compiler_module.compile = timed_compile  # before the package's kernels are made
    triton.compiler.compile = timed_compile
    triton.compile = timed_compile
    flce, _ = load_flce()
    import importlib

    precompile = importlib.import_module(flce.__name__ + "._precompile")
    warm, warm_s = precompile.warm, []

    def timed_warm(*a):
        start = time.perf_counter()
        try:
            return warm(*a)
        finally:
            warm_s.append(time.perf_counter() - start)

    precompile.warm = timed_warm
    hidden_size, vocab_size, n_tokens, dtype = ROWS[args.row]
    hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm")
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    torch.cuda.synchronize()
    start = time.perf_counter()
    if args.call == "sft":
        out = flce.fused_linear_log_probs(h, w, targets, outputs=("log_probs", "entropy", "is_top1"))
        loss = -out.log_probs.sum() / (targets != -100).sum()
    else:
        loss = flce.fused_linear_cross_entropy(h, w, targets, return_metrics=args.call == "metrics")
        loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    total = sum(c["s"] for c in compilations)
    print(f"{args.call}: first call {first:.2f} s, warm-up {sum(warm_s):.2f} s, {len(compilations)} compilations "
          f"{total:.2f} s")
    for c in sorted(compilations, key=lambda c: -c["s"]):
        print(f"  {c['s']:6.2f} s  {c['kernel']}")
    record = {"call": args.call, "row": args.row, "first_call_s": first, "compile_s": total, "warm_s": sum(warm_s),
              "compilations": compilations}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
