"""A short table of explore.py's JSON records (one line per record), for the end of a GPU log.

    python benchmarks/explore_summary.py out/a1.json out/a2.json ...
"""

import json
import sys

KEYS = ("fwd_ms", "step_ms", "loop_ms", "step_extra_mib", "grad_hidden_err", "grad_weight_err")


def main(paths):
    for path in paths:
        try:
            data = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"{path}: {e}")
            continue
        records = data["records"] if isinstance(data, dict) else data  # explore.py's file, or its records
        for r in records:
            label = f"{r.get('row', '')} {r.get('variant', r.get('config', r.get('gemm_rows', '')))}"
            if "breakdown" in r:
                b = r["breakdown"]
                top = ", ".join(f"{k[:28]} {v:.2f}" for k, v in list(b["kernel_ms"].items())[:6])
                print(f"{label:34} span {b['span_ms']:.2f} busy {b['busy_ms']:.2f} | {top}")
            values = [f"{k.replace('_ms', '')} {r[k]:.3g}" for k in KEYS if isinstance(r.get(k), float)]
            values += [f"{k.replace('_tflops', '')} {v:.0f}" for k, v in r.items() if k.endswith("_tflops")]
            print(f"{label:34} " + "  ".join(values) + (f"  {r['error'][:80]}" if "error" in r else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
