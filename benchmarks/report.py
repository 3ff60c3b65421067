"""Regenerates BENCHMARKS.md, the plots and README's generated sections from the recorded JSON.

Every number in them comes from the files in benchmarks/results/ (the GPU runs of bench.py and
scripts/gpu-check, the CPU runs of cpu_bench.py) and from pyproject.toml; none is typed by
hand. Every method found in the JSON is shown, the peers in a known order first.

    python benchmarks/report.py [--check]
"""

import fnmatch
import json
from pathlib import Path

import matplotlib
import tomllib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "benchmarks" / "plots"
OURS = "fused-linear-ce"
BASE = "@base"  # bench.py --base: the same methods on an earlier build, in the same run
# Methods of bench.py in the order the tables show them; any other method found comes after.
KNOWN_METHODS = [OURS, "torch", "torch.compile", "quack", "quack-default", "liger-cute", "liger", "cce",
                 "cce-exact"]
MAIN_ROWS = ["gemma2", "llama3", "qwen25", "llama2"]
SCALING = {"llama3-n2048": 2048, "llama3-n4096": 4096, "llama3": 8192, "llama3-n32768": 32768,
           "llama3-n65536": 65536}
# The design targets the ratio tables mark: step time over the fastest peer's, the fastest peer's
# forward time over this kernel's.
STEP_TARGET, FORWARD_TARGET = 0.93, 1.05
# The Llama-3 head at other N, beside the main heads in the ratio tables (N = 2048 is no target).
SCALE_ROWS = ["llama3-n4096", "llama3-n32768", "llama3-n65536"]
README_MARK = "<!-- BENCHMARK-TABLE -->"
SUMMARY_MARK = "<!-- BENCHMARK-SUMMARY -->"
REQUIREMENTS_MARK = "<!-- REQUIREMENTS -->"


ARCHIVE = RESULTS / "archive.json"  # earlier runs still shown, one file: {"runs": [{"name": ..., "data": ...}]}


def recorded(pattern: str) -> list[tuple[str, dict]]:
    """(name, data) of every recorded run whose file name matches ``pattern`` (a glob), whether
    it is a file of benchmarks/results/ or a run of its archive, in the order of their names."""
    runs = {p.name: json.loads(p.read_text()) for p in RESULTS.glob(pattern) if p != ARCHIVE}
    if ARCHIVE.exists():
        runs.update((run["name"], run["data"]) for run in json.loads(ARCHIVE.read_text())["runs"]
                    if fnmatch.fnmatch(run["name"], pattern))
    return sorted(runs.items())


def load():
    """Latest result per (row, inputs, method) over the recorded runs (in the order of their
    dates), with its environment; a result without a step anatomy keeps the latest one traced
    (``_anatomy_file`` says from which run), and one without errors the latest errors measured
    (``_errors_file``: a run that changed no numerics, marked † in the tables). An
    ``anatomy-*.json`` run (bench.py with ``--anatomy-rows``, recorded for its traces alone) gives
    its anatomies to the latest results of its rows where it is newer, and none of its times."""
    runs, latest = [], {}
    for name, data in sorted(recorded("h200-*.json"), key=lambda item: item[1]["environment"]["date"]):
        runs.append((name, data))
        for r in data["results"]:
            if r["method"].endswith(BASE):  # an earlier build's (``before_after_section``)
                continue
            key = (r["row"], r["inputs"], r["method"])
            r = {**r, "_file": name, "_matmul": data.get("matmul_tflops")}
            if "anatomy" not in r and "anatomy" in latest.get(key, {}):
                r.update({k: latest[key][k] for k in ("anatomy", "_anatomy_file", "_anatomy_date")})
            elif "anatomy" in r:
                r.update(_anatomy_file=name, _anatomy_date=data["environment"]["date"])
            if "loss_err" not in r and "error" not in r and "loss_err" in latest.get(key, {}):
                r.update({k: latest[key][k] for k in ERROR_KEYS},
                         _errors_file=latest[key].get("_errors_file", latest[key]["_file"]))
            latest[key] = r
    for name, data in recorded("anatomy-*.json"):
        date = data["environment"]["date"]
        for r in data["results"]:
            key = (r["row"], r["inputs"], r["method"])
            if "anatomy" in r and key in latest and latest[key].get("_anatomy_date", "") < date:
                latest[key].update(anatomy=r["anatomy"], _anatomy_file=name, _anatomy_date=date)
    used = {r[k] for r in latest.values() for k in ("_file", "_anatomy_file", "_errors_file") if k in r}
    return [(name, data) for name, data in runs if name in used], latest


def no_ignored_rows(latest) -> list[str]:
    """The main heads' rows with every target counted (bench.py's "-no-ignored" rows) measured."""
    return [f"{row}-no-ignored" for row in MAIN_ROWS if (f"{row}-no-ignored", "lm", OURS) in latest]


def _scaling_span(latest) -> str:
    """'A to B': the smallest and largest N of the scaling rows measured for this kernel."""
    ns = [n for row, n in SCALING.items() if (row, "lm", OURS) in latest]
    return f"{min(ns)} to {max(ns)}" if ns else "—"


def fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def methods_in(latest):
    """Every method of the results: bench.py's in their order, then the others by name."""
    present = {method for (_, _, method) in latest}
    return [m for m in KNOWN_METHODS if m in present] + sorted(present - set(KNOWN_METHODS))


def fastest_peer(latest, row, inputs, key):
    """(name, value) of the peer with the smallest ``key`` on that row, or (None, None)."""
    found = [(latest[(row, inputs, m)][key], m) for m in methods_in(latest)
             if m != OURS and key in latest.get((row, inputs, m), {})]
    return (min(found)[1], min(found)[0]) if found else (None, None)


def best_peer(latest, row, inputs, key):
    return fastest_peer(latest, row, inputs, key)[1]


def error_cell(r):
    """A method's failure, whole (its first line), fit for a table cell."""
    return "fails: " + r["error"].strip().splitlines()[0].replace("|", "\\|")


ERROR_KEYS = ("loss_err", "grad_hidden_err", "grad_weight_err")


def carried(r) -> str:
    """† where ``r``'s errors come from an earlier run than its times."""
    return "†" if r.get("_errors_file") else ""


def carried_note(results) -> list[str]:
    """The line under a table that says where its † errors come from, if any are."""
    files = sorted({r["_errors_file"] for r in results if r.get("_errors_file")})
    if not files:
        return []
    return ["", f"† errors from {', '.join(f'`{f}`' for f in files)}: this run did not measure them, and on "
            "the heads it did measure they are the earlier run's to the last digit (the same numerics)."]


def error_ratio(latest, row, inputs):
    """The largest of the loss, grad_hidden and grad_weight errors relative to PyTorch eager's."""
    ours, torch_r = latest.get((row, inputs, OURS), {}), latest.get((row, inputs, "torch"), {})
    if "loss_err" not in ours or "loss_err" not in torch_r:
        return None
    # a loss error below 1e-6 is fp32 rounding of the sum itself: counted as equal
    return max(max(ours[k], 1e-6 if k == "loss_err" else 0) / max(torch_r[k], 1e-6 if k == "loss_err" else 1e-30)
               for k in ERROR_KEYS)


def logits_mib(r, element_size=2):
    return r["n_tokens"] * r["vocab_size"] * element_size / 2**20


ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def table(latest, rows, inputs):
    """The main table of ``rows``; with a "step J" column (the GPU's energy a step, from NVML) where
    any of its results recorded one."""
    energy = any(latest.get((row, inputs, m), {}).get("step_joules") is not None
                 for row in rows for m in methods_in(latest))
    extra = " step J |" if energy else ""
    lines = ["| head (H, V), N | method | fwd ms | step ms | step peak MiB | peak − grads MiB | "
             f"loss err | grad_h err | grad_w err |{extra}", "|---|---|---|---|---|---|---|---|---|" + "---|" * energy]
    for row in rows:
        first = True
        for method in methods_in(latest):
            r = latest.get((row, inputs, method))
            if r is None:
                continue
            head = f"{row} ({r['hidden_size']}, {r['vocab_size']}), {r['n_tokens']}, {r['dtype']}" if first else ""
            first = False
            if "error" in r:
                lines.append(f"| {head} | {method} | {error_cell(r)} | | | | | | |" + " |" * energy)
                continue
            name = f"**{method}**" if method == OURS else method
            joules = f" {fmt(r.get('step_joules'), '.2f')} |" if energy else ""
            lines.append(
                f"| {head} | {name} | {fmt(r['fwd_ms'], '.2f')} | {fmt(r['step_ms'], '.2f')} | "
                f"{fmt(r['step_peak_mib'], '.0f')} | {fmt(r['step_peak_minus_grads_mib'], '.0f')} | "
                f"{fmt(r.get('loss_err'), '.1e')}{carried(r)} | {fmt(r.get('grad_hidden_err'), '.1e')}{carried(r)} | "
                f"{fmt(r.get('grad_weight_err'), '.1e')}{carried(r)} |{joules}")
    shown = [latest[(row, inputs, m)] for row in rows for m in methods_in(latest) if (row, inputs, m) in latest]
    return "\n".join(lines + carried_note(shown))


RATIOS_TEXT = (
    "Each column divides two numbers of the same run, row by row: the training step's time by the fastest "
    "peer's step time (lower is better); the fastest peer's forward time by this kernel's forward time "
    "(higher is better); the extra memory of a step, less the gradients' own bytes, by the size of the "
    "logits in the inputs' dtype; the largest of the loss, grad_hidden and grad_weight errors (against the "
    "reference) by PyTorch eager's. The bound in each header is the design target; ✓ marks a row "
    "within it, ✗ one outside; a run of several laps (`bench.py --laps`) gives the laps' medians and "
    "the span of the step ratio lap by lap. The memory target holds at N = 8192; at other N its ratio stands unmarked "
    "(docs/design.md, \"Memory\", states the bound in N).")


def lap_ratios(latest, row, inputs) -> list[float]:
    """This kernel's step time over the fastest peer's, lap by lap (bench.py --laps: every method
    timed in each lap of the same run), or [] for a run of one lap."""
    ours = latest.get((row, inputs, OURS), {})
    laps = ours.get("step_ms_laps", [])
    if not laps:
        return []
    peers = [latest[(row, inputs, m)]["step_ms_laps"] for m in methods_in(latest) if m != OURS
             and latest.get((row, inputs, m), {}).get("_file") == ours.get("_file")
             and len(latest[(row, inputs, m)].get("step_ms_laps", [])) == len(laps)]
    return [t / min(p[i] for p in peers) for i, t in enumerate(laps)] if peers else []


def targets(latest, rows, inputs):
    """Ratios to the peers and to the logits' size, row by row, from the same run's numbers."""
    lines = [f"| row | step time / fastest peer's step time (target ≤ {STEP_TARGET:.2f}) | fastest peer's forward "
             f"time / forward time (target ≥ {FORWARD_TARGET:.2f}) | extra memory of a step less the gradients / "
             "logits in the inputs' dtype "
             "(target ≤ 25%) | largest error of loss, grad_hidden, grad_weight / PyTorch eager's (target ≤ 1) |",
             "|---|---|---|---|---|"]
    for row in rows:
        ours = latest.get((row, inputs, OURS))
        if ours is None or "error" in ours:
            continue
        step_peer = best_peer(latest, row, inputs, "step_ms")
        fwd_peer = best_peer(latest, row, inputs, "fwd_ms")
        step_ratio = ours["step_ms"] / step_peer if step_peer else None
        fwd_ratio = fwd_peer / ours["fwd_ms"] if fwd_peer else None
        mem_ratio = ours["step_peak_minus_grads_mib"] / logits_mib(ours, ELEMENT_SIZE[ours["dtype"]])
        err_ratio = error_ratio(latest, row, inputs)

        def mark(ok):
            return "" if ok is None else (" ✓" if ok else " ✗")

        errors_from = carried(ours) or carried(latest.get((row, inputs, "torch"), {}))
        errs = "—" if err_ratio is None else f"{err_ratio:.3f}{errors_from}{mark(err_ratio <= 1.0)}"
        laps = lap_ratios(latest, row, inputs)
        spread = f" (laps {_range(laps, '.3f')})" if laps else ""
        lines.append(
            f"| {row} | {fmt(step_ratio, '.3f')}{mark(step_ratio and step_ratio <= STEP_TARGET)}{spread} | "
            f"{fmt(fwd_ratio, '.3f')}{mark(fwd_ratio and fwd_ratio >= FORWARD_TARGET)} | "
            f"{mem_ratio:.0%}{mark(mem_ratio <= 0.25 if ours['n_tokens'] == 8192 else None)} | {errs} |")
    shown = [latest[(row, inputs, m)] for row in rows for m in (OURS, "torch") if (row, inputs, m) in latest]
    return "\n".join(lines + carried_note(shown))


def plots(latest, inputs="lm"):
    PLOTS.mkdir(parents=True, exist_ok=True)
    made = []
    for key, ylabel, name in (("step_ms", "training step (ms)", "scaling_time.png"),
                              ("step_peak_minus_grads_mib", "peak extra memory of a step, less the gradients (MiB)",
                               "scaling_memory.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for method in methods_in(latest):
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
        driver = ", ".join(dict.fromkeys(env["driver"].split()))  # nvidia-smi prints it once per GPU
        lines.append(f"- `{name}`: {env['gpu']} ({env['sm_count']} SMs, driver {driver}), "
                     f"torch {v['torch']}, triton {v['triton']}, liger-kernel {v.get('liger_kernel')}, "
                     f"cut-cross-entropy {v.get('cut_cross_entropy')}; {env['date']}; measured bf16 matmul "
                     f"{data['matmul_tflops']:.0f} TFLOP/s; `{env['command']}`{power_state(data)}")
    return "\n".join(lines)


def power_state(data) -> str:
    """The SM clock and power that nvidia-smi reported during the run's step timings, if recorded."""
    states = [r["step_gpu"] for r in data["results"] if r.get("step_gpu")]
    if not states:
        return ""
    clocks, power = [s["sm_clock_mhz"] for s in states], [s["power_w"] for s in states]
    reasons = sorted({x for s in states for x in s["throttle_reasons"]})
    return (f". During the step timings: SM clock {min(clocks):.0f}–{max(clocks):.0f} MHz (medians), "
            f"{min(power):.0f}–{max(power):.0f} W, throttle reasons {', '.join(reasons)} "
            "(0x4: the software power cap)")


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


# Kernel names of matrix products: this kernel's logit kernels (Triton's, and the Gluon sweep's on
# Hopper), cuBLAS's (nvjet, sm90 xmma/gemm) and Triton's (torch.compile's mm templates).
PRODUCT_KERNELS = ("_logit_tile_kernel", "tile_stats_kernel", "nvjet", "gemm", "xmma", "cutlass",
                   "triton_tem_fused_mm", "mm_")


def anatomy_table(latest, rows, inputs="lm"):
    """Per head, for each method traced (bench.py --anatomy-rows): the span of a step and its
    busy time, the matrix products' ms and TFLOP/s over the 6·n·V·H flops of the rows they
    compute, the other kernels' ms, and the largest kernels."""
    lines = ["| head, N | method | span ms | busy ms (share) | matrix products ms (TFLOP/s) | other kernels ms | "
             "largest kernels (ms a step) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        for method in methods_in(latest):
            r = latest.get((row, inputs, method), {})
            a = r.get("anatomy")
            if not a:
                continue
            kernels = a["kernel_ms"]
            products = sum(ms for name, ms in kernels.items() if any(k in name for k in PRODUCT_KERNELS))
            others = a["busy_ms"] - products
            # this kernel computes only the rows with a loss; torch.compile every row
            rows_computed = r["n_valid"] if method == OURS else r["n_tokens"]
            tflops = 6 * rows_computed * r["vocab_size"] * r["hidden_size"] / products / 1e9 if products else None
            largest = ", ".join(f"`{name[:32]}` {ms:.2f}" for name, ms in list(kernels.items())[:4])
            name = f"**{method}**" if method == OURS else method
            name += f" ({r['_anatomy_file']})"
            lines.append(f"| {row}, {r['n_tokens']} | {name} | {a['span_ms']:.2f} | {a['busy_ms']:.2f} "
                         f"({a['busy_ms'] / a['span_ms']:.0%}) | {products:.2f} ({fmt(tflops, '.0f')}) | "
                         f"{others:.2f} | {largest} |")
    return "\n".join(lines)


def nccl_runs():
    return recorded("nccl-*.json")


def nccl_section(runs):
    """The vocabulary-parallel checks and throughput over NCCL (scripts/gpu_distributed.py)."""
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


def _peer_names(latest, rows, inputs, key):
    """"torch.compile on every row", or the fastest peer of each row."""
    names = {row: fastest_peer(latest, row, inputs, key)[0] for row in rows}
    names = {row: name for row, name in names.items() if name is not None}
    if len(set(names.values())) == 1:
        return f"{next(iter(names.values()))} on every row"
    return ", ".join(f"{name} on {row}" for row, name in names.items())


def _range(values, spec=".0f"):
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}–{high}"


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
    scale_lm = {row: v for row in SCALE_ROWS if (v := ratio(row, "step_ms")) is not None}
    scale_uniform = {row: v for row in SCALE_ROWS if (v := ratio(row, "step_ms", "uniform")) is not None}
    scale_text = ""
    if scale_lm:
        scale_text = f", and on the Llama-3 head at other N {_listing(scale_lm, '.3f', '×')}"
        if scale_uniform:
            scale_text += f" ({_listing(scale_uniform, '.3f', '×')} on uniform inputs)"
    fwd = {row: ratio(row, "fwd_ms", peer_first=True) for row in MAIN_ROWS}
    mem = [latest[(row, "lm", OURS)]["step_peak_minus_grads_mib"] / logits_mib(latest[(row, "lm", OURS)])
           for row in MAIN_ROWS if (row, "lm", OURS) in latest]
    scaling_mem = {method: [latest[(row, "lm", method)]["step_peak_minus_grads_mib"] for row in SCALING
                            if "step_peak_minus_grads_mib" in latest.get((row, "lm", method), {})]
                   for method in methods_in(latest)}
    peers_mem = ", ".join(f"{method} {_range(values)}" for method, values in scaling_mem.items()
                          if method != OURS and len(values) > 1)
    errors = [e for e in (error_ratio(latest, row, inputs) for row in MAIN_ROWS for inputs in ("lm", "uniform"))
              if e is not None]
    text = (
        f"Where it stands, from these runs. **Memory:** a training step's extra memory is {_range(mem, '.0%')} "
        f"of the bf16 logits at N = 8192 and bounded in N ({_range(scaling_mem[OURS])} MiB from N = "
        f"{_scaling_span(latest)} on the Llama-3 head; over the same range: {peers_mem} MiB). **Errors:** the "
        f"largest of the loss and gradient errors is {_range(errors, '.2f')}× plain PyTorch's (bf16, both kinds "
        f"of inputs, against float64). **Time:** against the fastest peer in the same run "
        f"({_peer_names(latest, MAIN_ROWS, 'lm', 'step_ms')}), the training step takes "
        f"{_listing(step, '.3f', '×')} of its time on LM-like inputs ({_listing(step_uniform, '.3f', '×')} on "
        f"uniform ones){scale_text}; against the fastest forward "
        f"({_peer_names(latest, MAIN_ROWS, 'lm', 'fwd_ms')}), the forward runs at {_listing(fwd, '.2f', '×')} "
        f"its speed. These are one run's ratios on a card at its power cap.")
    every_target = no_ignored_rows(latest)
    if every_target:
        step_all = {row: ratio(row, "step_ms") for row in every_target}
        fwd_all = {row: ratio(row, "fwd_ms", peer_first=True) for row in every_target}
        text += (f" With every target counted (no ignored rows; BENCHMARKS.md, \"Every target counted\"), where "
                 f"the peers do no more work than this kernel, the step takes {_listing(step_all, '.3f', '×')} of the "
                 f"fastest peer's time ({_peer_names(latest, every_target, 'lm', 'step_ms')}) and the forward runs "
                 f"at {_listing(fwd_all, '.2f', '×')} the fastest forward's speed: the lead above is mostly the "
                 f"skipped rows.")
    cold = cold_start_sentence()
    if cold:
        text += "\n\n" + cold
    before_after = before_after_sentence()
    if before_after:
        text += "\n\n" + before_after
    return text


def before_after_runs():
    """[(file, data)] of the newest run that timed an earlier build beside this one (``bench.py --base``):
    an ``h200-*.json`` run with every peer, or a ``before-after-*.json`` run of the two builds (and
    perhaps torch.compile) alone. A ``trl-h*-*.json`` run with a base times one change for design.md's
    record, not the build against the one the README compares it with."""
    runs = recorded("h200-*.json") + recorded("before-after-*.json")
    return sorted([(name, data) for name, data in runs if "base" in data],
                  key=lambda item: item[1]["environment"]["date"])[-1:]


def _before_after(data):
    """Per (row, inputs) of one run: the earlier build's and this one's step and forward times
    (the medians of their laps) and step memory less the gradients. Within a run a peer's time
    is the same for both, so a change of time is the change of the ratio to any peer."""
    results = {(r["row"], r["inputs"], r["method"]): r for r in data["results"] if "error" not in r}
    out = []
    for (row, inputs, name), before in results.items():
        if not name.endswith(BASE):
            continue
        method = name.removesuffix(BASE)
        after = results.get((row, inputs, method))
        if after is None:
            continue
        laps = [*after.get("step_ms_laps", []), *before.get("step_ms_laps", [])]
        spread = max(laps) / min(laps) - 1 if laps else 0.0
        out.append(dict(row=row, inputs=inputs, method=method, laps=len(after.get("step_ms_laps", [after["step_ms"]])),
                        spread=spread,
                        step=(before["step_ms"], after["step_ms"]), fwd=(before["fwd_ms"], after["fwd_ms"]),
                        mib=(before["step_peak_minus_grads_mib"], after["step_peak_minus_grads_mib"])))
    return out


def before_after_section(runs) -> str:
    """The step and forward times of an earlier build and this one, run by run."""
    lines = []
    for name, data in runs:
        base = data["base"]
        peers = sorted({r["method"] for r in data["results"] if not r["method"].startswith((OURS, "flce-"))})
        lines += [f"`{name}` ({data['environment']['gpu']}, {data['environment']['date'][:10]}): this build against "
                  f"{base.get('revision') or base['root']} "
                  f"(peers in the run: {', '.join(peers) or 'none'}).", "",
                  "| row | method | laps | step ms: before → after | laps' spread | forward ms: before → after | "
                  "step's extra memory less the gradients, MiB: before → after |", "|---|---|---|---|---|---|---|"]
        for e in _before_after(data):
            (sb, sa), (fb, fa), (mb, ma) = e["step"], e["fwd"], e["mib"]
            lines.append(f"| {e['row']} ({e['inputs']}) | {e['method']} | {e['laps']} | {sb:.2f} → {sa:.2f} "
                         f"({sa / sb - 1:+.1%}) | {e['spread']:.0%} | "
                         f"{fb:.2f} → {fa:.2f} ({fa / fb - 1:+.1%}) | {mb:.0f} → {ma:.0f} |")
        lines.append("")
    return "\n".join(lines).rstrip()


TRAINER_NAMES = {"sft": "SFT's", "grpo": "GRPO's", "grpo-coef0": "GRPO's at entropy coefficient 0", "dpo": "DPO's",
                 "kto": "KTO's", "rloo": "RLOO's", "dft": "DFT's"}


def _method_label(method: str) -> str:
    """A bench.py method in words, for the README's before/after sentence."""
    if method in (OURS, f"{OURS}-metrics"):
        return "the loss" + (" with its metrics" if method.endswith("-metrics") else "")
    kind = method.removeprefix("flce-").removesuffix("-keep0")
    return f"{TRAINER_NAMES.get(kind, kind)} head" + (" at FLCE_KEEP_MIB=0" if method.endswith("-keep0") else "")


def before_after_sentence() -> str:
    """README's sentence on the latest before/after run, its numbers from the JSON: the methods whose path the
    change kept, then those it gave kept rows (their time and memory), each group's methods named."""
    runs = before_after_runs()
    if not runs:
        return ""
    name, data = runs[-1]
    changes = _before_after(data)
    if not changes:
        return ""
    kept = [e for e in changes if e["method"].removeprefix("flce-") in TOKEN_KINDS]  # given kept rows
    same = [e for e in changes if e not in kept]

    def span(values, spec="+.1%"):
        low, high = f"{min(values):{spec}}", f"{max(values):{spec}}"
        return low if low == high else f"{low} to {high}"

    def named(group):
        return _listed(list(dict.fromkeys(_method_label(e["method"]) for e in group)))

    text = (f"This build was timed against an earlier one "
            f"({data['base'].get('revision') or data['base']['root']}) in the same process on one "
            f"{data['environment']['gpu'].removeprefix('NVIDIA ')} (`{name}`, {changes[0]['laps']} alternating laps, "
            f"{len(changes)} rows and methods; one method's laps spread by "
            f"{span([e['spread'] for e in changes], '.0%')})")
    if same:
        text += (f": for {named(same)} the step's median time changed by "
                 f"{span([e['step'][1] / e['step'][0] - 1 for e in same])} and a step's memory by "
                 f"{span([round(e['mib'][1] - e['mib'][0]) for e in same], '+d')} MiB")
    if kept:
        text += (f"{';' if same else ':'} {named(kept)}, which now keep rows, "
                 f"{span([e['step'][1] / e['step'][0] - 1 for e in kept])} in time at "
                 f"{span([round(e['mib'][1] - e['mib'][0]) for e in kept], '+d')} MiB")
    return text + " (BENCHMARKS.md, \"Before and after\")."


COLD_CALLS = {"loss": "the loss", "metrics": "the loss with its metrics", "sft": "SFT's per-token outputs"}


def cold_start_sentence() -> str:
    """The first training calls of ``benchmarks/cold_start.py`` (a fresh process, an empty Triton cache)
    from the newest ``cold-start-*.json`` (of a before/after, its ``shipped`` side, each lap), beside the
    lazy call (each kernel compiled at its launch) of the newest run that timed it; empty where none does."""
    runs = recorded("cold-start-*.json")
    lazy_runs = [(name, data) for name, data in runs if any(r["call"] == "loss-lazy" for r in data["records"])]
    if not lazy_runs:
        return ""
    name, data = max(runs, key=lambda item: item[1]["environment"]["date"])
    records = [r for r in data["records"] if r.get("side", data.get("shipped")) == data.get("shipped")]
    first = {}
    for r in records:
        first.setdefault(r["call"], []).append(r["first_call_s"])

    def seconds(values):
        low, high = min(values), max(values)
        return f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}–{high:.1f}"

    calls = ", ".join(f"{seconds(first[c])} s for {label}" for c, label in COLD_CALLS.items() if c in first)
    laps = f" in {len(first['loss'])} laps" if len(first.get("loss", ())) > 1 else ""
    lazy_name, lazy = max(lazy_runs, key=lambda item: item[1]["environment"]["date"])
    lazy_s = next(r["first_call_s"] for r in lazy["records"] if r["call"] == "loss-lazy")
    return (f"A process's first call of each kind compiles its Triton kernels. On sm_90 with Triton 3.6 they are "
            f"compiled in parallel, in forked children, from the specialisations recorded there, and the logit "
            f"kernel takes its shipped configuration: a first Llama-3 training call with an empty Triton cache "
            f"took {calls}{laps} on an {data['environment']['gpu'].removeprefix('NVIDIA ')} (`{name}`), against "
            f"{lazy_s:.1f} s for the loss with each kernel compiled at its launch (`{lazy_name}`). Elsewhere the "
            f"kernels compile at their launches and the logit kernel is autotuned "
            f"(two to five configurations) at its first call for a given (H, V, dtype, flags). Later calls reuse "
            f"the compiled kernels; a new N (batch or sequence length) does not retune.")


def readme_table(latest):
    """README's comparison with every method: step time and memory (BENCHMARKS.md has the forward's)."""
    methods = methods_in(latest)
    rows = [row for row in MAIN_ROWS if "step_ms" in latest.get((row, "lm", OURS), {})]

    def header(first):
        names = [f"**{m}**" if m == OURS else m for m in methods]
        return [f"| {first} | " + " | ".join(names) + " |", "|---" * (len(methods) + 1) + "|"]

    def cell(row, method, text):
        r = latest.get((row, "lm", method))
        if r is None:
            return "—"
        value = "fails" if "error" in r else text(r)
        return f"**{value}**" if method == OURS else value

    def head(row):
        r = latest[(row, "lm", OURS)]
        return f"{row} ({r['hidden_size']}, {r['vocab_size']})"

    lines = ["Measured on one H200, bf16, N = 8192 tokens, LM-like inputs (BENCHMARKS.md has uniform inputs, errors, "
             "fp16 and fp32, scaling with N and plots). A training step is forward + backward with gradients for "
             "hidden and weight; its extra memory is the peak allocated during the step above what was allocated "
             "before it, less the gradients' own bytes. Training step: time, and extra memory.", "",
             *header("head (H, V)")]
    for row in rows:
        lines.append(f"| {head(row)} | " + " | ".join(
            cell(row, m, lambda r: f"{fmt(r.get('step_ms'))} ms, {fmt(r.get('step_peak_minus_grads_mib'), '.0f')} MiB")
            for m in methods) + " |")
    return "\n".join(lines)


TRL_MARK = "<!-- TRL-TABLE -->"
# bench.py's methods for TRL's fused LM head (trl-*: TRL 1.16's own kernel; flce-*: this kernel's, as
# flce.trl.use_in_trl() installs it) and this kernel's loss with its metrics, in trl-h200-*.json runs.
TRL_HEADS = ["gemma2", "llama3", "qwen25"]
HEAD_NAMES = {"gemma2": "Gemma-2", "llama3": "Llama-3", "qwen25": "Qwen-2.5"}
TRL_TARGETS = {"sft": 0.72, "grpo": 0.8, "metrics": 0.03, "entropy_grad": 0.08}


def trl_runs():
    """The TRL rows of bench.py on any GPU (``trl-h200-*.json``, ``trl-h100-*.json``); the TRL table pairs
    the H200's alone, the kept rows' section takes the newest run and names its GPU."""
    return recorded("trl-h*-*.json")


def _on_h200(runs):
    return [(name, data) for name, data in runs if data["environment"]["gpu"] == "NVIDIA H200"]


def trl_step_sentence() -> str:
    """The SFTTrainer step of ``scripts/trl_gpu.py`` (a 2-layer Llama-3-shaped model) with TRL's head
    and with this kernel's, from the newest ``trl-gpu-*.json``; empty where none is recorded."""
    runs = recorded("trl-gpu-*.json")
    runs = [(name, data) for name, data in runs if "sft_step" in data and data.get("gpu") != "cpu-smoke"]
    if not runs:
        return ""
    name, data = max(runs, key=lambda item: item[1]["date"])
    step = data["sft_step"]
    model, laps = step["model"], step.get("laps", 1)
    return (f"A user's step: one SFTTrainer step on a {model['num_hidden_layers']}-layer Llama-3-shaped model "
            f"(one {data['gpu'].removeprefix('NVIDIA ')}, V = {model['vocab_size']}, H = {model['hidden_size']}, bf16, "
            f"{step['batch']} × {step['seq_len']} "
            f"tokens, {step['ignored_label_fraction']:.0%} of the labels -100; the median of "
            f"{laps * step['timed_steps']} steps{' in alternating laps' if laps > 1 else ''}; `{name}`) takes "
            f"{step['flce']['ms']:.1f} ms and {step['flce']['peak_mib']:.0f} MiB with this kernel under "
            f"`use_in_trl()`, against {step['trl']['ms']:.1f} ms and {step['trl']['peak_mib']:.0f} MiB with TRL's "
            f"own head: {step['ratio_ms']:.3f}× the time (target ≤ 0.9), {step['ratio_mib']:.2f}× the memory.")


def grpo_zero_sentence() -> str:
    """GRPO at entropy_coef 0 with a share of its sequences at advantage 0, with both kernels, from
    the newest ``grpo-zero-advantages-*.json``; empty where none is recorded."""
    runs = recorded("grpo-zero-advantages-*.json")
    if not runs:
        return ""
    name, data = max(runs, key=lambda item: item[1]["environment"]["date"])
    results = {(r["row"], r["method"]): r for r in data["results"] if "step_ms" in r}
    cells = []
    for row in dict.fromkeys(r for r, _ in results):
        ours, theirs = results.get((row, "flce-grpo-coef0")), results.get((row, "trl-grpo-coef0"))
        if ours and theirs:
            cells.append(f"{row} {ours['step_ms']:.1f} against {theirs['step_ms']:.1f} ms "
                         f"({ours['step_ms'] / theirs['step_ms']:.3f}×)")
    share = next(r["zero_advantage_share"] for r in data["results"] if "zero_advantage_share" in r)
    return (f"GRPO's tokens whose upstream gradient is 0 (advantage 0, in groups whose rewards were all equal, "
            f"at GRPO's default entropy_coef 0) are left out of the recomputing backward: with {share:.0%} of the "
            f"sequences at advantage 0, GRPO's step takes {'; '.join(cells)} with TRL's kernel (`{name}`).")


def trl_section(runs) -> str:
    """One row a head and share of ignored rows: the loss alone and with its metrics (their cost,
    target <= 3%), SFT's outputs and GRPO's (log-probs and entropy with gradients, temperature 0.7)
    through TRL's head with this kernel against TRL's own (step time ratio, targets 0.72 and 0.8),
    SFT's peak memory (target <= 0.5) and what the entropy's gradient adds to GRPO's step with each
    kernel (target <= 8%). Each pair of numbers comes from one run: the newest that
    measured both on that row."""
    runs = _on_h200(runs)
    if not runs:
        return "No TRL run recorded."
    found = _steps_by_date(runs)
    used = set()

    def pair(row, first, second):
        for name, results in reversed(found):
            if (row, first) in results and (row, second) in results:
                used.add(name)
                return results[(row, first)], results[(row, second)]
        return None, None

    lines = ["One H200, bf16, LM-like inputs, N = 8192 tokens, step ms (forward + backward) and peak MiB "
             "(gradients included). TRL's head gathers the rows with a label before its kernel, as "
             "`add_fused_lm_head` does; \"ours\" is `flce.trl.use_in_trl()`'s kernel in that head. Each pair of "
             "numbers is from one run.", "",
             "| head, ignored | loss | loss + metrics (cost) | SFT's outputs: ours / TRL | ratio | memory ratio "
             "| TRL's head, no kernel | GRPO's outputs: ours / TRL | ratio | entropy's gradient: ours / TRL |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rows = [f"{h}{suffix}" for suffix in ("", "-masked") for h in TRL_HEADS]
    for row in rows:
        loss, metrics = pair(row, "fused-linear-ce", "fused-linear-ce-metrics")
        if loss is None:
            continue
        ignored = "50%" if row.endswith("-masked") else "10%"
        cost = metrics["step_ms"] / loss["step_ms"] - 1
        cells = [f"{row.split('-')[0]}, {ignored}", f"{loss['step_ms']:.1f}",
                 f"{metrics['step_ms']:.1f} ({cost:+.1%}){'' if cost <= TRL_TARGETS['metrics'] else ' ✗'}"]
        for trainer in ("sft", "grpo"):
            ours, theirs = pair(row, f"flce-{trainer}", f"trl-{trainer}")
            if ours is None:
                cells += ["—", "—"] + (["—", "—"] if trainer == "sft" else [])
                continue
            ratio = ours["step_ms"] / theirs["step_ms"]
            cells += [f"{ours['step_ms']:.1f} / {theirs['step_ms']:.1f}",
                      f"{ratio:.3f}{'' if ratio <= TRL_TARGETS[trainer] else ' ✗'}"]
            if trainer == "sft":
                memory = ours["step_peak_mib"] / theirs["step_peak_mib"]
                cells.append(f"{ours['step_peak_mib']:.0f} / {theirs['step_peak_mib']:.0f} = {memory:.2f}"
                             f"{'' if memory <= 0.5 else ' ✗'}")
                glue, _ = pair(row, "trl-glue", "trl-sft")
                cells.append("—" if glue is None else f"{glue['step_ms']:.1f}")
        costs = []
        for kernel in ("flce", "trl"):
            bonus, logged = pair(row, f"{kernel}-grpo", f"{kernel}-grpo-coef0")
            costs.append(None if bonus is None else bonus["step_ms"] / logged["step_ms"] - 1)
        if None in costs:
            cells.append("—")
        else:
            mark = "" if costs[0] <= TRL_TARGETS["entropy_grad"] else " ✗"
            cells.append(f"{costs[0]:+.1%}{mark} / {costs[1]:+.1%}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "✗: over the target (SFT's step at most 0.72× TRL's time and 0.5× its memory, GRPO's at most "
              "0.8×, metrics at most 3% of the loss's step). TRL's head, no kernel: the step of TRL's head around a "
              "kernel that does no work (`trl-glue`), its gather, scatters, loss and backward, which both SFT steps "
              "include. Entropy's gradient: GRPO's step with an entropy bonus (coefficient 0.01) against the same "
              "step at GRPO's default coefficient 0 (the entropy logged, `*-grpo-coef0`; target at most 8%). "
              "GRPO's per-token gradients are known only in the "
              "backward, which therefore recomputes the logits, as TRL's kernel does: 8·N·V·H flops against "
              "SFT's 6 (docs/design.md). Runs: " + ", ".join(f"`{name}`" for name, _ in found if name in used) + "."]
    extra = [sentence for sentence in (grpo_zero_sentence(), trl_step_sentence(), grpo_step_sentence()) if sentence]
    return "\n".join(lines + [line for sentence in extra for line in ("", sentence)])


# Distillation rows of bench.py (``distill-t{teacher}-b{beta}``, ``sparse-*``), in distill-h200-*.json runs.
DISTILL_PEERS = ["trl-distill", "liger-jsd", "torch.compile-jsd"]
DISTILL_TARGETS = {1.0: (0.6, 0.9), 0.0: (0.6, 0.9), 0.5: (0.7, 1.0)}  # beta: (of TRL's time, of the fastest peer's)
SPARSE_TARGET = 1.15  # K = 100's step over our loss-only step at the same shape
SPARSE_MEMORY_TARGET = 1.05  # and its peak over that step's


def _latest_run(pattern: str):
    runs = recorded(pattern)
    return max(runs, key=lambda item: item[1]["environment"]["date"]) if runs else (None, None)


def distillation_section() -> str:
    """The student/teacher divergence against TRL's kernel, Liger's fused JSD and torch.compile of the
    plain JSD (step ms / peak MiB, ratios, gradient errors), and the sparse top-k losses against our own
    loss step and torch.compile of TRL's loss on the logits, from the newest ``distill-h200-*.json``."""
    results, names, data = _distill_results()
    if not results:
        return "No distillation run recorded."
    lines = ["Student: the Llama-3 head (4096, 128256), N = 8192, bf16, random heads; gradients to the student "
             "only. Step ms (forward + backward, `do_bench` median) / peak MiB (gradients included); ✗ marks a "
             "target missed (forward and reverse KL at most 0.6× TRL's time and 0.9× the fastest peer's, β = 0.5 "
             "at most 0.7× and 1×, memory at most 0.5× TRL's).", "",
             "| teacher hidden, β | ours | TRL | Liger | torch.compile | ours / TRL | ours / fastest peer "
             "| memory / TRL | grad_weight err: ours / TRL |", "|---|---|---|---|---|---|---|---|---|"]
    ours_of = {row: r for (row, method), r in results.items() if method == "flce-distill"}
    rows = sorted(ours_of, key=lambda row: (ours_of[row]["teacher_hidden_size"], -ours_of[row]["beta"]))
    for row in rows:
        ours = results.get((row, "flce-distill"))
        if ours is None:
            continue
        peers = {m: results[(row, m)] for m in DISTILL_PEERS if (row, m) in results}
        cell = lambda r: f"{r['step_ms']:.1f} / {r['step_peak_mib']:.0f}"  # noqa: E731
        of_trl, of_peer = DISTILL_TARGETS[ours["beta"]]
        trl = peers.get("trl-distill")
        fastest = min(r["step_ms"] for r in peers.values()) if peers else None
        ratio_trl = ours["step_ms"] / trl["step_ms"] if trl else None
        ratio_peer = ours["step_ms"] / fastest if fastest else None
        memory = ours["step_peak_mib"] / trl["step_peak_mib"] if trl else None
        mark = lambda ok: "" if ok else " ✗"  # noqa: E731
        lines.append("| " + " | ".join([
            f"{ours['teacher_hidden_size']}, {ours['beta']:g}", cell(ours),
            *(cell(peers[m]) if m in peers else "—" for m in DISTILL_PEERS),
            "—" if ratio_trl is None else f"{ratio_trl:.3f}{mark(ratio_trl <= of_trl)}",
            "—" if ratio_peer is None else f"{ratio_peer:.3f}{mark(ratio_peer <= of_peer)}",
            "—" if memory is None else f"{memory:.2f}{mark(memory <= 0.5)}",
            f"{ours['grad_weight_err']:.1e} / {trl['grad_weight_err']:.1e}" if trl else "—"]) + " |")
    sparse = sorted({row for row, _ in results if row.startswith("sparse-")})
    if sparse:
        lines += ["", "Sparse teacher targets (`fused_linear_sparse_kl` with the tail bucket at K = 20 and 100, "
                  "`fused_linear_top1_divergence`), LM-like inputs, N = 8192 on the Llama-3 head: step ms / peak MiB, "
                  f"against our loss-only step at the same shape in the same run (targets for K = 100: at most "
                  f"{SPARSE_TARGET}× its time, {SPARSE_MEMORY_TARGET}× its memory) and "
                  "torch.compile of TRL's loss on the materialised logits.", "",
                  "| row | ours | our loss step | over the loss: time, memory | torch.compile, TRL's loss |",
                  "|---|---|---|---|---|"]
        for row in sparse:
            ours, loss, peer = (results.get((row, m)) for m in ("flce-sparse", "fused-linear-ce",
                                                                "torch.compile-trl-sparse"))
            if ours is None or loss is None:
                continue
            over, memory = ours["step_ms"] / loss["step_ms"], ours["step_peak_mib"] / loss["step_peak_mib"]
            mark = " ✗" if row == "sparse-k100" and over > SPARSE_TARGET else ""
            memory_mark = " ✗" if row == "sparse-k100" and memory > SPARSE_MEMORY_TARGET else ""
            lines.append(f"| {row} | {ours['step_ms']:.1f} / {ours['step_peak_mib']:.0f} | {loss['step_ms']:.1f} / "
                         f"{loss['step_peak_mib']:.0f} | {over:.2f}×{mark}, {memory:.3f}×{memory_mark} | "
                         + ("—" if peer is None else f"{peer['step_ms']:.1f} / {peer['step_peak_mib']:.0f}") + " |")
    lines += ["", "Runs: " + ", ".join(f"`{name}` ({run['environment']['gpu']}, {run['environment']['date'][:10]}, "
                                        f"bf16 matmul at "
                                        f"{run.get('matmul_tflops', 0):.0f} TFLOP/s)" for name, run in data) + "; "
              "each row's methods from the newest run that timed it; every ratio is within one run."]
    step = distill_step_sentence()
    return "\n".join(lines + (["", step] if step else []))


def _gpu_of(name: str) -> str:
    """The GPU of a recorded run, as nvidia-smi names it, less the vendor."""
    return dict(recorded(name))[name]["environment"]["gpu"].removeprefix("NVIDIA ")


def _distill_results():
    """{(row, method): result} of the distillation runs, each row from the newest run that has it,
    with the names and data of the runs used."""
    runs = sorted(recorded("distill-*.json"), key=lambda item: item[1]["environment"]["date"])
    results, used = {}, {}
    for name, data in runs:
        rows = {r["row"] for r in data["results"] if "step_ms" in r and r["method"] != "fused-linear-ce"}
        for r in data["results"]:
            if "step_ms" in r and r["row"] in rows:
                results[(r["row"], r["method"])] = {**r, "_file": name}
    for r in results.values():
        used[r["_file"]] = True
    return results, list(used), [(name, data) for name, data in runs if name in used]


# The per-token trainers of bench.py (KEPT_METHODS): TRL's kernel, ours with kept rows, ours with none.
TOKEN_KINDS = ["grpo", "grpo-coef0", "dpo", "kto", "rloo", "dft"]
TOKEN_TARGET = 0.8


def _steps_by_date(runs) -> list[tuple[str, dict]]:
    """[(name, {(row, method): result})] of ``runs``' timed steps, oldest run first."""
    return [(name, {(r["row"], r["method"]): r for r in data["results"] if "step_ms" in r})
            for name, data in sorted(runs, key=lambda item: item[1]["environment"]["date"])]


def _kept_rows(runs) -> dict:
    """{(row, trainer): (run name, TRL's result, ours with kept rows, ours at FLCE_KEEP_MIB=0 or None)}: for
    each head and trainer the newest run that timed the kept rows (its ``*-keep0`` methods) with TRL's kernel
    beside them, so that a later run of some rows (a rerun with less noise, say) replaces those rows alone.
    A row's times are always of one run."""
    found = {}
    for name, results in _steps_by_date(runs):
        if not any(m.endswith("-keep0") for _, m in results):
            continue
        for row in sorted({row for row, _ in results}):
            for kind in TOKEN_KINDS:
                trl, kept = results.get((row, f"trl-{kind}")), results.get((row, f"flce-{kind}"))
                if trl is not None and kept is not None:
                    found[row, kind] = (name, trl, kept, results.get((row, f"flce-{kind}-keep0")))
    return found


def _kept_prediction(kept, none) -> tuple[float | None, float | None]:
    """(share of the rows with a target that the budget kept, the step time that share predicts: the
    step with none kept scaled by (6 kept + 8 recomputed) / 8), None where the run lacks either."""
    share = kept.get("kept_rows")
    share = None if share is None else share / kept["n_valid"]
    predicted = None if share is None or none is None else none["step_ms"] * (6 * share + 8 * (1 - share)) / 8
    return share, predicted


def token_trainers_section(runs) -> str:
    """Per head and trainer: TRL's head with TRL's kernel, with ours (kept rows at the default budget) and
    with ours at FLCE_KEEP_MIB=0; step ms, ratio to TRL's and peak MiB, from the newest run that has them
    (``_kept_rows``). Where the run recorded the rows kept (``kept_rows``), the time that share predicts."""
    found = _kept_rows(runs)
    if not found:
        return ""
    names = sorted({name for name, *_ in found.values()})
    gpus = sorted({_gpu_of(name) for name in names})
    lines = [f"One {' and one '.join(gpus)}, bf16, N = 8192 tokens, LM-like inputs; step ms (forward + backward) and "
             "peak MiB.", "",
             "| head, ignored | trainer | TRL's kernel | ours, kept rows | ratio | ours, none kept (`FLCE_KEEP_MIB=0`) "
             "| ratio | rows kept | predicted ms (measured / predicted) | peak MiB: kept / none / TRL | run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in [f"{h}{suffix}" for suffix in ("", "-masked") for h in TRL_HEADS]:
        for kind in TOKEN_KINDS:
            if (row, kind) not in found:
                continue
            name, trl, kept, none = found[row, kind]
            ratio = kept["step_ms"] / trl["step_ms"]
            share, predicted = _kept_prediction(kept, none)
            # where the budget holds only part of the rows, the target is the time that share predicts
            partial = predicted is not None and share < 1
            missed = kept["step_ms"] > 1.05 * predicted if partial else ratio > TOKEN_TARGET
            cells = [f"{row.split('-')[0]}, {'50%' if row.endswith('-masked') else '10%'}", kind,
                     f"{trl['step_ms']:.1f}", f"{kept['step_ms']:.1f}",
                     f"{ratio:.3f}{' ✗' if missed and not partial else ''}",
                     "—" if none is None else f"{none['step_ms']:.1f}",
                     "—" if none is None else f"{none['step_ms'] / trl['step_ms']:.3f}",
                     "—" if share is None else f"{share:.0%}",
                     "—" if predicted is None else
                     f"{predicted:.1f} ({kept['step_ms'] / predicted:.3f}{' ✗' if missed and partial else ''})",
                     " / ".join("—" if r is None else f"{r['step_peak_mib']:.0f}" for r in (kept, none, trl)),
                     f"`{name}`"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"✗: over {TOKEN_TARGET}× TRL's step, or where the budget keeps only part of the rows, over 1.05× "
              "the time that share predicts. The per-token upstream gradients of these "
              "trainers are known only in the backward; kept rows skip the logits' recompute (6·N·V·H against 8) "
              "within a budget that keeps the peak at or under TRL's head's (docs/design.md, \"Kept rows\"). "
              "Rows kept: the share of the rows with a target that the default budget keeps (— where the run did "
              "not record it); the predicted time scales the step with none kept by (6·kept + 8·recomputed) / 8. "
              "Each row comes from the newest run that timed it, its three times from that one run."]
    return "\n".join(lines)


TOKEN_SUMMARY_MARK = "<!-- TOKEN-SUMMARY -->"
DISTILL_SUMMARY_MARK = "<!-- DISTILL-SUMMARY -->"


def _span(values, spec=".2f") -> str:
    return f"{min(values):{spec}}×" if min(values) == max(values) else f"{min(values):{spec}}–{max(values):{spec}}×"


def _newest_model_step(key: str) -> tuple[str | None, dict | None]:
    """(file name, ``key``'s record) of the newest ``trl-gpu-*.json`` that has ``key`` (a model step
    of ``scripts/trl_gpu.py``), or (None, None)."""
    runs = [(name, data) for name, data in recorded("trl-gpu-*.json") if key in data]
    if not runs:
        return None, None
    name, data = max(runs, key=lambda item: item[1]["date"])
    return name, dict(data[key], gpu=data["gpu"].removeprefix("NVIDIA "))


def grpo_step_sentence() -> str:
    """The GRPO-shaped model step of ``scripts/trl_gpu.py`` (part 3) with both heads, from the newest
    ``trl-gpu-*.json`` that has it; empty where none does."""
    name, step = _newest_model_step("grpo_step")
    if step is None:
        return ""
    return (f"A GRPO-shaped step of a {step['model']['num_hidden_layers']}-layer Llama-3-shaped model through TRL's "
            f"head (one {step['gpu']}, {step['batch']} × {step['seq_len']} tokens, temperature {step['temperature']}, "
            f"entropy bonus "
            f"{step['entropy_coef']}, {step['laps']} alternating laps; `{name}`) takes {step['flce']['ms']:.1f} ms and "
            f"{step['flce']['peak_mib']:.0f} MiB with this kernel, against {step['trl']['ms']:.1f} ms and "
            f"{step['trl']['peak_mib']:.0f} MiB with TRL's: {step['ratio_ms']:.3f}× the time (target ≤ 0.9), "
            f"{step['ratio_mib']:.2f}× the memory.")


def _listed(names: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def token_summary(runs) -> str:
    """README's paragraph on TRL's head with both kernels: SFT's step and memory (the newest run that
    timed both heads' SFT), and the per-token trainers' with kept rows (``_kept_rows``), each naming its
    runs and GPU (BENCHMARKS.md has the tables)."""
    found = _kept_rows(runs)
    if not found:
        return ""

    def ratios(results, kinds, rows, key="step_ms"):
        return [results[(row, f"flce-{k}")][key] / results[(row, f"trl-{k}")][key] for row in rows for k in kinds
                if (row, f"flce-{k}") in results and (row, f"trl-{k}") in results]

    def head(row):
        return f"{HEAD_NAMES[row.split('-')[0]]} at {'50' if row.endswith('-masked') else '10'}% ignored"

    parts = []
    with_sft = [(n, results) for n, results in _steps_by_date(runs) if ratios(results, ["sft"], TRL_HEADS)]
    if with_sft:
        sft_name, results = with_sft[-1]
        parts.append(f"Through TRL's head on one {_gpu_of(sft_name)} (bf16, N = 8192, `{sft_name}`), SFT's step "
                     f"takes {_span(ratios(results, ['sft'], TRL_HEADS))} TRL's time at "
                     f"{_span(ratios(results, ['sft'], TRL_HEADS, 'step_peak_mib'))} its memory. ")
    labels = {"dpo": "DPO", "kto": "KTO", "rloo": "RLOO", "dft": "SFT's DFT",
              "grpo-coef0": "GRPO at entropy coefficient 0", "grpo": "GRPO with an entropy bonus"}
    predictions = {key: _kept_prediction(kept, none) for key, (_, _, kept, none) in found.items()}
    part = [key for key, (share, _) in predictions.items() if share is not None and share < 1]
    whole = [key for key in found if key not in part]  # (every row kept, or the share not recorded)
    kinds = [k for k in labels if any(kind == k for _, kind in whole)]
    heads = [row for row in ("llama3", "qwen25", "gemma2", "llama3-masked", "gemma2-masked", "qwen25-masked")
             if any(r == row for r, _ in whole)]
    where = "; ".join(f"{' and '.join(HEAD_NAMES[h.split('-')[0]] for h in heads if h.endswith('-masked') == masked)} "
                      f"at {'50' if masked else '10'}% ignored" for masked in (False, True)
                      if any(h.endswith("-masked") == masked for h in heads))
    names = sorted({found[key][0] for key in found})
    gpus = sorted({_gpu_of(name) for name in names})

    def time_ratios(keys):
        return [found[key][2]["step_ms"] / found[key][1]["step_ms"] for key in keys]

    runs_named = ", ".join(f"`{n}`" for n in names)
    parts.append(f"On one {' and one '.join(gpus)} ({runs_named}), with kept rows, the steps of "
                 f"{_listed([labels[k] for k in kinds])} take "
                 f"{_span(time_ratios(whole))} TRL's time where the budget keeps every row ({where})")
    if part:
        shares = sorted({f"{predictions[key][0]:.0%}" for key in part})
        measured = [found[key][2]["step_ms"] / predictions[key][1] for key in part if predictions[key][1]]
        against = f": {_span(measured, '.3f')} the time that share predicts" if measured else ""
        parts.append(f", and {_span(time_ratios(part))} on {' and '.join(dict.fromkeys(head(r) for r, _ in part))}, "
                     f"where the budget keeps {' to '.join(shares)} of the rows{against}")
    parts.append(", each at most TRL's peak memory (BENCHMARKS.md, \"TRL's per-token trainers, with kept rows\"). ")
    return "".join(parts) + grpo_step_sentence()


def distill_step_sentence() -> str:
    """The DistillationTrainer-shaped model step of ``scripts/trl_gpu.py`` (part 4) with both heads,
    from the newest ``trl-gpu-*.json`` that has it; empty where none does."""
    name, step = _newest_model_step("distill_step")
    if step is None:
        return ""
    return (f"A DistillationTrainer-shaped step (a {step['model']['num_hidden_layers']}-layer Llama-3-shaped "
            f"student against a frozen teacher of the same shape, {step['batch']} × {step['seq_len']} tokens, "
            f"{1 - step['prompt_fraction']:.0%} of them completions, β = {step['beta']:g}, through TRL's "
            f"`_chunked_divergence_loss`, {step['laps']} alternating laps, one {step['gpu']}; `{name}`) takes "
            f"{step['flce']['ms']:.1f} "
            f"ms and {step['flce']['peak_mib']:.0f} MiB with this kernel, against {step['trl']['ms']:.1f} ms and "
            f"{step['trl']['peak_mib']:.0f} MiB with TRL's: {step['ratio_ms']:.3f}× the time (target ≤ 0.85), "
            f"{step['ratio_mib']:.2f}× the memory.")


def distill_summary() -> str:
    """README's paragraph on the distillation rows (BENCHMARKS.md has the tables)."""
    results, names, _ = _distill_results()
    if not results:
        return ""
    name = ", ".join(f"`{n}`" for n in names)
    rows = sorted({row for row, m in results if m == "flce-distill"})

    def of(method, betas, key="step_ms"):
        return [results[(row, "flce-distill")][key] / results[(row, method)][key] for row in rows
                if results[(row, "flce-distill")]["beta"] in betas and (row, method) in results]

    fastest = [results[(row, "flce-distill")]["step_ms"] / min(results[(row, m)]["step_ms"] for m in DISTILL_PEERS
                                                               if (row, m) in results) for row in rows]
    sparse, loss = results.get(("sparse-k100", "flce-sparse")), results.get(("sparse-k100", "fused-linear-ce"))
    dense_gpus = sorted({_gpu_of(results[(row, "flce-distill")]["_file"]) for row in rows})
    text = (f"On one {' and one '.join(dense_gpus)} ({name}; student Llama-3 head, teacher hidden 4096 and 8192, "
            f"N = 8192, bf16) the "
            f"divergence's step takes {_span(of('trl-distill', (1.0, 0.0)))} TRL's kernel's time for the reverse KL "
            f"and {_span(of('trl-distill', (0.5,)))} for the JSD, {_span(fastest)} the fastest peer's, at "
            f"{_span(of('trl-distill', (0.5, 1.0), 'step_peak_mib'))} TRL's memory")
    if sparse and loss:
        text += (f"; the sparse KL at K = 100 (on the {_gpu_of(sparse['_file'])}, its gradients made in the forward) "
                 f"takes {sparse['step_ms'] / loss['step_ms']:.2f}× our loss step's time at "
                 f"{sparse['step_peak_mib'] / loss['step_peak_mib']:.3f}× its memory")
    step = distill_step_sentence()
    return text + " (BENCHMARKS.md, \"Distillation\")." + (" " + step if step else "")


def cpu_runs():
    return recorded("cpu-*.json")


def cpu_section(runs):
    """BENCHMARKS.md's table of the CPU path against PyTorch eager (benchmarks/cpu_bench.py)."""
    lines = []
    for name, data in runs:
        env = data["environment"]
        m, v = env["machine"], env["versions"]
        lines += [f"`{name}`: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {v['torch']}, Python "
                  f"{v['python']}; {env['date']}; `{env['command']}`. Times: medians of "
                  f"{data['results'][0].get('reps')} steps after a warm-up, the methods interleaved in one process, "
                  "wall-clock and the process's CPU time (summed over its threads). Memory: one step in a process "
                  "of its own, its peak resident memory above that of the inputs.", "",
                  "| N, (H, V), dtype | method | step ms | step CPU ms | peak extra MiB | extra − grads MiB | "
                  "fp32 logits MiB |", "|---|---|---|---|---|---|---|"]
        for r in data["results"]:
            head = f"{r['n_tokens']}, ({r.get('hidden_size')}, {r.get('vocab_size')}), {r.get('dtype')}"
            if "error" in r:
                lines.append(f"| {head} | {r['method']} | {error_cell(r)} | | | | |")
                continue
            name_ = f"**{r['method']}**" if r["method"] == OURS else r["method"]
            lines.append(f"| {head} | {name_} | {r['step_ms']:.0f} | {r['step_cpu_ms']:.0f} | "
                         f"{r['peak_extra_mib']:.0f} | {r['peak_extra_minus_grads_mib']:.0f} | {r['logits_mib']:.0f} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def _gpu_environments():
    """(GPU, torch, triton, Python) of every recorded GPU run."""
    found = []
    for _, data in recorded("*.json"):
        env = data.get("environment", data)
        versions = env.get("versions", env)
        if "gpu" in env and "torch" in versions:
            found.append((env["gpu"], versions["torch"], versions.get("triton"), versions.get("python")))
    return found


def requirements(cpu):
    """README's requirements table: declared in pyproject.toml, and what the recorded runs used."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {d.split(">=")[0].strip(): ">= " + d.split(">=")[1] for d in project["dependencies"] if ">=" in d}
    declared["python"] = project["requires-python"].replace(">=", ">= ")
    # triton is an extra: CUDA builds of torch bring it, and CPU tensors need none
    triton = project["optional-dependencies"]["triton"][0].split(">=")[1]
    declared["triton"] = f"not required; >= {triton} for the Triton kernels (CUDA builds of torch bring it; `[triton]`)"
    gpu = _gpu_environments()

    def listed(index):
        return ", ".join(sorted({e[index] for e in gpu if e[index]})) or "—"

    cpu_env = cpu[-1][1]["environment"] if cpu else None
    cpu_v = cpu_env["versions"] if cpu_env else {}
    lines = [
        "| | required (pyproject.toml) | tested on a GPU (recorded runs) | tested on CPU only (CI, CPU benchmark) |",
        "|---|---|---|---|",
        f"| hardware | — | {listed(0)} | "
        + (f"{cpu_env['machine']['cpu']}, {cpu_env['machine']['cores']} cores |" if cpu_env else "— |"),
        f"| Python | {declared['python']} | {listed(3)} | {cpu_v.get('python', '—')} |",
        f"| torch | {declared.get('torch', '—')} | {listed(1)} | {cpu_v.get('torch', '—')} |",
        f"| triton | {declared.get('triton', '—')} | {listed(2)} | {cpu_v.get('triton') or '—'} |",
        "| what runs | | the Triton kernels: bf16, fp16, fp32 | the same algorithm in PyTorch (each chunk's fp32 "
        "logits), or the Triton kernels in Triton's interpreter under `TRITON_INTERPRET=1` (slow: for tests) |",
    ]
    fp32_runs = [run for run in cpu if all(r.get("dtype", "float32") == "float32" for r in run[1]["results"])]
    bf16_runs = [run for run in cpu if any(r.get("dtype") == "bfloat16" for r in run[1]["results"])]
    if fp32_runs:
        cpu = fp32_runs
        results = {(r["method"], r["n_tokens"]): r for r in cpu[-1][1]["results"] if "error" not in r}
        cases = sorted({n for (m, n) in results if m == OURS and ("torch", n) in results})
        if cases:
            r0 = results[(OURS, cases[0])]

            def listing(text):
                return " and ".join(text(n) for n in cases)

            def time_ratio(n):
                return f"{results[(OURS, n)]['step_ms'] / results[('torch', n)]['step_ms']:.2f}×"

            lines += ["", f"On the CPU ({cpu_env['machine']['cpu']}, {cpu_env['machine']['cores']} cores; "
                      f"`{cpu[-1][0]}`), a float32 training step at H = {r0['hidden_size']}, V = {r0['vocab_size']} "
                      "takes " + listing(time_ratio)
                      + " PyTorch eager's time at N = " + listing(str) + ", with "
                      + listing(lambda n: f"{results[(OURS, n)]['peak_extra_minus_grads_mib']:.0f}")
                      + " MiB of extra memory against eager's "
                      + listing(lambda n: f"{results[('torch', n)]['peak_extra_minus_grads_mib']:.0f}")
                      + " MiB (peak resident memory less the gradients; BENCHMARKS.md, \"CPU\")."]
    if bf16_runs:
        name, data = bf16_runs[-1]
        found = {(r["method"], r["n_tokens"]): r for r in data["results"] if "error" not in r}
        pairs = sorted(n for (m, n) in found if m == OURS and ("torch", n) in found)
        if pairs:
            r = found[(OURS, pairs[0])]
            lines.append(f"bf16 inputs there (`{name}`, H = {r['hidden_size']}, V = {r['vocab_size']}): "
                         + " and ".join(f"{found[(OURS, n)]['step_ms'] / 1e3:.2f} s against eager's "
                                        f"{found[('torch', n)]['step_ms'] / 1e3:.2f} s at N = {n}" for n in pairs)
                         + ".")
    return "\n".join(lines)


def replace_between(text, mark, body):
    start = text.index(mark)
    end = text.index(mark, start + 1) if text.count(mark) > 1 else start
    return text[:start] + mark + "\n" + body + "\n" + mark + text[end + len(mark):]


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if BENCHMARKS.md or README's sections differ from the JSON")
    args = parser.parse_args()
    runs, latest = load()
    cpu = cpu_runs()
    present = {k[1] for k in latest}
    every_target = no_ignored_rows(latest)
    other_rows = sorted({k[0] for k in latest} - set(MAIN_ROWS) - set(SCALING) - set(every_target))
    made = [name for name in ("scaling_time.png", "scaling_memory.png")] if args.check else plots(latest)
    parts = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`, which "
        "`benchmarks/bench.py` wrote on the GPU (`scripts/gpu-check bench`) and `benchmarks/cpu_bench.py` on "
        "a CPU (last section). On the GPU, times are medians of "
        "`triton.testing.do_bench`, after a warm-up that brings the GPU to the clock it holds in a training loop "
        "(runs from v5: one second; these steps hold an H200 at its power limit); "
        "a step is forward + backward with gradients for hidden and weight; "
        "peak is the peak allocated memory of one step above what was allocated before it, and "
        "\"peak − grads\" subtracts the gradients' own bytes. Errors are relative to a reference on the "
        "same inputs: float32 up to the v5 runs, float64 from v6 (at fp32-rounding level an fp32 reference's own "
        "error is as large as the methods'). \"lm\" inputs are a peaked, Zipf-skewed softmax with targets "
        "drawn from it (about 5 nats, 25% top-1); \"uniform\" are logits ~ N(0, 1). 10% of targets "
        "are ignored, on every row but the \"-no-ignored\" ones.",
        "",
        "The Hub's own benchmark (`kernels benchmark qgallouedec/fused-linear-ce@v1`) runs "
        "`benchmarks/benchmark_hub.py`: the loss's training step on these heads and SFT's and GRPO's per-token "
        "outputs with their backward, each checked against and timed beside PyTorch eager on the logits.",
        "",
        "## Runs",
        "",
        environment(runs),
    ]
    for inputs in ("lm", "uniform"):
        if inputs not in present:
            continue
        parts += ["", f"## Ratios to the peers ({inputs} inputs)", "", RATIOS_TEXT, "",
                  targets(latest, MAIN_ROWS + SCALE_ROWS + every_target + [r for r in other_rows if "slice" not in r],
                          inputs),
                  "", f"## Main heads, N = 8192 ({inputs} inputs)", "", table(latest, MAIN_ROWS, inputs)]
    if any((row, "lm", OURS) in latest for row in SCALING if row != "llama3"):
        parts += ["", "## Scaling with N (Llama-3-8B head, lm inputs)", "", table(latest, list(SCALING), "lm"), ""]
        parts += [f"![{name}](benchmarks/plots/{name})" for name in made]
    if every_target:
        parts += ["", "## Every target counted (no ignored rows)", "",
                  "The main heads with none of the targets ignored, as in pretraining without padding. This kernel "
                  "skips the products of the rows whose target is ignored and the peers compute them, so on the rows "
                  "above (10% ignored) part of its lead is that skip; here every method does the same work.", "",
                  "LM-like inputs:", "", table(latest, every_target, "lm")]
        if any((row, "uniform", OURS) in latest for row in every_target):
            parts += ["", "Uniform inputs:", "", table(latest, every_target, "uniform")]
    if other_rows:
        parts += ["", "## Other rows (dtypes, one rank's vocabulary slice)", "", table(latest, other_rows, "lm")]
    parts += ["", "## Distance to the matmul floor (lm inputs)", "",
              "A training step does 6·N·V·H useful flops (logits, grad_hidden, grad_weight); at the bf16 matmul "
              "rate measured in the same run (an 8192³ product) they take the first column's time. The share "
              "in brackets is that time over the step's. The v5 runs timed that product after 100 ms of "
              "warm-up, at a higher clock than their power-limited steps (which puts steps past 100%); "
              "later runs time it after the methods' warm-up.", "", floor_table(latest, MAIN_ROWS)]
    if any("anatomy" in r for r in latest.values()):
        parts += ["", "## Step anatomy (lm inputs)", "",
                  "Three training steps issued back to back under `torch.profiler` (`bench.py --anatomy-rows`): "
                  "the span from the first kernel's start to the last one's end, the time some kernel runs "
                  "(busy), and where it goes, a step. The matrix products are the logit product and the two "
                  "gradient products (this kernel: its logit kernel, a Gluon kernel on Hopper, and cuBLAS; "
                  "torch.compile: its products); their rate counts 6·n·V·H flops over the n rows each method "
                  "computes (this kernel skips the rows whose target is ignored). The other kernels are the "
                  "softmax and memory passes and the small per-row kernels. The profiler's callbacks slow the "
                  "host's launches: on a small head (the most launches a millisecond of GPU work) the gaps "
                  "between a step's first small kernels are the host's, which without the profiler keeps "
                  "ahead of the GPU and waits for it (docs/design.md, \"The host\").", "",
                  anatomy_table(latest, MAIN_ROWS)]
    before_after = before_after_runs()
    if before_after:
        parts += ["", "## Before and after", "",
                  "Runs that timed an earlier build beside this one in the same process (`bench.py --base`, the "
                  "earlier build from `scripts/export_build`), laps alternating: a change between the builds is "
                  "within the run, not between machines or days, and it is the change of the ratio to any peer "
                  "of the run. The runs differ by the build of this kernel they timed (docs/design.md).", "",
                  before_after_section(before_after)]
    trl = trl_runs()
    if trl:
        parts += ["", "## TRL's fused LM head: SFT's and GRPO's outputs, and the metrics' cost", "", trl_section(trl)]
        kept = token_trainers_section(trl)
        if kept:
            parts += ["", "## TRL's per-token trainers, with kept rows", "", kept]
    parts += ["", "## Distillation", "", distillation_section()]
    nccl = nccl_runs()
    if nccl:
        parts += ["", "## Vocabulary parallelism over NCCL (`scripts/gpu_distributed.py`)", "", nccl_section(nccl)]
    if cpu:
        parts += ["", "## CPU: the PyTorch path against PyTorch eager (`benchmarks/cpu_bench.py`)", "",
                  "CPU tensors (without `TRITON_INTERPRET=1`) take the chunked PyTorch path. One float32 training "
                  "step, forward + backward with gradients for hidden and weight; PyTorch eager is "
                  "`F.cross_entropy(hidden @ weight.T, targets)`.", "", cpu_section(cpu)]
    benchmarks_md = "\n".join(parts) + "\n"

    # README: the generated sections between their markers
    readme = (ROOT / "README.md").read_text()
    readme = replace_between(readme, README_MARK, readme_table(latest))
    readme = replace_between(readme, SUMMARY_MARK, summary(latest))
    readme = replace_between(readme, REQUIREMENTS_MARK, requirements(cpu))
    readme = replace_between(readme, TOKEN_SUMMARY_MARK, token_summary(trl))
    readme = replace_between(readme, DISTILL_SUMMARY_MARK, distill_summary())
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
