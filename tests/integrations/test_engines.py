"""A patched tiny Llama trained inside FSDP2, DDP and tensor parallelism on 2 gloo CPU processes
(fp32) gives, step by step, the global loss and metrics of one process training the unpatched
model on the whole batch, and the same final parameters (tests/_ranks.py; on GPUs,
scripts/gpu_distributed.py runs the same checks over NCCL)."""

import datetime
import os
import traceback

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from _ranks import exit_without_teardown
from conftest import DEVICE

pytest.importorskip("transformers")

WORLD = 2


def _worker(rank: int, store: str, out_dir: str) -> None:
    # The engines wrap the model, not the loss's backend: the PyTorch path of CPU tensors.
    os.environ["TRITON_INTERPRET"] = "0"
    # A file store: no TCP port to pick beforehand (which another process could take).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        from _ranks import ENGINES, check_engine
        from kernels import get_kernel

        flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
        for engine in ENGINES:
            try:
                check_engine(flce, engine)
                status = "ok"
            except Exception:
                status = f"rank {rank}:\n{traceback.format_exc()}"
            with open(os.path.join(out_dir, f"{engine}.{rank}"), "w") as f:
                f.write(status)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_teardown()  # the outcomes are written


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Each engine's outcome on each rank ("ok" or the traceback): one spawn for all of them."""
    out_dir = tmp_path_factory.mktemp("engines")
    store = tmp_path_factory.mktemp("store") / "store"
    mp.spawn(_worker, args=(str(store), str(out_dir)), nprocs=WORLD, join=True)
    return {path.name: path.read_text() for path in out_dir.iterdir()}


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo on CPU processes; GPUs run scripts/gpu_distributed.py")
@pytest.mark.parametrize("engine", ["fsdp2", "fsdp2-tied", "ddp", "tp"])
def test_engine_matches_one_process(outcomes, engine):
    for rank in range(WORLD):
        assert outcomes.get(f"{engine}.{rank}") == "ok", outcomes.get(f"{engine}.{rank}", "no outcome")
