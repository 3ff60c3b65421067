"""The vocabulary-parallel checks of tests/test_distributed.py (DTensor weights included) and
the FSDP2/DDP/tensor-parallel training checks of tests/_engines.py over NCCL, one process a GPU,
then the throughput of issue 5 item 6 on the Llama-3 head (bf16, N = 8192, LM-like inputs):
one rank's sharded training step against the unsharded step on one GPU divided by P, plus
the same all-reduces timed alone.

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
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("LOCAL_KERNELS", f"qgallouedec/fused-linear-ce={ROOT}")


def _event_median_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median of per-call CUDA-event times; a fixed count, so that every rank calls the
    collectives inside ``fn`` equally often (do_bench picks its count per process)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def throughput(flce, rank: int, world: int) -> dict:
    """Issue 5 item 6: one rank's sharded step <= unsharded step / P + the all-reduces."""
    from bench import make_inputs

    hidden_size, vocab, n_tokens = 4096, 128256, 8192
    hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab, torch.bfloat16, "lm")
    sizes = [len(part) for part in torch.arange(vocab).tensor_split(world)]
    start = sum(sizes[:rank])
    h = hidden.clone().requires_grad_()
    w_full = weight.clone().requires_grad_()
    w_local = weight[start:start + sizes[rank]].clone().requires_grad_()

    def full_step():
        h.grad = w_full.grad = None
        flce.fused_linear_cross_entropy(h, w_full, targets).backward()

    def sharded_step():
        h.grad = w_local.grad = None
        flce.fused_linear_cross_entropy(h, w_local, targets, process_group=dist.group.WORLD).backward()

    # The all-reduces of one sharded step, alone, over the chunks that the kernel plans: per
    # chunk an int64 MAX [rows], an fp32 SUM [rows, 5] and the chunk's grad_hidden [rows, H]
    # (asynchronous) in bf16.
    package = flce.__name__
    shard = sys.modules[package + "._distributed"].Shard(dist.group.WORLD, start, vocab)
    chunk = sys.modules[package + "._plan"].plan_chunk(
        "triton", n_tokens, shard.planning_vocab_size, hidden.shape[1], hidden.dtype, True, shard.world_size)
    starts = range(0, n_tokens, chunk)
    keys = [torch.zeros(min(chunk, n_tokens - s), dtype=torch.int64, device="cuda") for s in starts]
    packed = [torch.zeros(min(chunk, n_tokens - s), 5, dtype=torch.float32, device="cuda") for s in starts]
    grad_hidden = torch.zeros_like(hidden)

    def all_reduces():
        pending = []
        for s, k, p in zip(starts, keys, packed, strict=True):
            dist.all_reduce(k, op=dist.ReduceOp.MAX)
            dist.all_reduce(p)
            pending.append(dist.all_reduce(grad_hidden[s:s + chunk], async_op=True))
        for work in pending:
            work.wait()

    full_ms = _event_median_ms(full_step)
    sharded_ms = _event_median_ms(sharded_step)
    comm_ms = _event_median_ms(all_reduces)
    mine = torch.tensor([full_ms, sharded_ms, comm_ms], dtype=torch.float64, device="cuda")
    slowest = mine.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    full_ms, sharded_ms, comm_ms = slowest.tolist()
    return {"head": [hidden_size, vocab], "n_tokens": n_tokens, "dtype": "bfloat16", "inputs": "lm",
            "chunks": len(starts), "all_reduces_per_step": 3 * len(starts),
            "unsharded_step_ms": full_ms, "sharded_step_ms": sharded_ms, "all_reduces_ms": comm_ms,
            "bound_ms": full_ms / world + comm_ms, "ratio_to_bound": sharded_ms / (full_ms / world + comm_ms),
            "ok": sharded_ms <= full_ms / world + comm_ms, "timing": "medians of 20 CUDA-event timings, "
            "slowest rank"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="distributed.json")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    from _engines import ENGINES, check_engine
    from kernels import get_kernel
    from test_distributed import CASES, _check_case, _check_data_parallel, _check_dtensor, _check_metrics_bit_identity

    flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
    results = []
    settings = sys.modules[f"{flce.__name__}._settings"]
    for index, case in enumerate(CASES):
        # several chunks of rows on the training and the merge-once paths, as in the gloo test
        try:
            with settings.override(chunk_rows=4 if index >= 1 else 4096):
                _check_case(flce, rank, world, {k: v for k, v in case.items() if k != "kernels"},
                            device=f"cuda:{local_rank}")
            results.append({"case": case, "ok": True})
        except Exception:
            results.append({"case": case, "ok": False, "error": traceback.format_exc()[-800:]})
    for check in (_check_metrics_bit_identity, _check_data_parallel, _check_dtensor):
        try:
            check(flce, rank, world, device=f"cuda:{local_rank}")
            results.append({"case": check.__name__, "ok": True})
        except Exception:
            results.append({"case": check.__name__, "ok": False, "error": traceback.format_exc()[-800:]})
    for engine in ENGINES:  # a patched tiny Llama trained in FSDP2, DDP, tensor parallelism (fp32)
        try:
            check_engine(flce, engine, device=f"cuda:{local_rank}")
            results.append({"case": f"engine {engine}", "ok": True})
        except Exception:
            results.append({"case": f"engine {engine}", "ok": False, "error": traceback.format_exc()[-800:]})
    timing = throughput(flce, rank, world)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "gpus": world, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "backend": "nccl", "ranks": gathered, "throughput": timing,
                  "ok": all(r["ok"] for ranks in gathered for r in ranks)}
        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps({"gpus": world, "ok": record["ok"], "throughput": timing}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
