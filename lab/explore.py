"""Design exploration on one GPU: the kernel's variants (tile width, TMA, chunk size) side by
side, and where the time of a training step goes (torch.profiler, per kernel).

    python lab/explore.py --rows llama3,gemma2 --variants "BLOCK_V=256,TMA=1;BLOCK_V=128,TMA=1"

A variant is a set of the kernel's settings (``_settings.Settings``' fields, any case:
``block_v=128,gluon=0``), each taken through ``_settings.override`` for the variant's timings;
the item ``metrics`` in a variant times the loss with its metrics (``return_metrics=True``), so

    python lab/explore.py --rows gemma2 --variants ";gluon=0;metrics;metrics,tuned=0;;gluon=0;metrics;metrics,tuned=0"

splits the metrics' cost between the kernel they take and their own arithmetic, in two laps.
"""

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import (  # noqa: E402
    ROWS,
    environment,
    ignore_fraction,
    kernel_breakdown,
    load_flce,
    make_inputs,
    reference,
    rel_err,
)

LOSS_OPTIONS: dict = {}  # keyword arguments of every loss call (--softcap, --metrics, a variant's metrics)


def split_variant(settings, variant: str) -> tuple[dict, bool]:
    """A variant's settings and whether it asks for the metrics (its item ``metrics``)."""
    items = [item for item in variant.split(",") if item.strip()]
    metrics = any(item.strip().lower() == "metrics" for item in items)
    return settings.parse(",".join(i for i in items if i.strip().lower() != "metrics")), metrics


def loss_of(out):
    """The loss of a call's result ((loss, metrics) with ``return_metrics``)."""
    return out[0] if isinstance(out, tuple) else out


def step_and_fwd(flce, hidden, weight, targets, rep_ms, warmup_ms=100, fwd_only=False):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()

    def step():
        h.grad = w.grad = None
        loss_of(flce.fused_linear_cross_entropy(h, w, targets, **LOSS_OPTIONS)).backward()

    def fwd():
        with torch.no_grad():
            flce.fused_linear_cross_entropy(h, w, targets, **LOSS_OPTIONS)

    fwd()
    fwd_ms = do_bench(fwd, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    if fwd_only:
        return fwd_ms, None, step, (h, w)
    step()
    return fwd_ms, do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median"), step, (h, w)


def step_extra_mib(step, tensors) -> float:
    """Peak memory of one step above what was allocated before it, less the gradients (MiB)."""
    for t in tensors:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    grads = sum(t.numel() * t.element_size() for t in tensors)
    return (torch.cuda.max_memory_allocated() - base - grads) / 2**20


def back_to_back_ms(step, n=10):
    """Mean of n steps issued back to back (no cache flush between them), by CUDA events."""
    step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def time_logit_kernel(flce, hidden, weight, targets, config):
    """TFLOP/s of the logit kernel alone on one chunk, statistics only and with the buffer."""
    backend = importlib.import_module(flce.__name__ + "._triton_backend")
    options = sys.modules[flce.__name__ + "._options"].LossOptions()
    rows = backend.chunk_rows(hidden.shape[0], weight.shape[0], hidden.dtype, True, hidden_size=hidden.shape[1])
    h, t = hidden[:rows], targets[:rows]
    buffer = backend.new_buffer(rows, weight.shape[0], hidden.dtype, hidden.device)
    row_ref, target_logit = backend.row_reference(h, weight, t.clamp(min=0), options)
    loss_grad = torch.ones(rows, device=h.device)
    settings = sys.modules[flce.__name__ + "._settings"]
    out = {}
    variants = {"stats": dict(shifted_out=None), "stats_and_buffer": dict(shifted_out=buffer),
                "stats_and_exp": dict(shifted_out=buffer, row_ref=row_ref, loss_grad=loss_grad,
                                          target_logit=target_logit)}
    try:
        with settings.override(config=settings.parse_value("config", config)):
            for name, kwargs in variants.items():
                ms = do_bench(lambda kwargs=kwargs: backend.row_stats(h, weight, None, t, options, **kwargs),
                              warmup=50, rep=200, return_mode="median")
                out[f"{name}_tflops"] = 2 * rows * weight.shape[0] * weight.shape[1] / ms / 1e9
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def time_gemms(hidden_size, vocab_size, rows_list, dtype=torch.bfloat16):
    """TFLOP/s of a training chunk's cuBLAS products at several chunk sizes: the logits
    H_c @ W^T, grad_hidden G @ W (16-bit and fp32 output), grad_weight G^T @ H_c (beta 0 and 1)."""
    dev = dict(device="cuda", dtype=dtype)
    weight = torch.randn(vocab_size, hidden_size, **dev) / hidden_size**0.5
    grad_weight = torch.randn(vocab_size, hidden_size, **dev)
    def products(hidden, grad_logits):
        return {
            "logits": lambda: torch.mm(hidden, weight.T),
            "grad_hidden": lambda: torch.mm(grad_logits, weight),
            "grad_hidden_f32": lambda: torch.mm(grad_logits, weight, out_dtype=torch.float32),
            "grad_weight_first": lambda: torch.mm(grad_logits.T, hidden, out=grad_weight),
            "grad_weight_accumulate": lambda: grad_weight.addmm_(grad_logits.T, hidden),
        }

    out = []
    for rows in rows_list:
        hidden = torch.randn(rows, hidden_size, **dev)
        grad_logits = torch.randn(rows, vocab_size, **dev) * 1e-3
        rec = {"gemm_rows": rows, "hidden_size": hidden_size, "vocab_size": vocab_size}
        for name, fn in products(hidden, grad_logits).items():
            try:
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                rec[f"{name}_tflops"] = 2 * rows * vocab_size * hidden_size / ms / 1e9
            except Exception as e:
                rec[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        out.append(rec)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="llama3,gemma2")
    parser.add_argument("--variants", default="BLOCK_V=256,TMA=1;BLOCK_V=256,TMA=0;BLOCK_V=128,TMA=1")
    parser.add_argument("--rep-ms", type=float, default=300)
    parser.add_argument("--warmup-ms", type=float, default=100,
                        help="1000: time at the clock the GPU settles to under its power limit")
    parser.add_argument("--fwd-only", action="store_true", help="forward timings only (variants for the sweep)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="per-kernel ms of a step, busy and span")
    parser.add_argument("--trace", action="store_true", help="chrome trace of two steps per row, next to --out")
    parser.add_argument("--configs", default="", help="';'-separated configurations of the logit kernel to time "
                        "(BLOCK_N,BLOCK_K,warps,stages,persistent)")
    parser.add_argument("--gemm-rows", default="", help="','-separated chunk sizes for time_gemms")
    parser.add_argument("--softcap", type=float, default=None, help="a logit softcap (Gemma-2's is 30)")
    parser.add_argument("--metrics", action="store_true", help="the loss with its metrics (return_metrics=True)")
    parser.add_argument("--inputs", default="lm", choices=["lm", "uniform"],
                        help="bench.py's kinds of inputs: LM-like (peaked, Zipf-skewed) or uniform")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.softcap is not None:
        LOSS_OPTIONS["softcap"] = args.softcap
    flce, _ = load_flce()
    settings = sys.modules[flce.__name__ + "._settings"]
    # (variant, its settings) in order, repeats kept; a misspelt setting fails here, before any timing
    variants = [(variant, *split_variant(settings, variant)) for variant in args.variants.split(";")]
    records, env_info = [], environment()
    if args.gemm_rows:
        for row in args.rows.split(","):
            hidden_size, vocab_size, _, _ = ROWS[row]
            for rec in time_gemms(hidden_size, vocab_size, [int(r) for r in args.gemm_rows.split(",")]):
                print(json.dumps({"row": row, **rec}), flush=True)
                records.append({"row": row, **rec})
    for row in args.rows.split(","):
        hidden_size, vocab_size, n_tokens, dtype = ROWS[row]
        hidden, weight, targets = make_inputs(n_tokens, hidden_size, vocab_size, getattr(torch, dtype), args.inputs,
                                              ignored_share=ignore_fraction(row))
        ref = reference(hidden, weight, targets, softcap=args.softcap)
        flops = 2 * n_tokens * vocab_size * hidden_size
        for variant, changes, metrics in variants:
            LOSS_OPTIONS["return_metrics"] = args.metrics or metrics
            try:
                with settings.override(**changes):
                    fwd_ms, step_ms, step, (h, w) = step_and_fwd(flce, hidden, weight, targets, args.rep_ms,
                                                                 args.warmup_ms, args.fwd_only)
                    rec = {"row": row, "variant": variant, **LOSS_OPTIONS, "fwd_ms": fwd_ms,
                           "fwd_tflops": flops / fwd_ms / 1e9}
                    with torch.no_grad():
                        fwd_loss = loss_of(flce.fused_linear_cross_entropy(hidden, weight, targets, **LOSS_OPTIONS))
                    rec["fwd_loss_err"] = abs(fwd_loss.item() - ref[0].item()) / abs(ref[0].item())
                    if args.breakdown and step_ms is None:  # the forward's kernels (--fwd-only)

                        def fwd(inputs=(hidden, weight, targets)):
                            with torch.no_grad():
                                flce.fused_linear_cross_entropy(*inputs, **LOSS_OPTIONS)

                        rec["fwd_breakdown"] = kernel_breakdown(fwd)
                    if step_ms is not None:
                        trace = bool(args.trace and args.out) and variant == args.variants.split(";")[0]
                        rec.update(measure_step(flce, step, (h, w), targets, ref, step_ms, flops, args, row, trace))
            except Exception as e:  # a variant that fails to compile is a result
                rec = {"row": row, "variant": variant, "error": f"{type(e).__name__}: {e}"[:400]}
            print(json.dumps(rec), flush=True)
            records.append(rec)
            if args.out:
                Path(args.out).write_text(json.dumps({"environment": env_info, "records": records}, indent=1))
        for config in filter(None, args.configs.split(";")):
            rec = {"row": row, "config": config, **time_logit_kernel(flce, hidden, weight, targets, config)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
            if args.out:
                Path(args.out).write_text(json.dumps({"environment": env_info, "records": records}, indent=1))


def measure_step(flce, step, tensors, targets, ref, step_ms, flops, args, row, trace) -> dict:
    """A variant's training-step numbers: back-to-back time, extra memory, errors, and the
    profiles that ``args`` ask for (the chrome trace where ``trace``)."""
    h, w = tensors
    h.grad = w.grad = None
    loss = loss_of(flce.fused_linear_cross_entropy(h, w, targets, **LOSS_OPTIONS))
    loss.backward()
    rec = {"step_ms": step_ms, "loop_ms": back_to_back_ms(step), "step_extra_mib": step_extra_mib(step, (h, w)),
           "step_tflops_6nvh": 3 * flops / step_ms / 1e9,
           "loss_err": abs(loss.item() - ref[0].item()) / abs(ref[0].item()),
           "grad_hidden_err": rel_err(h.grad, ref[1]), "grad_weight_err": rel_err(w.grad, ref[2])}
    if args.breakdown:
        rec["breakdown"] = kernel_breakdown(step)
    if trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(Path(args.out).with_name(f"trace_{row}.json")))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    return rec


if __name__ == "__main__":
    main()
