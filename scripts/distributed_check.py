"""The vocabulary-parallel checks of tests/test_distributed.py over NCCL, one process a GPU.

    torchrun --nproc-per-node <GPUs> scripts/distributed_check.py --out distributed.json
"""

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("LOCAL_KERNELS", f"qgallouedec/fused-linear-ce={ROOT}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="distributed.json")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    from kernels import get_kernel
    from test_distributed import CASES, _check_case

    flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
    results = []
    for case in CASES:
        try:
            _check_case(flce, rank, world, dict(case), device=f"cuda:{local_rank}")
            results.append({"case": case, "ok": True})
        except Exception:
            results.append({"case": case, "ok": False, "error": traceback.format_exc()[-800:]})
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "gpus": world, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "backend": "nccl", "ranks": gathered,
                  "ok": all(r["ok"] for ranks in gathered for r in ranks)}
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps({"gpus": world, "ok": record["ok"]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
