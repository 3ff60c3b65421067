"""Where a training step's time goes at the power cap: the step against cuBLAS skeletons of it.

Under the H200's power cap, back-to-back steps run at the clock their energy allows, so a kernel's
time at the cap measures its energy, not its cycles (perf notes, runs 20-25 and 57: filling idle
multiprocessors saved nothing there). This probe times, each back to back at the cap after a
warm-up, on the rows of one head that all have a loss:

- ``step``: fused-linear-ce's training step (forward and backward);
- ``cublas chunks``: the step's three products alone, with cuBLAS, in the step's chunks of rows:
  the logits (bf16 out, what the sweep computes), grad_hidden (E' @ W, fp32 out) and grad_weight
  (E'^T @ diag(r) H, accumulated in bf16), on E' = exp(z - row max) of the same inputs;
- ``cublas whole``: the same three products on all rows at once (no chunks);
- ``torch.compile``: its step on the same rows;
- with ``--parts``, each product alone in chunks and whole, grad_hidden's transposed formulation,
  and the package's sweeps alone (``sweep chunks``: ``factored_sweep`` and ``factored_rows`` a chunk);
- with ``--env NAME:K=V,...``, ``step [NAME]`` and ``sweep chunks [NAME]`` again under those
  settings (``_settings.Settings``' fields, any case, through ``_settings.override``), for an A/B
  at the cap;
- ``--only`` keeps the named variants (','-separated, ``_`` for a space).

The differences say what the sweep's epilogue and the per-row kernels cost (``step`` against
``cublas chunks``) and what the chunks cost (``cublas chunks`` against ``cublas whole``). The
variants run in order and then in reverse order, so that a drift of the clock shows.

    python lab/parts_probe.py --out parts.json [--heads llama2] [--inputs lm,uniform]
        [--parts] [--env gluon:GLUON_TRAINING=1] [--only "step,step_[gluon]"]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import (  # noqa: E402
    ROOT,
    ROWS,
    GpuSampler,
    environment,
    ignore_fraction,
    load_flce,
    make_inputs,
    make_method,
)


def package():
    """The package's own modules, from the sources (its chunk plan and backend, not its API)."""
    sources = str(ROOT / "torch-ext")
    if sources not in sys.path:
        sys.path.insert(0, sources)
    from fused_linear_ce import _chunked, _options, _triton_backend

    return _chunked, _options, _triton_backend


def step_chunks(rows: int, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """[(start, end)] of a training step's chunks when all ``rows`` have a loss (the package's plan:
    a first chunk of the most rows, then the rest spread in whole row blocks of its sweep)."""
    chunked, options, backend = package()
    row_block = backend.row_block(dtype, options.LossOptions(), False, True, False, torch.device("cuda"))
    chunk = backend.chunk_rows(rows, vocab_size, dtype, True, spread=False, hidden_size=hidden_size)
    return list(chunked._spans(rows, chunk, None, min(chunk, rows), row_block))


def skeleton(hidden, weight, chunks, parts=("logits", "grad_hidden", "grad_weight"), transposed=False):
    """A call that runs ``parts`` of the step's three products with cuBLAS over ``chunks``
    [(start, end)]; with ``transposed``, grad_hidden as (W^T E'^T)^T (cuBLAS's other formulation)."""
    rows = hidden.shape[0]
    logits = torch.empty(max(e - s for s, e in chunks), weight.shape[0], device=hidden.device, dtype=hidden.dtype)
    exps = torch.empty(rows, weight.shape[0], device=hidden.device, dtype=hidden.dtype)  # E' of every row
    for s in range(0, rows, 1024):
        e = min(rows, s + 1024)
        z = hidden[s:e].float() @ weight.float().t()
        exps[s:e] = torch.exp(z - z.amax(1, keepdim=True)).to(hidden.dtype)
    scaled = (hidden.float() / rows).to(hidden.dtype)  # diag(r) H with r about 1/N
    grad_weight = torch.empty_like(weight)

    def call():
        for i, (s, e) in enumerate(chunks):
            if "logits" in parts:
                torch.mm(hidden[s:e], weight.t(), out=logits[: e - s])
            if "grad_hidden" in parts:
                if transposed:
                    torch.mm(weight.t(), exps[s:e].t(), out_dtype=torch.float32)
                else:
                    torch.mm(exps[s:e], weight, out_dtype=torch.float32)
            if "grad_weight" in parts:
                if i == 0:
                    torch.mm(exps[s:e].t(), scaled[s:e], out=grad_weight)
                else:
                    grad_weight.addmm_(exps[s:e].t(), scaled[s:e])

    return call


def sweep(hidden, weight, targets, chunks):
    """A call that runs the package's training sweeps alone over ``chunks``: each chunk's
    ``factored_sweep`` and ``factored_rows`` (its reference, the sweep that stores E' and the
    per-row pass that scales the hidden rows), as a step does before its products."""
    _, options, backend = package()
    rows, hidden_size = hidden.shape
    f32 = dict(device=hidden.device, dtype=torch.float32)
    buffer = backend.new_buffer(max(e - s for s, e in chunks), weight.shape[0], hidden.dtype, hidden.device)
    loss_grad = torch.full((rows,), 1.0 / rows, **f32)
    opts = options.LossOptions()

    def call():
        for s, e in chunks:
            out = options.RowResults(lse=torch.empty(e - s, **f32), loss=torch.empty(e - s, **f32))
            scaled = torch.empty(e - s, hidden_size, device=hidden.device, dtype=hidden.dtype)
            sweep = backend.factored_sweep(hidden[s:e], weight, targets[s:e], opts, buffer[: e - s], loss_grad[s:e])
            backend.factored_rows(sweep, hidden[s:e], targets[s:e], opts, buffer[: e - s], loss_grad[s:e], out, scaled)

    return call


def under_settings(fn, settings, changes: dict):
    """``fn`` called with the package's ``settings`` module overridden by ``changes`` (restored after each call)."""
    def call():
        with settings.override(**changes):
            fn()
    return call


def sustained(fn, warm_ms: float, rep_ms: float) -> dict:
    """ms a call over about ``rep_ms`` of back-to-back calls, after ``warm_ms`` of them (the card at
    its capped clock), with the clock and power meanwhile."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    once = do_bench(fn, warmup=25, rep=100, return_mode="median")
    for _ in range(max(1, int(warm_ms / once))):
        fn()
    calls = max(10, int(rep_ms / once))
    with GpuSampler() as sampler:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
    return {"ms": start.elapsed_time(end) / calls, "calls": calls, "gpu": sampler.summary()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--heads", default="llama2")
    parser.add_argument("--inputs", default="lm,uniform")
    parser.add_argument("--warm-ms", type=float, default=1000)
    parser.add_argument("--rep-ms", type=float, default=1000)
    parser.add_argument("--parts", action="store_true", help="also each product alone, and the sweeps alone")
    parser.add_argument("--env", action="append", default=[],
                        help="NAME:K=V,...: the step and the sweeps again under these settings")
    parser.add_argument("--only", default="", help="','-separated variants to keep, '_' for a space (default: all)")
    args = parser.parse_args()
    flce, loaded_from = load_flce()
    settings = sys.modules[flce.__name__ + "._settings"]
    ab_changes = {spec.split(":", 1)[0]: settings.parse(spec.split(":", 1)[1]) for spec in args.env}
    result = {"environment": environment(), "loaded_from": loaded_from, "results": []}
    for head in args.heads.split(","):
        hidden_size, vocab_size, n_tokens, _ = ROWS[head]
        for kind in args.inputs.split(","):
            hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, torch.bfloat16, kind,
                                                  ignored_share=ignore_fraction(head))
            valid = targets != -100
            hidden, targets = hidden[valid].contiguous(), targets[valid].contiguous()
            rows = hidden.shape[0]
            h = hidden.detach().requires_grad_()
            w = weight.detach().requires_grad_()

            def step_of(loss_fn, h=h, w=w, targets=targets):
                def step():
                    h.grad = w.grad = None
                    loss_fn(h, w, targets).backward()
                return step

            variants = {
                "step": step_of(make_method("fused-linear-ce", flce)),
                "cublas chunks": skeleton(hidden, weight, step_chunks(rows, vocab_size, hidden_size, hidden.dtype)),
                "cublas whole": skeleton(hidden, weight, [(0, rows)]),
                "torch.compile": step_of(make_method("torch.compile", flce)),
            }
            if args.parts:
                chunks, whole = step_chunks(rows, vocab_size, hidden_size, hidden.dtype), [(0, rows)]
                variants["sweep chunks"] = sweep(hidden, weight, targets, chunks)
                for part in ("logits", "grad_hidden", "grad_weight"):
                    variants[f"{part} chunks"] = skeleton(hidden, weight, chunks, (part,))
                    variants[f"{part} whole"] = skeleton(hidden, weight, whole, (part,))
                variants["grad_hidden chunks transposed"] = skeleton(hidden, weight, chunks, ("grad_hidden",), True)
            if args.env and "sweep chunks" not in variants:
                variants["sweep chunks"] = sweep(hidden, weight, targets,
                                                 step_chunks(rows, vocab_size, hidden_size, hidden.dtype))
            for name, changes in ab_changes.items():
                variants[f"step [{name}]"] = under_settings(variants["step"], settings, changes)
                variants[f"sweep chunks [{name}]"] = under_settings(variants["sweep chunks"], settings, changes)
            if args.only:
                variants = {name: fn for name, fn in variants.items()
                            if name.replace(" ", "_") in args.only.split(",")}
            for fn in variants.values():  # compile and allocate outside the timings
                fn()
            torch.cuda.synchronize()
            for lap, names in enumerate((list(variants), list(variants)[::-1])):
                for name in names:
                    entry = {"head": head, "inputs": kind, "rows": rows, "variant": name, "lap": lap,
                             "flops_6nvh": 6 * rows * vocab_size * hidden_size}
                    entry.update(sustained(variants[name], args.warm_ms, args.rep_ms))
                    entry["us_per_row"] = entry["ms"] * 1e3 / rows
                    print(json.dumps(entry), flush=True)
                    result["results"].append(entry)
                    Path(args.out).write_text(json.dumps(result, indent=1))
            del variants
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
