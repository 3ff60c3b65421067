"""Cold start: the wall time of the first training call in a fresh process with an empty Triton cache.

Each measurement runs in its own subprocess (``TRITON_CACHE_DIR`` a new empty folder), so that
it pays the kernel's compilation and autotuning as a user's first step on a fresh machine does.
The import and the inputs' creation are outside the timed region. Each record also holds a second
call's time, the warm-up's (its forked children's compiles, from the first fork to the last exit)
and its longest child's, so that the first call's time splits into the children's and the parent's.

    python benchmarks/cold_start.py --out cold-start.json [--rows llama3] [--calls loss,metrics,sft,loss-lazy]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent

CHILD = r"""
import os, sys, time, torch
sys.path.insert(0, {root!r})
from bench import ROWS, load_flce, make_inputs
flce, _ = load_flce()
hidden_size, vocab_size, n_tokens, dtype = ROWS[{row!r}]
hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm")
h, w = hidden.requires_grad_(), weight.requires_grad_()
import importlib
override = importlib.import_module(flce.__name__ + "._settings").override
# (each override held by a name: a context manager collected at once would undo it)
if {call!r} == "loss-untuned":  # compiling without autotuning: the first configuration of each key
    untuned = override(autotune=False)
    untuned.__enter__()
if {call!r} == "loss-lazy":  # each kernel compiled at its first launch, one after another
    lazy = override(precompile=False)
    lazy.__enter__()
# The warm-up's share: the time in its fork and wait, and each child's own (written where the cache is).
precompile = importlib.import_module(flce.__name__ + "._precompile")
warm, run_jobs, warm_up_s = precompile.warm, precompile._compile_into_cache, [0.0]
children_log = os.path.join(os.environ["TRITON_CACHE_DIR"], "children.txt")
def timed_warm(*args):
    start = time.perf_counter()
    try:
        return warm(*args)
    finally:
        warm_up_s[0] += time.perf_counter() - start
def timed_jobs(work, device):
    start = time.perf_counter()
    run_jobs(work, device)
    with open(children_log, "a") as log:
        log.write(f"{{time.perf_counter() - start}}\n")
precompile.warm, precompile._compile_into_cache = timed_warm, timed_jobs
def step():
    if {call!r} == "sft":
        out = flce.fused_linear_log_probs(h, w, targets, outputs=("log_probs", "entropy", "is_top1"))
        loss = -out.log_probs.sum() / (targets != -100).sum()
    elif {call!r} == "metrics":
        loss = flce.fused_linear_cross_entropy(h, w, targets, return_metrics=True)[0]
    else:
        loss = flce.fused_linear_cross_entropy(h, w, targets)
    loss.backward()
torch.cuda.synchronize()
start = time.perf_counter()
step()
torch.cuda.synchronize()
first = time.perf_counter() - start
children = [float(line) for line in open(children_log)] if os.path.exists(children_log) else [0.0]
start = time.perf_counter()
step()
torch.cuda.synchronize()
print(first, time.perf_counter() - start, warm_up_s[0], max(children))
"""


def first_call(row: str, call: str) -> dict[str, float]:
    """One first call in a fresh process: its seconds, a second call's, the warm-up's (its children's
    compiles, from the first fork to the last exit) and its longest child's."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        run = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), row=row, call=call)], env=env,
                             capture_output=True, text=True, check=True)
    names = ("first_call_s", "second_call_s", "warm_up_s", "longest_child_s")
    return dict(zip(names, (float(x) for x in run.stdout.split()[-4:]), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="llama3")
    parser.add_argument("--calls", default="loss,metrics,sft,loss-lazy")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench import environment

    records = []
    for row in args.rows.split(","):
        for call in args.calls.split(","):
            records.append({"row": row, "call": call, **first_call(row, call)})
            print(json.dumps(records[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": environment(), "records": records}, indent=1))


if __name__ == "__main__":
    main()
