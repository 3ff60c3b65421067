"""Benchmark of the CPU path: fused-linear-ce's chunked PyTorch path against PyTorch eager.

One training step (float32, or bf16 with ``--dtype bfloat16``; forward + backward, gradients for
hidden and weight) of the
cross-entropy of ``hidden @ weight.T`` at each N. Time: the median wall and process CPU times
of a few steps of each method, after a warm-up step each, the methods interleaved in one
process so that a busy machine slows them alike. Memory: one step of each method in its own
process, its peak resident memory (the process's VmHWM, reset before the step) above the
resident memory with only the inputs allocated (after a step on a few rows, which sets up what
the libraries keep); "extra − grads" subtracts the bytes of grad_hidden and grad_weight, which
every method returns. PyTorch eager is ``F.cross_entropy(hidden @ weight.T, targets)``.

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


def _inputs(n_tokens: int, hidden_size: int, vocab_size: int, seed: int, dtype: str = "float32"):
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tokens, hidden_size, generator=gen).to(getattr(torch, dtype)).requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, generator=gen) * hidden_size**-0.5).to(getattr(torch, dtype))
    weight.requires_grad_()
    targets = torch.randint(0, vocab_size, (n_tokens,), generator=gen)
    targets[torch.rand(n_tokens, generator=gen) < IGNORE_FRACTION] = -100
    return hidden, weight, targets


def _step_fn(method: str):
    """One training step of ``method`` on (hidden, weight, targets); returns the loss."""
    import torch.nn.functional as F

    if method == "fused-linear-ce":
        from fused_linear_ce import fused_linear_cross_entropy as loss_fn
    else:
        def loss_fn(hidden, weight, targets):
            return F.cross_entropy((hidden @ weight.T).float(), targets)

    def step(hidden, weight, targets):
        hidden.grad = weight.grad = None
        loss = loss_fn(hidden, weight, targets)
        loss.backward()
        return loss.detach()

    return step


def run_memory(method: str, n_tokens: int, hidden_size: int, vocab_size: int, seed: int, dtype: str) -> dict:
    """Peak resident memory of one training step of ``method``, in this process."""
    hidden, weight, targets = _inputs(n_tokens, hidden_size, vocab_size, seed, dtype)
    step = _step_fn(method)
    # A step on a few rows first: what the libraries set up once per process is not counted.
    step(hidden[:16].detach().requires_grad_(), weight, targets[:16])
    gc.collect()
    base_kib = _status_kib("VmRSS")
    _reset_peak_rss()
    loss = step(hidden, weight, targets)
    peak_kib = _status_kib("VmHWM")
    grads_mib = (hidden.numel() + weight.numel()) * hidden.element_size() / 2**20
    return {"base_rss_mib": base_kib / 1024, "peak_rss_mib": peak_kib / 1024,
            "peak_extra_mib": (peak_kib - base_kib) / 1024,
            "peak_extra_minus_grads_mib": (peak_kib - base_kib) / 1024 - grads_mib, "loss": float(loss)}


def run_times(methods: list[str], n_tokens: int, hidden_size: int, vocab_size: int, reps: int, seed: int,
              dtype: str) -> dict:
    """Wall and process CPU times of training steps, the methods interleaved (ABBA...) in this
    process after a warm-up step each, so that a busy machine slows them alike."""
    import torch

    hidden, weight, targets = _inputs(n_tokens, hidden_size, vocab_size, seed, dtype)
    steps = {m: _step_fn(m) for m in methods}
    for step in steps.values():
        step(hidden, weight, targets)
    times = {m: {"wall": [], "cpu": []} for m in methods}
    for rep in range(reps):
        for m in methods if rep % 2 == 0 else methods[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            steps[m](hidden, weight, targets)
            times[m]["cpu"].append(time.process_time() - cpu)
            times[m]["wall"].append(time.perf_counter() - wall)
    return {m: {"step_ms": 1e3 * statistics.median(t["wall"]), "step_cpu_ms": 1e3 * statistics.median(t["cpu"]),
                "step_ms_all": [round(1e3 * x, 1) for x in t["wall"]],
                "step_cpu_ms_all": [round(1e3 * x, 1) for x in t["cpu"]], "threads": torch.get_num_threads(),
                "reps": reps} for m, t in times.items()}


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
    lines = [f"{'N':>6} {'method':>16} {'step ms':>9} {'cpu ms':>9} {'peak extra MiB':>15} {'extra - grads MiB':>18} "
             f"{'loss':>9}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['n_tokens']:>6} {r['method']:>16}  error: {r['error']}")
            continue
        lines.append(f"{r['n_tokens']:>6} {r['method']:>16} {r['step_ms']:>9.1f} {r['step_cpu_ms']:>9.1f} "
                     f"{r['peak_extra_mib']:>15.0f} "
                     f"{r['peak_extra_minus_grads_mib']:>18.0f} {r['loss']:>9.5f}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="2048,16384", help="comma-separated numbers of tokens")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--reps", type=int, default=5, help="timed steps of each method after a warm-up step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--sources", type=Path, default=ROOT / "torch-ext", help="folder holding fused_linear_ce/")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write (default: print only)")
    p.add_argument("--note", default=None, help="a note recorded with the results (e.g. which sources)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one subprocess's part (see below)
    args = p.parse_args()

    sizes = dict(hidden_size=args.hidden, vocab_size=args.vocab, seed=args.seed, dtype=args.dtype)
    methods = args.methods.split(",")
    if args.case:  # in a subprocess: "memory,<method>,<n>" or "time,<n>"; prints its JSON
        kind, *rest = args.case.split(",")
        if kind == "memory":
            out = run_memory(rest[0], int(rest[1]), **sizes)
        else:
            out = run_times(methods, int(rest[0]), reps=args.reps, **sizes)
        print(json.dumps(out))
        return

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.sources.resolve()), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # the PyTorch path, as a CPU user runs it

    def in_subprocess(case):
        cmd = [sys.executable, __file__, "--case", case, "--methods", args.methods, "--hidden", str(args.hidden),
               "--vocab", str(args.vocab), "--reps", str(args.reps), "--seed", str(args.seed), "--dtype", args.dtype]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError((proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
        return json.loads(proc.stdout.strip().splitlines()[-1])

    results = []
    for n in (int(x) for x in args.n.split(",")):
        rows = {m: {"method": m, "n_tokens": n, "hidden_size": args.hidden, "vocab_size": args.vocab,
                    "dtype": args.dtype, "logits_mib": n * args.vocab * 4 / 2**20} for m in methods}
        try:
            load_before = os.getloadavg()[0]
            for m, timing in in_subprocess(f"time,{n}").items():
                rows[m].update(timing, load_average=[load_before, os.getloadavg()[0]])
            for m in methods:
                rows[m].update(in_subprocess(f"memory,{m},{n}"))
        except RuntimeError as error:
            for m in methods:
                rows[m] = {"method": m, "n_tokens": n, "error": str(error)}
        results += rows.values()
        print("\n".join(_table(list(rows.values())).splitlines()[1:]), flush=True)

    print()
    print(_table(results))
    if args.out:
        record = {
            "environment": {"machine": _machine(), "versions": _versions(),
                            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "note": args.note},
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
