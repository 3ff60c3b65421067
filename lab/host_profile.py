"""Where the host's time goes in a training step (or, with ``--forward``, an evaluation
forward), for heads where the GPU may wait for it.

    python lab/host_profile.py --rows llama2,llama3 --steps 30 --json host.json [--cprofile host.txt]
        [--forward]

For each head, after a warm-up:
- ``wall``: ms a step, ``--steps`` steps back to back, one synchronize at the end;
- ``host``: ms a step spent inside the step's Python call (the host issuing it), and of that
  ``waiting``: the wait for the count of rows with a loss (the step's one host sync). A step is
  bound by the host when ``host - waiting`` is close to ``wall``;
- ``calls``: host ms a step inside each backend function of the chunk loop (inclusive; the
  launches are asynchronous, so this is the host's cost of issuing them);
- ``do_bench``: step ms quantiles (0.1, 0.5, 0.9) of triton's do_bench over ``--rep-ms``,
  as bench.py measures it;
- ``sustained`` (with ``--sustained-s``, for this kernel and torch.compile): ms a step over that
  many seconds of back-to-back steps, the SM clock, power and throttle reasons nvidia-smi reports
  meanwhile, and right after, the profiler's busy and span of three steps (``bench.kernel_breakdown``):
  whether a step's time is the GPU's work at the clock it runs at, or waiting.
With ``--cprofile FILE`` also a cProfile listing of the same steps.
"""

import argparse
import cProfile
import functools
import importlib
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import ROWS, GpuSampler, environment, kernel_breakdown, load_flce, make_inputs, make_method  # noqa: E402

BACKEND_CALLS = ("order_rows", "row_reference", "row_stats", "finalize", "row_factors", "scale_rows",
                 "factored_sweep", "factored_rows", "add_target_rows", "new_buffer", "grad_from_stored", "chunk_rows")


def _timed(totals: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def install_timers(flce) -> dict:
    """Wraps the chunk loop's backend calls, the gradient accumulation and the count's wait
    with host timers; returns their running totals (seconds)."""
    totals = defaultdict(float)
    # (the Triton backend is imported on the kernel's first CUDA call: this may come before it)
    backend, chunked = importlib.import_module(flce.__name__ + "._triton_backend"), flce._chunked
    for name in BACKEND_CALLS:
        if hasattr(backend, name):
            setattr(backend, name, _timed(totals, name, getattr(backend, name)))
    for cls, name in ((chunked._Gradients, "add"), (chunked._Gradients, "finish"),
                      (chunked._RowOrder, "rows_to_compute"), (chunked._RowOrder, "__init__")):
        setattr(cls, name, _timed(totals, f"{cls.__name__}.{name}", getattr(cls, name)))
    chunked.forward = _timed(totals, "_chunked.forward", chunked.forward)
    return totals


def profile_row(flce, totals, row: str, steps: int, rep_ms: int, cprofile_report=None, forward: bool = False) -> dict:
    """Host and wall time of a training step of ``row`` (``forward``: of an evaluation forward)."""
    hidden_size, vocab_size, n_tokens, dtype = ROWS[row]
    hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm")
    h, w = hidden.detach().requires_grad_(not forward), weight.detach().requires_grad_(not forward)
    host = [0.0]

    def step():
        start = time.perf_counter()
        if forward:
            with torch.no_grad():
                flce.fused_linear_cross_entropy(h, w, targets)
        else:
            h.grad = w.grad = None
            flce.fused_linear_cross_entropy(h, w, targets).backward()
        host[0] += time.perf_counter() - start

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    totals.clear()
    host[0] = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps * 1e3
    per_step = {name: seconds / steps * 1e3 for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1])}
    result = {
        "row": row, "step": "forward" if forward else "training", "wall_ms": wall, "host_ms": host[0] / steps * 1e3,
        "waiting_ms": per_step.get("_RowOrder.rows_to_compute", 0.0), "calls_ms": per_step,
        "do_bench_ms": do_bench(step, warmup=100, rep=rep_ms, quantiles=[0.1, 0.5, 0.9]),
    }
    if cprofile_report is not None:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        profile.disable()
        print(f"## {row}", file=cprofile_report)
        for key in ("tottime", "cumtime"):
            pstats.Stats(profile, stream=cprofile_report).sort_stats(key).print_stats(30)
    return result


def sustained(flce, method: str, row: str, seconds: float) -> dict:
    """Back-to-back steps for ``seconds``, nvidia-smi sampling clocks and power meanwhile, then the
    profiler's view of three more steps at that clock."""
    hidden_size, vocab_size, n_tokens, dtype = ROWS[row]
    hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm")
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    fn = make_method(method, flce)

    def step():
        h.grad = w.grad = None
        fn(h, w, targets).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with GpuSampler() as sampler:
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            step()
            steps += 1
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps * 1e3
    hot = kernel_breakdown(step)
    return {"method": method, "row": row, "steps": steps, "ms": wall, **sampler.summary(),
            "hot_span_ms": hot["span_ms"], "hot_busy_ms": hot["busy_ms"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="llama2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rep-ms", type=int, default=1000)
    parser.add_argument("--sustained-s", type=float, default=0.0)
    parser.add_argument("--sustained-methods", default="fused-linear-ce,torch.compile")
    parser.add_argument("--forward", action="store_true", help="evaluation forwards instead of training steps")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cprofile", default=None)
    args = parser.parse_args()
    flce, _ = load_flce()
    totals = install_timers(flce)
    report = io.StringIO() if args.cprofile else None
    results = []
    for row in args.rows.split(","):
        r = profile_row(flce, totals, row, args.steps, args.rep_ms, report, forward=args.forward)
        results.append(r)
        q = r["do_bench_ms"]
        print(f"{row}: wall {r['wall_ms']:.2f} ms, host {r['host_ms']:.2f} (waiting {r['waiting_ms']:.2f}), "
              f"do_bench {q[0]:.2f}/{q[1]:.2f}/{q[2]:.2f}")
        print("   " + ", ".join(f"{k} {v:.3f}" for k, v in r["calls_ms"].items()))
        if args.sustained_s > 0:
            r["sustained"] = [sustained(flce, m, row, args.sustained_s) for m in args.sustained_methods.split(",")]
            for s in r["sustained"]:
                print(f"   sustained {s['method']}: {s['ms']:.2f} ms a step, SM {s['sm_clock_mhz']:.0f} MHz "
                      f"(min {s['sm_clock_mhz_min']:.0f}), {s['power_w']:.0f} W, throttle "
                      f"{s['throttle_reasons']}; then busy {s['hot_busy_ms']:.2f} of span {s['hot_span_ms']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment(), "results": results}, indent=1))
    if report is not None:
        Path(args.cprofile).write_text(report.getvalue())


if __name__ == "__main__":
    main()
