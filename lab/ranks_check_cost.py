"""The cost of the ranks' agreement check under ``process_group=``: training steps of a vocabulary
split over two gloo processes on the CPU (the PyTorch path), with the check and without it
(``check_targets=False`` skips it, with the targets' range check), interleaved, medians.

    python lab/ranks_check_cost.py --out lab/history/ranks-check-cost.json [--n 4096 --hidden 256 --vocab 32000]
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _worker(rank, world, store, args, out):
    sys.path.insert(0, str(ROOT / "torch-ext"))
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import fused_linear_ce as flce
    from fused_linear_ce import _settings

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.n, args.hidden, generator=gen)
    weight = torch.randn(args.vocab, args.hidden, generator=gen) * args.hidden**-0.5
    targets = torch.randint(0, args.vocab, (args.n,), generator=gen)
    local = torch.arange(args.vocab).tensor_split(world)[rank]
    w = weight[local].clone().requires_grad_()
    h = hidden.clone().requires_grad_()

    def step():
        h.grad = w.grad = None
        flce.fused_linear_cross_entropy(h, w, targets, process_group=dist.group.WORLD).backward()

    times = {"with": [], "without": []}
    step()
    for rep in range(args.reps):
        for kind in ("with", "without") if rep % 2 == 0 else ("without", "with"):
            with _settings.override(check_targets=kind == "with"):
                dist.barrier()
                start = time.perf_counter()
                step()
                dist.barrier()
                times[kind].append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        times_file = Path(tmp) / "times.json"
        mp.spawn(_worker, args=(2, Path(tmp) / "store", args, str(times_file)), nprocs=2, join=True)
        times = json.loads(times_file.read_text())
    result = {k: statistics.median(v) for k, v in times.items()}
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "torch": torch.__version__, "ranks": 2, "backend": "gloo (CPU)",
              "n": args.n, "hidden": args.hidden, "vocab": args.vocab, "step_ms": times,
              "median_ms": result, "check_share": result["with"] / result["without"] - 1}
    print(json.dumps({k: record[k] for k in ("median_ms", "check_share")}))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
