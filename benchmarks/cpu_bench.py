"""Benchmark of the CPU path: fused-linear-ce's chunked PyTorch path against PyTorch eager.

For each N and method, one training step (forward + backward, gradients for hidden and weight)
of the cross-entropy of ``hidden @ weight.T`` in float32, run in a fresh subprocess so that
its memory is its own: the median time of a few steps after a warm-up, and the peak resident
memory (the process's VmHWM, reset before the steps) above the resident memory with only the
inputs allocated (after a step on a few rows, which sets up what the libraries keep).
"extra − grads" subtracts the bytes of grad_hidden and grad_weight, which every method
returns. PyTorch eager is ``F.cross_entropy(hidden @ weight.T, targets)``.

    python benchmarks/cpu_bench.py --out benchmarks/results/cpu-bench.json
    python benchmarks/cpu_bench.py --n 2048 --reps 3        # prints the table, writes nothing

The kernel is imported from ``--sources`` (default: this checkout's torch-ext/), so that two
versions of it can be measured with the same script.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["fused-linear-ce", "torch"]
IGNORE_FRACTION = 0.1


def _status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current VmRSS (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


def run_case(method: str, n_tokens: int, hidden_size: int, vocab_size: int, reps: int, seed: int) -> dict:
    """One (method, N) case in this process: time and peak memory of a training step."""
    import torch
    import torch.nn.functional as F

    if method == "fused-linear-ce":
        from fused_linear_ce import fused_linear_cross_entropy

        def loss_fn(hidden, weight, targets):
            return fused_linear_cross_entropy(hidden, weight, targets)
    else:
        def loss_fn(hidden, weight, targets):
            return F.cross_entropy(hidden @ weight.T, targets)

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tokens, hidden_size, generator=gen).requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, generator=gen) * hidden_size**-0.5).requires_grad_()
    targets = torch.randint(0, vocab_size, (n_tokens,), generator=gen)
    targets[torch.rand(n_tokens, generator=gen) < IGNORE_FRACTION] = -100

    def step(hidden, targets):
        hidden.grad = weight.grad = None
        loss = loss_fn(hidden, weight, targets)
        loss.backward()
        return loss.detach()

    # A step on a few rows first: what the libraries set up once per process is not counted.
    step(hidden[:16].detach().requires_grad_(), targets[:16])
    gc.collect()
    base_kib = _status_kib("VmRSS")
    _reset_peak_rss()
    times = []
    for i in range(reps + 1):  # the first step is a warm-up, not timed
        start = time.perf_counter()
        loss = step(hidden, targets)
        elapsed = time.perf_counter() - start
        if i:
            times.append(elapsed)
    peak_kib = _status_kib("VmHWM")
    grads_mib = (hidden.numel() + weight.numel()) * 4 / 2**20
    return {
        "method": method, "n_tokens": n_tokens, "hidden_size": hidden_size, "vocab_size": vocab_size,
        "dtype": "float32", "threads": torch.get_num_threads(), "reps": reps,
        "step_ms": 1e3 * statistics.median(times), "step_ms_all": [1e3 * t for t in times],
        "base_rss_mib": base_kib / 1024, "peak_rss_mib": peak_kib / 1024,
        "peak_extra_mib": (peak_kib - base_kib) / 1024,
        "peak_extra_minus_grads_mib": (peak_kib - base_kib) / 1024 - grads_mib,
        "logits_mib": n_tokens * vocab_size * 4 / 2**20, "loss": float(loss),
    }


def _machine() -> dict:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    mem_kib = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:")), 0) if Path("/proc/meminfo").exists() else 0
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
            "platform": platform.platform(), "load_average": list(os.getloadavg())}


def _versions() -> dict:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    return versions


def _table(results: list[dict]) -> str:
    lines = [f"{'N':>6} {'method':>16} {'step ms':>9} {'peak extra MiB':>15} {'extra - grads MiB':>18} {'loss':>9}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['n_tokens']:>6} {r['method']:>16}  error: {r['error']}")
            continue
        lines.append(f"{r['n_tokens']:>6} {r['method']:>16} {r['step_ms']:>9.1f} {r['peak_extra_mib']:>15.0f} "
                     f"{r['peak_extra_minus_grads_mib']:>18.0f} {r['loss']:>9.5f}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="2048,16384", help="comma-separated numbers of tokens")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--reps", type=int, default=3, help="timed steps after the warm-up step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sources", type=Path, default=ROOT / "torch-ext", help="folder holding fused_linear_ce/")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write (default: print only)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # method,n: run one case, print its JSON
    args = p.parse_args()

    if args.case:
        method, n = args.case.split(",")
        print(json.dumps(run_case(method, int(n), args.hidden, args.vocab, args.reps, args.seed)))
        return

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.sources.resolve()), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # the PyTorch path, as a CPU user runs it
    results = []
    for n in (int(x) for x in args.n.split(",")):
        for method in args.methods.split(","):
            cmd = [sys.executable, __file__, "--case", f"{method},{n}", "--hidden", str(args.hidden),
                   "--vocab", str(args.vocab), "--reps", str(args.reps), "--seed", str(args.seed)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                last = (proc.stderr.strip().splitlines() or ["exit status " + str(proc.returncode)])[-1]
                results.append({"method": method, "n_tokens": n, "error": last})
            else:
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(_table(results[-1:]).splitlines()[-1], flush=True)

    print()
    print(_table(results))
    if args.out:
        record = {
            "environment": {"machine": _machine(), "versions": _versions(),
                            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])},
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
