"""Records, on a GPU, the Triton specialisations that each kind of call compiles, and writes them
as ``torch-ext/fused_linear_ce/specializations.json`` for ``_precompile`` (its key: this GPU's
sm_XY; other GPUs' entries are kept). Each kind runs in its own process, with precompilation
off, so that its first calls compile every kernel they launch; Triton's post-compile hook
records each compilation as ``JITFunction.preload`` takes it.

The calls are the main heads' training steps and forwards at 8192 rows (10% ignored, and none:
TRL's heads gather the rows with a label) and at 5003 rows, bf16, with a softcap on Gemma-2's
head; the per-token kinds take SFT's outputs (log-probs, entropy, top-1, one weight a row: the
sweep's gradients), GRPO's (entropy with a gradient, per-token weights, temperature 0.7),
DPO's (log-probs alone, summed, then weighted per sequence) and TRL's DPO and KTO heads' (their
metrics beside the log-probs, weighted per sequence of 512 rows). Re-record after changing a
kernel's parameters or a launch's specialisation (``tests/kernels/test_precompile.py`` checks the
parameters).

Each entry then gets its compile time (``compile_s``: Triton's compile for the recorded GPU, no
GPU needed, one entry after another into an empty cache), by which ``_precompile`` shares the
entries out among its children, and that compile's tensor descriptors' metadata
(``tensordesc_meta``), from which a child builds the entry's launcher without compiling it;
``--times-only`` re-times the table as it stands (any machine with the table's Triton).

    python scripts/record_specializations.py [--out PATH] [--times-only]
"""

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "torch-ext" / "fused_linear_ce" / "specializations.json"
# The per-token kinds: SFT's outputs, GRPO's (entropy with a gradient), DPO's (log-probs alone), and
# TRL's DPO and KTO heads' (their trainers' metrics beside the log-probs, per-sequence weights).
TRL_PREFERENCE_KINDS = ("tokens:entropy,is_top1,log_probs,mean_logits", "tokens:entropy,log_probs,mean_logits")
KINDS = ("loss", "metrics", "tokens:entropy,is_top1,log_probs", "tokens:entropy,log_probs", "tokens:log_probs",
         *TRL_PREFERENCE_KINDS)

CHILD = r"""
import importlib, json, sys, torch, triton
sys.path.insert(0, {bench!r})
from bench import ROWS, load_flce, make_inputs
flce, _ = load_flce()
lazy = importlib.import_module(flce.__name__ + "._settings").override(precompile=False)
lazy.__enter__()  # (held by a name: a context manager collected at once would undo it)
backend = triton.compiler.make_backend(triton.runtime.driver.active.get_current_target())
defaults = json.loads(json.dumps(backend.parse_options({{}}).__dict__))
entries = {{}}

def hook(key, repr, fn, compile, is_manual_warmup, already_compiled):
    data = json.loads(compile["specialization_data"])
    # Only the options a launch set: the others (libdevice's path among them) are the machine's.
    data["options"] = {{k: v for k, v in data["options"].items() if defaults.get(k) != v}}
    del data["name"], data["key"]
    module = fn.module.rsplit(".", 1)[-1]
    entries[module, fn.name, key] = {{"module": module, "kernel": fn.name, "key": key, "data": data}}

triton.knobs.runtime.jit_post_compile_hook = hook
kind = {kind!r}
for row, n_rows, ignored, softcap in (("llama3", 8192, 0.1, None), ("llama3", 8192, 0.0, None),
                                      ("llama3", 5003, 0.1, None), ("gemma2", 8192, 0.1, 30.0)):
    hidden_size, vocab_size, _, dtype = ROWS[row]
    hidden, weight, targets = make_inputs(n_rows, hidden_size, vocab_size, getattr(torch, dtype), "lm",
                                          ignored_share=ignored)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    valid = targets != -100
    if kind == "tokens:entropy,is_top1,log_probs":  # SFT: every row's weight -1 / n
        sft = flce.fused_linear_log_probs(h, w, targets, softcap=softcap, outputs=("log_probs", "entropy", "is_top1"))
        (-sft.log_probs.sum() / valid.sum()).backward()
        with torch.no_grad():
            flce.fused_linear_log_probs(h, w, targets, softcap=softcap, outputs=("log_probs", "entropy", "is_top1"))
    elif kind == "tokens:entropy,log_probs":  # GRPO: advantages and an entropy bonus, twice (the
        for _ in range(2):                    # second call's forward no longer makes gradients)
            grpo = flce.fused_linear_log_probs(h, w, targets, softcap=softcap, temperature=0.7,
                                               outputs=("log_probs", "entropy"))
            advantage = torch.randn(n_rows, device="cuda")
            (-(grpo.log_probs * advantage).sum() - 0.1 * grpo.entropy.sum()).backward()
        with torch.no_grad():
            flce.fused_linear_log_probs(h, w, targets, softcap=softcap, temperature=0.7,
                                        outputs=("log_probs", "entropy"))
    elif kind == "tokens:log_probs":  # DPO: sums (one weight, scaled), then per-sequence weights
        flce.fused_linear_log_probs(h, w, targets, softcap=softcap).log_probs.sum().backward()
        for _ in range(2):
            weights = torch.randn(n_rows, device="cuda")
            (flce.fused_linear_log_probs(h, w, targets, softcap=softcap).log_probs * weights).sum().backward()
        with torch.no_grad():
            flce.fused_linear_log_probs(h, w, targets, softcap=softcap)
    elif kind in {preference!r}:  # TRL's DPO and KTO: per-sequence weights on the log-probs, three calls
        outputs = tuple(kind.removeprefix("tokens:").split(","))  # (the first forward's gradients speculated)
        for _ in range(3):
            weights = torch.randn(-(-n_rows // 512), device="cuda").repeat_interleave(512)[:n_rows]
            out = flce.fused_linear_log_probs(h, w, targets, softcap=softcap, outputs=outputs)
            (out.log_probs * weights).sum().backward()
        with torch.no_grad():
            flce.fused_linear_log_probs(h, w, targets, softcap=softcap, outputs=outputs)
    else:
        out = flce.fused_linear_cross_entropy(h, w, targets, softcap=softcap, return_metrics=kind == "metrics")
        (out[0] if isinstance(out, tuple) else out).backward()
        with torch.no_grad():
            flce.fused_linear_cross_entropy(h, w, targets, softcap=softcap, return_metrics=kind == "metrics")
    torch.cuda.synchronize()
    del hidden, weight, h, w
print(json.dumps(list(entries.values())))
"""


def record(kind: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        child = CHILD.format(bench=str(ROOT / "benchmarks"), kind=kind, preference=TRL_PREFERENCE_KINDS)
        run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{kind}: the recording failed\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def time_compiles(gpu: str, table: dict) -> None:
    """Sets each entry's ``compile_s``: Triton's compile of its specialisation for ``gpu``
    ("sm_90"), once per distinct entry, one after another in this process, into an empty cache
    (after one compile into another, so that no entry pays the compiler's loading); and its
    ``tensordesc_meta``, the compile's metadata that the launcher's source is made from."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    sys.path.insert(0, str(ROOT / "torch-ext"))
    from fused_linear_ce import _precompile

    target = GPUTarget("cuda", int(gpu.removeprefix("sm_")), 32)
    backend = triton.compiler.make_backend(target)
    distinct = {(e["module"], e["kernel"], e["key"]): e for entries in table["kinds"].values() for e in entries}

    def compile_entry(entry: dict) -> tuple[float, list | None]:
        kernel = getattr(importlib.import_module(f"fused_linear_ce.{entry['module']}"), entry["kernel"])
        # (Triton sets a kernel's source class at its first launch on a device; none here)
        kernel.ASTSource = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
        options = _precompile._options(backend, entry["data"])
        start = time.perf_counter()
        compiled = triton.compile(_precompile._source(kernel, entry["data"]), target=target, options=options.__dict__)
        return time.perf_counter() - start, compiled.metadata.tensordesc_meta

    compiles = {}
    for cache in ("loading", "timed"):
        with tempfile.TemporaryDirectory() as folder:
            os.environ["TRITON_CACHE_DIR"] = folder
            for key, entry in (list(distinct.items())[:1] if cache == "loading" else distinct.items()):
                compiles[key] = compile_entry(entry)
    for entries in table["kinds"].values():
        for entry in entries:
            seconds, tensordesc_meta = compiles[entry["module"], entry["kernel"], entry["key"]]
            entry["compile_s"], entry["tensordesc_meta"] = round(seconds, 3), tensordesc_meta
    table["compile_host"] = _cpu_name()
    total = sum(seconds for seconds, _ in compiles.values())
    print(f"{gpu}: {len(distinct)} compiles, {total:.1f} s on {table['compile_host']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=TABLE)
    parser.add_argument("--times-only", action="store_true", help="re-time the recorded table's compiles")
    args = parser.parse_args()
    recorded = json.loads(TABLE.read_text())
    if args.times_only:
        for gpu, table in recorded.items():
            time_compiles(gpu, table)
    else:
        import torch
        import triton

        major, minor = torch.cuda.get_device_capability()
        kinds = {}
        for kind in KINDS:
            kinds[kind] = record(kind)
            print(f"{kind}: {len(kinds[kind])} specialisations", flush=True)
        gpu = f"sm_{major}{minor}"
        recorded[gpu] = {
            "gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "kinds": kinds,
        }
        time_compiles(gpu, recorded[gpu])
    args.out.write_text(render(recorded))
    print(f"wrote {args.out}")


def render(recorded: dict) -> str:
    """The table as JSON, one line an entry (so that a new recording diffs entry by entry)."""
    lines = ["{"]
    for i, (gpu, table) in enumerate(recorded.items()):
        about = {k: v for k, v in table.items() if k != "kinds"}
        lines.append(f'  {json.dumps(gpu)}: {{{json.dumps(about)[1:-1]}, "kinds": {{')
        for j, (kind, entries) in enumerate(table["kinds"].items()):
            lines.append(f"    {json.dumps(kind)}: [")
            lines += [f"      {json.dumps(e)}" + ("," if k < len(entries) - 1 else "") for k, e in enumerate(entries)]
            lines.append("    ]" + ("," if j < len(table["kinds"]) - 1 else ""))
        lines.append("  }}" + ("," if i < len(recorded) - 1 else ""))
    return "\n".join(lines) + "\n}\n"

if __name__ == "__main__":
    main()
