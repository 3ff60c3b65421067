"""Exploration: the forward's statistics in Gluon against the Triton logit kernel and cuBLAS
(perf notes, runs 42-45).

Triton 3.6 does not warp-specialise on Hopper; its lower-level Gluon dialect does. Run 42 wrote
the forward's statistics sweep (mode 0: each (row, tile)'s max and sum of exp(z - max)) as
persistent "ping-pong" kernels (a producer warp, two consumer warpgroups on alternate 128 x 128
tiles, one ring or two): both lost to the logit kernel, a 128 x 128 tile reading a third more
operand bytes a product. Run 43's cooperative design (three warpgroups of 64 x 256 on one ring,
192 x 256 tiles) won by 1-3% a flop and became the package's ``_gluon_stats``. Run 45's variant
of it with the loads shared by the three warpgroups was 1-2% slower. Those designs are in this
file at commits 57e93a2 (the ping-pong kernels), b0ab751 (two-warpgroup variants) and 480cc6e
(shared loads). The probe now checks the package's kernel ("gluon_stats") against a float64
reference and times it against the package's logit kernel (mode 0 alone, without the target
pick; ``--triton-configs`` forces its configurations) and cuBLAS's plain product.

    python lab/gluon_probe.py [--rows llama2,llama3] [--n 4032] [--designs ...] [--out probe.json]

Not part of the package's tests: the interpreter runs no Gluon (the GPU tests run the kernel, and
the CPU tests compile it for sm_90).
"""

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import _gluon_stats, _options, _settings, _triton_backend  # noqa: E402

ROWS = {"llama2": (4096, 32000), "llama3": (4096, 128256)}  # (H, V), N = 8192 rows


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
    pointers = (None, targets, tile_max, tile_sum, None, None, None, None, None, None, None, None, None)
    backend._launch_tiles(backend.K._tile_stats_kernel, hidden, weight, None, pointers, (None, None), block_v)
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
    rec = {"row": row, "n": n_rows}
    opts = _options.LossOptions()
    runs = {"gluon_stats": lambda: package_gluon_stats(hidden, weight),
            "triton": lambda: triton_stats(_triton_backend, hidden, weight, targets, opts),
            "cublas": lambda: (hidden @ weight.T, None)}
    def forced(config):  # the logit kernel in one configuration ("BLOCK_N,BLOCK_K,warps,stages,persistent")
        def run():
            with _settings.override(config=_settings.parse_value("config", config)):
                return triton_stats(_triton_backend, hidden, weight, targets, opts)
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
    parser.add_argument("--designs", default="",
                        help="comma-separated subset of gluon_stats, triton, cublas (default: all)")
    parser.add_argument("--triton-configs", default="",
                        help="';'-separated configurations (BLOCK_N,BLOCK_K,warps,stages,persistent) "
                             "to time the logit kernel in")
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
                                    if k.startswith("FLCE_")]
                                   + ["python lab/gluon_probe.py"] + sys.argv[1:])}
        Path(args.out).write_text(json.dumps({"environment": env, "records": records}, indent=1))


if __name__ == "__main__" and os.environ.get("TRITON_INTERPRET") != "1":
    main()
