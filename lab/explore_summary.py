"""A short table of explore.py's JSON records (one line per record), for the end of a GPU log.

    python lab/explore_summary.py out/a1.json out/a2.json ...
    python lab/explore_summary.py --kernels _factored_rows,_order_rows,radix_sort out/a1.json

With --kernels, each record's breakdown instead: the microseconds a step (or a forward) of the
kernels whose names contain each pattern, and of every kernel that is neither a product nor
the logit sweep ("small").
"""

import argparse
import json

KEYS = ("fwd_ms", "step_ms", "loop_ms", "step_extra_mib", "grad_hidden_err", "grad_weight_err")
PRODUCTS = ("nvjet", "_logit_tile", "tile_stats", "gemm", "cutlass")


def records_of(path):
    try:
        data = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"{path}: {e}")
        return []
    return data["records"] if isinstance(data, dict) else data  # explore.py's file, or its records


def label_of(r) -> str:
    return f"{r.get('row', '')} {r.get('variant', r.get('config', r.get('gemm_rows', '')))}"


def kernel_line(r, patterns) -> str | None:
    b = r.get("breakdown") or r.get("fwd_breakdown")
    if b is None:
        return None
    kernels = b["kernel_ms"]
    parts = [f"{p} {1e3 * sum(v for k, v in kernels.items() if p in k):.1f}" for p in patterns]
    small = 1e3 * sum(v for k, v in kernels.items() if not any(p in k for p in PRODUCTS))
    return f"{label_of(r):44} " + "  ".join(parts) + f"  small {small:.1f}  all {sum(kernels.values()):.3f} ms"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--kernels", default="", help="','-separated name patterns: their us per step")
    args = parser.parse_args()
    patterns = [p for p in args.kernels.split(",") if p]
    for path in args.paths:
        for r in records_of(path):
            if patterns:
                line = kernel_line(r, patterns)
                if line is not None:
                    print(line)
                continue
            if "breakdown" in r:
                b = r["breakdown"]
                top = ", ".join(f"{k[:28]} {v:.2f}" for k, v in list(b["kernel_ms"].items())[:6])
                print(f"{label_of(r):34} span {b['span_ms']:.2f} busy {b['busy_ms']:.2f} | {top}")
            values = [f"{k.replace('_ms', '')} {r[k]:.3g}" for k in KEYS if isinstance(r.get(k), float)]
            values += [f"{k.replace('_tflops', '')} {v:.0f}" for k, v in r.items() if k.endswith("_tflops")]
            print(f"{label_of(r):34} " + "  ".join(values) + (f"  {r['error'][:80]}" if "error" in r else ""))


if __name__ == "__main__":
    main()
