"""When the host reaches each part of SFT's per-token forward through TRL's head (``bench.trl_head``),
in real time: no profiler, whose Python tracing slows the host several times over.

    python lab/sft_timeline.py --out DIR [--rows llama3] [--steps 20]

Wraps the package's functions named in WATCHED (module attributes, so every call goes through the
wrapper) with host timestamps, runs the flce-sft step back to back, and writes DIR/sft-timeline.json:
for each function, the median time of its first call after the kernel's entry (ms), and the step's
wall time. The GPU sits idle from TRL's gather (a sync) until the first sweep is launched.
"""

import argparse
import functools
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import ROWS, environment, load_flce, make_inputs, make_method  # noqa: E402

WATCHED = {
    "trl": ["fused_linear_log_probs"],
    "log_probs": ["_start_target_check", "token_forward", "_finish_target_check"],
    "_chunked": ["forward", "_new_results", "_rare_target_rows", "_factored_chunks"],
    "_triton_backend": ["targets_out_of_range", "order_rows", "take_out_flags", "row_reference", "new_buffer",
                        "factored_sweep", "factored_rows", "_sweep", "_launch_tiles", "mean_grad_ratio", "scale_"],
    "_ops": ["_token_backward"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default="llama3")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    flce, _ = load_flce()
    marks: list[tuple[str, float]] = []

    def watch(module, name):
        fn = getattr(module, name)

        @functools.wraps(fn)
        def wrapper(*a, **k):
            marks.append((name, time.perf_counter()))
            result = fn(*a, **k)
            marks.append((name + ":end", time.perf_counter()))
            return result

        setattr(module, name, wrapper)

    for module_name, names in WATCHED.items():
        module = importlib.import_module(f"{flce.__name__}.{module_name}")
        for name in names:
            watch(module, name)
    records = []
    for row in args.rows.split(","):
        hidden_size, vocab_size, n_tokens, dtype = ROWS[row]
        hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), "lm")
        h, w = hidden.requires_grad_(), weight.requires_grad_()
        fn = make_method("flce-sft", flce)
        steps = []
        for i in range(args.steps + 5):
            h.grad = w.grad = None
            marks.clear()
            start = time.perf_counter()
            fn(h, w, targets).backward()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
            if i >= 5:
                entry = next(t for n, t in marks if n == "fused_linear_log_probs")
                first = {}
                for n, t in marks:
                    first.setdefault(n, (t - entry) * 1e3)
                steps.append((wall * 1e3, (entry - start) * 1e3, first))
        names = list(steps[0][2])
        records.append({
            "row": row, "wall_ms": statistics.median(s[0] for s in steps),
            "entry_after_step_start_ms": statistics.median(s[1] for s in steps),
            "first_call_ms_after_entry": {n: statistics.median(s[2][n] for s in steps if n in s[2]) for n in names},
        })
        print(json.dumps(records[-1], indent=1), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft-timeline.json").write_text(json.dumps({"environment": environment(), "command": " ".join(sys.argv),
                                                       "records": records}, indent=1))


if __name__ == "__main__":
    main()
