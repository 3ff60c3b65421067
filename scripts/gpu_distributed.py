#!/usr/bin/env python3
"""Everything that needs several GPUs of one machine (2 or more), over NCCL; JSON and logs go under
$OUT (default ./gpu-out). NVLink multicast stays off (the device machines' rule).

    scripts/gpu_distributed.py [checks] [train] [maxseq]      (default: checks)

    checks  vocabulary parallelism (DTensor weights included), the FSDP2/DDP/tensor-parallel
            training checks and the sharded step's timing: distributed.json
    train   scripts/train_fsdp.py: a 272M-parameter Llama (V = 128256) in FSDP2, bf16, S = 4096,
            200 steps with the fused loss and with the logits loss: train_fsdp.json, train_fsdp_loss.png
    maxseq  scripts/train_fsdp.py --max-seq: the longest sequence and largest batch each holds:
            train_fsdp_maxseq.json

Knobs: TRAIN_ARGS (extra arguments of train_fsdp.py in both of its stages), NPROC (processes;
default one a GPU). On a CPU: NPROC=2 TRAIN_ARGS="--tiny --device cpu" scripts/gpu_distributed.py train maxseq

The checks stage runs this file in every rank (``--rank-checks``, under torch.distributed.run):
the vocabulary-parallel checks of tests/integrations/test_distributed.py and the engines'
training checks of tests/_ranks.py over NCCL, one process a GPU, then the throughput of issue 5
item 6 on the Llama-3 head (bf16, N = 8192, LM-like inputs): one rank's sharded training step
against the unsharded step on one GPU divided by P, plus the same all-reduces timed alone.
"""

import argparse
import datetime
import importlib
import json
import os
import shlex
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))  # test_distributed's checks
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("LOCAL_KERNELS", f"qgallouedec/fused-linear-ce={ROOT}")
STAGES = ("checks", "train", "maxseq")


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
    backend = importlib.import_module(package + "._triton_backend")
    chunk = sys.modules[package + "._chunked"]._plan_chunk(
        backend, n_tokens, sizes[rank], hidden.shape[1], hidden.dtype, True, shard)
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


def rank_checks(out: str) -> None:
    """One rank of the checks stage (under torch.distributed.run): every check, then the throughput;
    rank 0 writes the JSON of all ranks' outcomes to ``out``."""
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    from _ranks import ENGINES, check_engine
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
        Path(out).write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps({"gpus": world, "ok": record["ok"], "throughput": timing}))
    dist.destroy_process_group()


# ---- the launcher: one torch.distributed.run a stage ----------------------------------------
def _environment() -> dict:
    """The ranks' environment: NVLink multicast off, this checkout's kernel, and the wheels carried
    to a device machine without network (.whl, installed once a machine under /tmp/site)."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONUNBUFFERED": "1", "LOCAL_KERNELS": f"qgallouedec/fused-linear-ce={ROOT}"}
    if (ROOT / ".whl").is_dir():
        if not Path("/tmp/site/.installed").exists():
            wheels = [str(path) for path in sorted((ROOT / ".whl").glob("*.whl"))]
            installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", "/tmp/site",
                                        *wheels]).returncode == 0
            if installed:
                Path("/tmp/site/.installed").touch()
        env["PYTHONPATH"] = "/tmp/site:" + env.get("PYTHONPATH", "")
    return env


def _run(command: list[str], env: dict, log: Path | None) -> int:
    """``command``'s exit status; its output also copied to ``log`` (as tee) when given."""
    if log is None:
        return subprocess.run(command, env=env, cwd=ROOT).returncode
    with subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process, log.open("w") as copy:
        for line in process.stdout:
            sys.stdout.write(line)
            copy.write(line)
    return process.returncode


def launch(stages: list[str]) -> int:
    """Each stage under torch.distributed.run, one process a GPU (NPROC); 1 if one failed, 2 for
    an unknown stage."""
    out = ROOT / os.environ.get("OUT", "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    env = _environment()
    nproc = os.environ.get("NPROC") or str(torch.cuda.device_count())
    train_args = shlex.split(os.environ.get("TRAIN_ARGS", ""))
    checks, train = str(Path(__file__).resolve()), str(ROOT / "scripts" / "train_fsdp.py")
    status = 0
    for stage in stages:
        if stage == "checks":
            command, log = [checks, "--rank-checks", "--out", str(out / "distributed.json")], None
        elif stage == "train":
            command, log = [train, "--out", str(out), *train_args], out / "train_fsdp.log"
        elif stage == "maxseq":
            command, log = [train, "--max-seq", "--out", str(out), *train_args], out / "train_fsdp_maxseq.log"
        else:
            print(f"unknown stage {stage}")
            status = 2
            continue
        if _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc, *command], env, log):
            status = 1
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stages", nargs="*", default=["checks"], help=f"among {STAGES}")
    parser.add_argument("--rank-checks", action="store_true", help="one rank of the checks (the launcher passes it)")
    parser.add_argument("--out", default="distributed.json", help="with --rank-checks: the JSON to write")
    args = parser.parse_args()
    if args.rank_checks:
        rank_checks(args.out)
        return 0
    return launch(args.stages)


if __name__ == "__main__":
    sys.exit(main())
