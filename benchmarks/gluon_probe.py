"""Exploration: would a warp-specialised logit kernel beat the Triton one? (perf notes, runs 42-43)

The forward's logit kernel runs its epilogue (tile max, exponentials, sums) after its products:
Triton 3.6 does not warp-specialise on Hopper. Triton's lower-level Gluon dialect does
(``gl.warp_specialize``), so this probe writes the forward's statistics sweep (mode 0: each
(row, 128-column tile)'s max and sum of exp(z - max)) as a persistent "ping-pong" kernel: one
producer warp loads hidden and weight tiles by TMA into two rings of shared-memory stages, and two
consumer warpgroups take alternate 128 x 128 output tiles (a ring each), so that one's epilogue
runs while the other's products do. Run 42 measured that design ("gluon"): its single producer
fills one ring's tile before the other's, so the consumers' products strictly alternate. The
"dual" design gives each ring its own producer warp and starts consumer 1 half a tile after
consumer 0, so that both compute at once and each epilogue falls under the other's products.
Both lose to the logit kernel (run 43's first call): a 128 x 128 tile reads a third more operand
bytes a product. Run 43's cooperative design (three warpgroups of 64 x 256 on one ring, 192 x 256
tiles) won by 1-3% a flop and became the package's ``_gluon_stats``, which the probe times as
"gluon_stats" (its two-warpgroup variants, with and without a producer warp, are in this file at
commit b0ab751; the same kernel with each warpgroup issuing every third step's loads, 1-2% slower
in run 45, at 480cc6e). The probe checks the
statistics against a float64 reference and times them against the package's logit kernel (mode 0
alone, without the target pick; ``--triton-configs`` forces its configurations) and cuBLAS's
plain product.

    python benchmarks/gluon_probe.py [--rows llama2,llama3] [--n 4032] [--designs ...] [--out probe.json]
    PROBE_BK=32 PROBE_STAGES=6 python benchmarks/gluon_probe.py ...

Not part of the package: the interpreter runs no Gluon, so CI could not test it. Written for
Triton 3.6's Gluon (the H200's; compiled for sm_90 on the CPU with it): the dialect is
experimental and moves (Triton 3.9 renames the TMA copies, for one).
"""

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import _gluon_stats, _options, _triton_backend  # noqa: E402

ROWS = {"llama2": (4096, 32000), "llama3": (4096, 128256)}  # (H, V), N = 8192 rows
GROUP_ROWS = 4096
# The kernel's shapes, as globals (a warp-specialised partition's arguments are values only);
# PROBE_BK and PROBE_STAGES (stages a ring) set them at import: 64 x 3 by default, 32 x 6 fits too.
BM, BN, GROUP_BLOCKS = gl.constexpr(128), gl.constexpr(128), gl.constexpr(GROUP_ROWS // 128)
BK = gl.constexpr(int(os.environ.get("PROBE_BK", 64)))
STAGES = gl.constexpr(int(os.environ.get("PROBE_STAGES", 3)))


@gluon.jit
def _tile_coords(tile_id, num_row_blocks, num_col_tiles):
    return _gluon_stats._tile_coords(tile_id, num_row_blocks, num_col_tiles, GROUP_BLOCKS)


@gluon.jit
def _load_step(h_desc, w_desc, a_bufs, b_bufs, ready, empty, ring, step, pid_n, pid_v, k):
    """Step ``step`` of ring ``ring``: K step k of tile (pid_n, pid_v), once the slot's last use is done."""
    slot = ring * STAGES + step % STAGES
    mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), (BM + BN) * BK * 2)
    tma.async_copy_global_to_shared(h_desc, [pid_n * BM, k * BK], ready.index(slot), a_bufs.index(slot))
    tma.async_copy_global_to_shared(w_desc, [pid_v * BN, k * BK], ready.index(slot), b_bufs.index(slot))


@gluon.jit
def _producer(h_desc, w_desc, a_bufs, b_bufs, ready, empty, num_row_blocks, num_col_tiles, k_steps):
    """One warp: every tile's K steps into its consumer's ring (tile j of this program: ring j % 2)."""
    j = 0
    for tile_id in range(gl.program_id(0), num_row_blocks * num_col_tiles, gl.num_programs(0)):
        pid_n, pid_v = _tile_coords(tile_id, num_row_blocks, num_col_tiles)
        for k in range(k_steps):
            _load_step(h_desc, w_desc, a_bufs, b_bufs, ready, empty, j % 2, (j // 2) * k_steps + k, pid_n, pid_v, k)
        j += 1


@gluon.jit
def _ring_producer(h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, num_row_blocks, num_col_tiles, k_steps,
                   which: gl.constexpr):
    """One warp of the "dual" design: the K steps of every other tile (``which``) into ring
    ``which``. Ring 1 starts once consumer 0 is half way through its first tile, so that the two
    consumers' epilogues fall half a tile apart, each under the other's products."""
    programs = gl.num_programs(0)
    num_tiles = num_row_blocks * num_col_tiles
    first_tile = gl.program_id(0) + which * programs
    if which == 1:
        mbarrier.wait(start, 0, pred=first_tile < num_tiles)
    step = 0  # of this ring
    for tile_id in range(first_tile, num_tiles, 2 * programs):
        pid_n, pid_v = _tile_coords(tile_id, num_row_blocks, num_col_tiles)
        for k in range(k_steps):
            _load_step(h_desc, w_desc, a_bufs, b_bufs, ready, empty, which, step, pid_n, pid_v, k)
            step += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
              num_col_tiles, k_steps, which: gl.constexpr, DUAL: gl.constexpr):
    """One warpgroup: the products and the epilogue of every other tile (``which`` = 0 or 1), from
    its own ring of stages (a ring per consumer: a wait on a stage's parity is never two phases
    ahead of it). In the dual design consumer 0 signals ``start`` half way through its first tile."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    programs = gl.num_programs(0)
    step = 0  # of this ring
    for tile_id in range(gl.program_id(0) + which * programs, num_row_blocks * num_col_tiles, 2 * programs):
        pid_n, pid_v = _tile_coords(tile_id, num_row_blocks, num_col_tiles)
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for k in range(k_steps):
            slot = which * STAGES + step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            if DUAL and which == 0:
                mbarrier.arrive(start, pred=step == k_steps // 2)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous step's product is done: its slot goes back to the producer
            mbarrier.arrive(empty.index(which * STAGES + (step + STAGES - 1) % STAGES), pred=k > 0)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(which * STAGES + (step + STAGES - 1) % STAGES))
        tile_max = gl.max(acc, axis=1)
        sum_exp = gl.sum(gl.exp(acc - tile_max[:, None]), axis=1)
        offs_n = pid_n * BM + gl.arange(0, BM, layout=row_layout)
        stat = offs_n.to(gl.int64) * num_col_tiles + pid_v
        gl.store(tile_max_ptr + stat, tile_max, mask=offs_n < n_rows)
        gl.store(tile_sum_ptr + stat, sum_exp, mask=offs_n < n_rows)


@gluon.jit
def _consumer_0(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
                num_col_tiles, k_steps):
    _consumer(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
              num_col_tiles, k_steps, 0, False)


@gluon.jit
def _consumer_1(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
                num_col_tiles, k_steps):
    _consumer(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
              num_col_tiles, k_steps, 1, False)


@gluon.jit
def _dual_consumer_0(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
                     num_col_tiles, k_steps):
    _consumer(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
              num_col_tiles, k_steps, 0, True)


@gluon.jit
def _dual_consumer_1(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
                     num_col_tiles, k_steps):
    _consumer(a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
              num_col_tiles, k_steps, 1, True)


@gluon.jit
def _ring_producer_0(h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, num_row_blocks, num_col_tiles, k_steps):
    _ring_producer(h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, num_row_blocks, num_col_tiles, k_steps, 0)


@gluon.jit
def _ring_producer_1(h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, num_row_blocks, num_col_tiles, k_steps):
    _ring_producer(h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, num_row_blocks, num_col_tiles, k_steps, 1)


@gluon.jit
def ping_pong_stats_kernel(h_desc, w_desc, tile_max_ptr, tile_sum_ptr, n_rows, vocab_size, hidden_size,
                           DUAL: gl.constexpr):
    """Tile statistics [n_rows, V / BN] (max, sum of exp(z - max)) of hidden [n_rows, H] @ weight
    [V, H].T, persistent: two consumer warpgroups and one producer warp (run 42's design) or, with
    DUAL, a producer warp a consumer, consumer 1 half a tile behind consumer 0."""
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BM, BK], h_desc.layout)  # two rings
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    start = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2 * STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    mbarrier.init(start, count=1)
    num_row_blocks = gl.cdiv(n_rows, BM)
    num_col_tiles = gl.cdiv(vocab_size, BN)
    k_steps = gl.cdiv(hidden_size, BK)
    consumer_args = (a_bufs, b_bufs, ready, empty, start, tile_max_ptr, tile_sum_ptr, n_rows, num_row_blocks,
                     num_col_tiles, k_steps)
    producer_args = (h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, num_row_blocks, num_col_tiles, k_steps)
    if DUAL:
        gl.warp_specialize(
            [(_dual_consumer_0, consumer_args), (_dual_consumer_1, consumer_args),
             (_ring_producer_0, producer_args), (_ring_producer_1, producer_args)],
            [4, 1, 1], [232, 40, 40])
    else:
        gl.warp_specialize(
            [(_consumer_0, consumer_args), (_consumer_1, consumer_args),
             (_producer, (h_desc, w_desc, a_bufs, b_bufs, ready, empty, num_row_blocks, num_col_tiles, k_steps))],
            [4, 1], [232, 40])


def ping_pong_stats(hidden: torch.Tensor, weight: torch.Tensor, dual: bool = False):
    """(tile_max, tile_sum_exp) [n_rows, ceil(V / BN)] fp32 of bf16 hidden [n_rows, H], weight [V, H]."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    num_col_tiles = triton.cdiv(vocab_size, BN.value)
    tile_max = torch.empty((n_rows, num_col_tiles), device=hidden.device, dtype=torch.float32)
    tile_sum = torch.empty_like(tile_max)
    block_h, block_w = [BM.value, BK.value], [BN.value, BK.value]
    h_desc = TensorDescriptor.from_tensor(hidden, block_h, gl.NVMMASharedLayout.get_default_for(block_h, gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(weight, block_w, gl.NVMMASharedLayout.get_default_for(block_w, gl.bfloat16))
    programs = torch.cuda.get_device_properties(hidden.device).multi_processor_count
    ping_pong_stats_kernel[(programs,)](h_desc, w_desc, tile_max, tile_sum, n_rows, vocab_size, hidden_size,
                                        DUAL=dual, num_warps=4)
    return tile_max, tile_sum


def package_gluon_stats(hidden, weight):
    """The package's Gluon kernel (``_gluon_stats``, run 43's cooperative design with three
    warpgroups): the same statistics over 256-column tiles."""
    tile_max = torch.empty((hidden.shape[0], triton.cdiv(weight.shape[0], 256)), device=hidden.device)
    tile_sum = torch.empty_like(tile_max)
    programs = torch.cuda.get_device_properties(hidden.device).multi_processor_count
    _gluon_stats.tile_stats(hidden, weight, tile_max, tile_sum, _triton_backend._group_rows(hidden), programs)
    return tile_max, tile_sum


def triton_stats(backend, hidden, weight, targets, opts):
    """The package's logit kernel alone, mode 0 without the target pick: the same statistics."""
    block_v = backend.tile_width(hidden.dtype)
    num_tiles = triton.cdiv(weight.shape[0], block_v)
    tile_max = torch.empty((hidden.shape[0], num_tiles), device=hidden.device)
    tile_sum = torch.empty_like(tile_max)
    dummy = backend._dummy(hidden.device)
    backend._launch_logit_tiles(hidden, weight, None, targets, opts, mode=backend.K.MODE_STATS, block_v=block_v,
                                out=None, tile_stats=(tile_max, tile_sum, dummy, dummy, dummy),
                                target_logit=torch.empty(hidden.shape[0], device=hidden.device), pick_target=False)
    return tile_max, tile_sum


def measure(row: str, n_rows: int, designs: list[str], triton_configs: list[str]) -> dict:
    """The probe's statistics against float64, and its time against the logit kernel's and cuBLAS's."""
    from triton.testing import do_bench

    hidden_size, vocab_size = ROWS[row]
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n_rows, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab_size, hidden_size, device="cuda", generator=gen) * 0.05).bfloat16()
    targets = torch.randint(0, vocab_size, (n_rows,), device="cuda", generator=gen)
    flops = 2 * n_rows * vocab_size * hidden_size
    lse = torch.logsumexp(hidden.double() @ weight.double().T, dim=1)
    rec = {"row": row, "n": n_rows, "bk": BK.value, "stages": STAGES.value}
    opts = _options.LossOptions()
    runs = {"gluon": lambda: ping_pong_stats(hidden, weight),
            "gluon_dual": lambda: ping_pong_stats(hidden, weight, dual=True),
            "gluon_stats": lambda: package_gluon_stats(hidden, weight),
            "triton": lambda: triton_stats(_triton_backend, hidden, weight, targets, opts),
            "cublas": lambda: (hidden @ weight.T, None)}
    def forced(config):  # the logit kernel in one configuration ("BLOCK_N,BLOCK_K,warps,stages,persistent")
        def run():
            os.environ["FLCE_CONFIG"] = config
            try:
                return triton_stats(_triton_backend, hidden, weight, targets, opts)
            finally:
                del os.environ["FLCE_CONFIG"]
        return run

    for config in triton_configs:
        runs[f"triton_{config.replace(',', '_')}"] = forced(config)
    for name, run in runs.items():
        if designs and name not in designs and not name.startswith("triton_"):
            continue
        try:
            tile_max, tile_sum = run()
            if tile_sum is not None:
                lse_tiles = (tile_max.double() + tile_sum.double().log()).logsumexp(dim=1)
                rec[f"{name}_lse_max_abs_err"] = (lse_tiles - lse).abs().max().item()
            ms = do_bench(run, warmup=1000, rep=1000, return_mode="median")
            rec.update({f"{name}_ms": ms, f"{name}_tflops": flops / ms / 1e9})
        except Exception as e:  # a failure is a result
            rec[f"{name}_error"] = f"{type(e).__name__}: {e}"[:600]
    rec["triton_autotuned"] = [str(c) for c in _triton_backend._chosen.values()]
    return rec


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="llama2,llama3")
    parser.add_argument("--n", type=int, default=4096, help="rows of the chunk (the forward's chunk)")
    parser.add_argument("--designs", default="", help="comma-separated subset of gluon, gluon_dual, gluon_stats, "
                        "triton, cublas (default: all)")
    parser.add_argument("--triton-configs", default="",
                        help="';'-separated FLCE_CONFIG values to time the logit kernel in")
    parser.add_argument("--out")
    args = parser.parse_args()
    records = []
    for row in args.rows.split(","):
        records.append(measure(row, args.n, [d for d in args.designs.split(",") if d],
                               [c for c in args.triton_configs.split(";") if c]))
        print(json.dumps(records[-1]), flush=True)
    if args.out:
        env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "command": " ".join([f"{k}={v}" for k, v in sorted(os.environ.items())
                                    if k.startswith(("PROBE_", "FLCE_"))]
                                   + ["python benchmarks/gluon_probe.py"] + sys.argv[1:])}
        Path(args.out).write_text(json.dumps({"environment": env, "records": records}, indent=1))


if __name__ == "__main__" and os.environ.get("TRITON_INTERPRET") != "1":
    main()
