"""Regenerates BENCHMARKS.md, the plots and README's headline table from the recorded JSON.

Every number in them comes from the files in benchmarks/results/ (bench.py's output); none
is typed by hand.

    python benchmarks/report.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "benchmarks" / "plots"
OURS = "fused-linear-ce"
PEERS = ["torch", "torch.compile", "liger", "cce", "cce-exact"]
MAIN_ROWS = ["gemma2", "llama3", "qwen25", "llama2"]
SCALING = {"llama3-n2048": 2048, "llama3": 8192, "llama3-n32768": 32768, "llama3-n65536": 65536}
README_MARK = "<!-- BENCHMARK-TABLE -->"
SUMMARY_MARK = "<!-- BENCHMARK-SUMMARY -->"


def load():
    """Latest result per (row, inputs, method) over the recorded runs, with its environment."""
    runs, latest = [], {}
    for path in sorted(RESULTS.glob("h200-*.json")):
        data = json.loads(path.read_text())
        runs.append((path.name, data))
        for r in data["results"]:
            latest[(r["row"], r["inputs"], r["method"])] = {**r, "_file": path.name,
                                                             "_matmul": data.get("matmul_tflops")}
    return runs, latest


def fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def best_peer(latest, row, inputs, key):
    values = [latest[(row, inputs, m)][key] for m in PEERS
              if (row, inputs, m) in latest and key in latest[(row, inputs, m)]]
    return min(values) if values else None


def logits_mib(r, element_size=2):
    return r["n_tokens"] * r["vocab_size"] * element_size / 2**20


ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def table(latest, rows, inputs):
    lines = ["| head (H, V), N | method | fwd ms | step ms | step peak MiB | peak − grads MiB | "
             "loss err | grad_h err | grad_w err |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        first = True
        for method in [OURS, *PEERS]:
            r = latest.get((row, inputs, method))
            if r is None:
                continue
            head = f"{row} ({r['hidden_size']}, {r['vocab_size']}), {r['n_tokens']}, {r['dtype']}" if first else ""
            first = False
            if "error" in r:
                lines.append(f"| {head} | {method} | {r['error'][:60]} | | | | | | |")
                continue
            name = f"**{method}**" if method == OURS else method
            lines.append(
                f"| {head} | {name} | {fmt(r['fwd_ms'], '.2f')} | {fmt(r['step_ms'], '.2f')} | "
                f"{fmt(r['step_peak_mib'], '.0f')} | {fmt(r['step_peak_minus_grads_mib'], '.0f')} | "
                f"{fmt(r.get('loss_err'), '.1e')} | {fmt(r.get('grad_hidden_err'), '.1e')} | "
                f"{fmt(r.get('grad_weight_err'), '.1e')} |")
    return "\n".join(lines)


def targets(latest, rows, inputs):
    """The performance issue's targets, row by row, from the same run's numbers."""
    lines = ["| row | step / fastest peer (≤ 0.90) | fastest peer fwd / fwd (≥ 1.10) | "
             "peak − grads / logits in the inputs' dtype (≤ 25%) | largest of loss, grad_h, grad_w error / "
             "PyTorch's (≤ 1) |", "|---|---|---|---|---|"]
    for row in rows:
        ours = latest.get((row, inputs, OURS))
        if ours is None or "error" in ours:
            continue
        step_peer = best_peer(latest, row, inputs, "step_ms")
        fwd_peer = best_peer(latest, row, inputs, "fwd_ms")
        step_ratio = ours["step_ms"] / step_peer if step_peer else None
        fwd_ratio = fwd_peer / ours["fwd_ms"] if fwd_peer else None
        mem_ratio = ours["step_peak_minus_grads_mib"] / logits_mib(ours, ELEMENT_SIZE[ours["dtype"]])
        torch_r = latest.get((row, inputs, "torch"), {})
        err_ratio = None
        if "loss_err" in ours and "loss_err" in torch_r:
            # a loss error below 1e-6 is fp32 rounding of the sum itself: counted as equal
            err_ratio = max(max(ours[k], 1e-6 if k == "loss_err" else 0) / max(torch_r[k], 1e-6 if k == "loss_err"
                                                                              else 1e-30)
                            for k in ("loss_err", "grad_hidden_err", "grad_weight_err"))

        def mark(ok):
            return "" if ok is None else (" ✓" if ok else " ✗")

        errs = "—" if err_ratio is None else f"{err_ratio:.3f}{mark(err_ratio <= 1.0)}"
        lines.append(
            f"| {row} | {fmt(step_ratio, '.2f')}{mark(step_ratio and step_ratio <= 0.9)} | "
            f"{fmt(fwd_ratio, '.2f')}{mark(fwd_ratio and fwd_ratio >= 1.1)} | "
            f"{mem_ratio:.0%}{mark(mem_ratio <= 0.25)} | {errs} |")
    return "\n".join(lines)


def plots(latest, inputs="lm"):
    PLOTS.mkdir(parents=True, exist_ok=True)
    made = []
    for key, ylabel, name in (("step_ms", "training step (ms)", "scaling_time.png"),
                              ("step_peak_minus_grads_mib", "peak extra memory of a step, less the gradients (MiB)",
                               "scaling_memory.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for method in [OURS, *PEERS]:
            pts = [(n, latest[(row, inputs, method)][key]) for row, n in SCALING.items()
                   if (row, inputs, method) in latest and key in latest[(row, inputs, method)]]
            if len(pts) >= 2:
                ax.plot(*zip(*pts, strict=True), marker="o", label=method, linewidth=2.5 if method == OURS else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N (Llama-3-8B head, H 4096, V 128256, bf16)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(PLOTS / name, dpi=110)
        plt.close(fig)
        made.append(name)
    return made


def environment(runs):
    lines = []
    for name, data in runs:
        env = data["environment"]
        v = env["versions"]
        lines.append(f"- `{name}`: {env['gpu']} ({env['sm_count']} SMs, driver {env['driver']}), "
                     f"torch {v['torch']}, triton {v['triton']}, liger-kernel {v.get('liger_kernel')}, "
                     f"cut-cross-entropy {v.get('cut_cross_entropy')}; {env['date']}; measured bf16 matmul "
                     f"{data['matmul_tflops']:.0f} TFLOP/s; `{env['command']}`")
    return "\n".join(lines)


def floor_ms(r):
    """The 6·N·V·H flops of a training step at the run's measured bf16 matmul rate."""
    return 6 * r["n_tokens"] * r["vocab_size"] * r["hidden_size"] / r["_matmul"] / 1e9


def floor_table(latest, rows, inputs="lm"):
    """How much of the measured matmul rate each step uses, and what the 0.9× target asks."""
    lines = ["| row | 6·NVH at the measured matmul rate, ms | fused-linear-ce step, ms (share of the rate) | "
             "fastest peer step, ms (share) | 0.9 × fastest peer, ms (share it needs) |", "|---|---|---|---|---|"]
    for row in rows:
        ours = latest.get((row, inputs, OURS))
        peer = best_peer(latest, row, inputs, "step_ms")
        if ours is None or "error" in ours or peer is None or not ours.get("_matmul"):
            continue
        floor = floor_ms(ours)
        lines.append(f"| {row} | {floor:.1f} | {ours['step_ms']:.1f} ({floor / ours['step_ms']:.0%}) | "
                     f"{peer:.1f} ({floor / peer:.0%}) | {0.9 * peer:.1f} ({floor / (0.9 * peer):.0%}) |")
    return "\n".join(lines)


def nccl_runs():
    return [(path.name, json.loads(path.read_text())) for path in sorted(RESULTS.glob("nccl-*.json"))]


def nccl_section(runs):
    """The vocabulary-parallel checks and throughput over NCCL (scripts/gpu-distributed)."""
    lines = []
    for name, data in runs:
        cases = [r for ranks in data["ranks"] for r in ranks]
        passed = sum(r["ok"] for r in cases)
        lines += [f"`{name}`: {data['gpus']} × {data['gpu']}, torch {data['torch']}, {data['backend']}, "
                  f"{data['date']}. Correctness checks of `tests/test_distributed.py` on every rank: "
                  f"{passed} of {len(cases)} passed.", ""]
        t = data.get("throughput")
        if t:
            lines += ["| head (H, V), N, dtype | chunks | all-reduces a step | unsharded step, one GPU, ms | "
                      "sharded step, one rank, ms | the all-reduces alone, ms | bound: unsharded / P + "
                      "all-reduces, ms | sharded / bound |", "|---|---|---|---|---|---|---|---|",
                      f"| ({t['head'][0]}, {t['head'][1]}), {t['n_tokens']}, {t['dtype']} | {t['chunks']} | "
                      f"{t['all_reduces_per_step']} | {t['unsharded_step_ms']:.2f} | {t['sharded_step_ms']:.2f} | "
                      f"{t['all_reduces_ms']:.2f} | {t['bound_ms']:.2f} | {t['ratio_to_bound']:.3f}"
                      f"{' ✓' if t['ok'] else ' ✗'} |", "", f"Timing: {t['timing']}."]
    return "\n".join(lines)


def _listing(values, spec, suffix=""):
    return ", ".join(f"{v:{spec}}{suffix} ({row})" for row, v in values.items() if v is not None)


def summary(latest):
    """README's paragraph on where the kernel stands, its numbers computed from the results."""
    def ratio(row, key, inputs="lm", peer_first=False):
        ours = latest.get((row, inputs, OURS), {}).get(key)
        peer = best_peer(latest, row, inputs, key)
        if ours is None or peer is None:
            return None
        return peer / ours if peer_first else ours / peer

    step = {row: ratio(row, "step_ms") for row in MAIN_ROWS}
    step_uniform = {row: ratio(row, "step_ms", "uniform") for row in MAIN_ROWS}
    fwd = {row: ratio(row, "fwd_ms", peer_first=True) for row in MAIN_ROWS}
    mem = [latest[(row, "lm", OURS)]["step_peak_minus_grads_mib"] / logits_mib(latest[(row, "lm", OURS)])
           for row in MAIN_ROWS if (row, "lm", OURS) in latest]
    flat = [latest[(row, "lm", OURS)]["step_peak_minus_grads_mib"] for row in SCALING if (row, "lm", OURS) in latest]
    compile_flat = [latest[(row, "lm", "torch.compile")]["step_peak_minus_grads_mib"] for row in SCALING
                    if (row, "lm", "torch.compile") in latest]
    fp32 = latest.get(("llama2-fp32", "lm", OURS))
    fp32_peer = latest.get(("llama2-fp32", "lm", "torch.compile"))
    mem_text = f"{min(mem):.0%}" if f"{min(mem):.0%}" == f"{max(mem):.0%}" else f"{min(mem):.0%}–{max(mem):.0%}"
    step_met = [r for r, v in step.items() if v is not None and v <= 0.9]
    fwd_met = [r for r, v in fwd.items() if v is not None and v >= 1.1]
    text = (
        f"Where it stands, from these runs: the extra memory of a training step is "
        f"{mem_text} of the bf16 logits at N = 8192 and stays flat with N "
        f"({min(flat):.0f}–{max(flat):.0f} MiB from N = 2048 to 65536 on the Llama-3 head, where "
        f"torch.compile's grows from {min(compile_flat):.0f} to {max(compile_flat):.0f} MiB); the loss and "
        f"gradient errors are at most plain PyTorch's. Against the fastest peer in the same run (torch.compile), "
        f"the training step takes {_listing(step, '.2f', '×')} of its time on LM-like inputs "
        f"({_listing(step_uniform, '.2f', '×')} on uniform ones), and the forward runs at "
        f"{_listing(fwd, '.2f', '×')} its speed.")
    if fp32 and fp32_peer:
        text += (f" In fp32 (Llama-2 head) the step takes {fp32['step_ms'] / fp32_peer['step_ms']:.2f}× and the "
                 f"forward runs at {fp32_peer['fwd_ms'] / fp32['fwd_ms']:.2f}× torch.compile's speed.")
    text += (f" The performance work's targets: a step at most 0.9× the fastest peer's is met on "
             f"{', '.join(step_met) or 'no row'}; a forward at least 1.1× faster on {', '.join(fwd_met) or 'no row'}.")
    llama = latest.get(("llama3", "lm", OURS))
    peer = best_peer(latest, "llama3", "lm", "step_ms")
    if llama and peer and llama.get("_matmul"):
        floor = floor_ms(llama)
        text += (f" For scale: at this GPU's measured bf16 matmul rate ({llama['_matmul']:.0f} TFLOP/s), the "
                 f"6·N·V·H flops of a Llama-3 step alone take {floor:.1f} ms; torch.compile's step runs at "
                 f"{floor / peer:.0%} of that rate and this kernel's at {floor / llama['step_ms']:.0%}, while 0.9× "
                 f"torch.compile's time asks for {floor / (0.9 * peer):.0%} over the whole step, softmax included "
                 f"(BENCHMARKS.md, \"Distance to the matmul floor\").")
    text += (" A step is three matrix products the size of the logits, as torch.compile's are: the logit product "
             "is a Triton kernel with the softmax in its epilogue, the two gradient products are cuBLAS's.")
    walls = [r["wall_s"] for (row, inputs, method), r in latest.items() if method == OURS and "wall_s" in r]
    if walls:
        text += (f"\n\nThe first call for a given (H, V, dtype, flags) in a process pays for Triton compilation and "
                 f"the autotuning of the logit kernel (three or four configurations); in these runs a method's whole "
                 f"measurement, first call and timing included, took {min(walls):.0f} to {max(walls):.0f} s. Later "
                 f"calls reuse the compiled kernels; a new N (batch or sequence length) does not retune.")
    return text


def replace_between(text, mark, body):
    start = text.index(mark)
    end = text.index(mark, start + 1) if text.count(mark) > 1 else start
    return text[:start] + mark + "\n" + body + "\n" + mark + text[end + len(mark):]


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if BENCHMARKS.md or README's tables differ from the JSON")
    args = parser.parse_args()
    runs, latest = load()
    present = {k[1] for k in latest}
    other_rows = sorted({k[0] for k in latest} - set(MAIN_ROWS) - set(SCALING))
    made = [name for name in ("scaling_time.png", "scaling_memory.png")] if args.check else plots(latest)
    parts = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`, which "
        "`benchmarks/bench.py` wrote on the GPU (`scripts/gpu-check bench`). Times are medians of "
        "`triton.testing.do_bench`; a step is forward + backward with gradients for hidden and weight; "
        "peak is the peak allocated memory of one step above what was allocated before it, and "
        "\"peak − grads\" subtracts the gradients' own bytes. Errors are relative to a float32 "
        "reference on the same inputs. \"lm\" inputs are a peaked, Zipf-skewed softmax with targets "
        "drawn from it (about 5 nats, 25% top-1); \"uniform\" are logits ~ N(0, 1). 10% of targets "
        "are ignored.",
        "",
        "## Runs",
        "",
        environment(runs),
    ]
    for inputs in ("lm", "uniform"):
        if inputs not in present:
            continue
        parts += ["", f"## Targets of the performance issue ({inputs} inputs)", "",
                  targets(latest, MAIN_ROWS + [r for r in other_rows if "slice" not in r], inputs),
                  "", f"## Main heads, N = 8192 ({inputs} inputs)", "", table(latest, MAIN_ROWS, inputs)]
    if any((row, "lm", OURS) in latest for row in SCALING if row != "llama3"):
        parts += ["", "## Scaling with N (Llama-3-8B head, lm inputs)", "", table(latest, list(SCALING), "lm"), ""]
        parts += [f"![{name}](benchmarks/plots/{name})" for name in made]
    if other_rows:
        parts += ["", "## Other rows (dtypes, one rank's vocabulary slice)", "", table(latest, other_rows, "lm")]
    parts += ["", "## Distance to the matmul floor (lm inputs)", "",
              "A training step does 6·N·V·H useful flops (logits, grad_hidden, grad_weight); at the bf16 matmul "
              "rate measured in the same run (an 8192³ product) they take the first column's time. The share "
              "in brackets is that time over the step's.", "", floor_table(latest, MAIN_ROWS)]
    nccl = nccl_runs()
    if nccl:
        parts += ["", "## Vocabulary parallelism over NCCL (`scripts/gpu-distributed`)", "", nccl_section(nccl)]
    benchmarks_md = "\n".join(parts) + "\n"

    # README: the headline table between the markers
    readme = (ROOT / "README.md").read_text()
    head = ["Training step (forward + backward) and evaluation forward on one H200, bf16, N = 8192, "
            "LM-like inputs; full tables, targets and plots in [BENCHMARKS.md](BENCHMARKS.md).", "",
            "| head (H, V) | fused-linear-ce step ms | fastest peer step ms | fused-linear-ce fwd ms | "
            "fastest peer fwd ms | extra memory of a step, MiB (ours / torch.compile) |",
            "|---|---|---|---|---|---|"]
    for row in MAIN_ROWS:
        r = latest.get((row, "lm", OURS))
        c = latest.get((row, "lm", "torch.compile"))
        if r is None or "error" in r:
            continue
        head.append(f"| {row} ({r['hidden_size']}, {r['vocab_size']}) | {r['step_ms']:.1f} | "
                    f"{fmt(best_peer(latest, row, 'lm', 'step_ms'))} | {r['fwd_ms']:.1f} | "
                    f"{fmt(best_peer(latest, row, 'lm', 'fwd_ms'))} | {r['step_peak_minus_grads_mib']:.0f} / "
                    f"{fmt(c and c.get('step_peak_minus_grads_mib'), '.0f')} |")
    readme = replace_between(readme, README_MARK, "\n".join(head))
    readme = replace_between(readme, SUMMARY_MARK, summary(latest))
    if args.check:
        stale = [name for name, text in (("BENCHMARKS.md", benchmarks_md), ("README.md", readme))
                 if (ROOT / name).read_text() != text]
        if stale:
            print("out of date with benchmarks/results (run python benchmarks/report.py):", ", ".join(stale))
            raise SystemExit(1)
        return
    (ROOT / "BENCHMARKS.md").write_text(benchmarks_md)
    (ROOT / "README.md").write_text(readme)


if __name__ == "__main__":
    main()
