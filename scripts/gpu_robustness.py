"""GPU robustness campaign: index arithmetic past 2^31, a random-case fuzz against float64,
determinism across calls and processes, and leaks over many steps. Writes one JSON.

    python scripts/gpu_robustness.py --out robustness.json [--fuzz-cases 2000] [--fuzz-seconds 200]
"""

import argparse
import datetime
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the fuzz (interpreter)
os.environ.setdefault("LOCAL_KERNELS", f"qgallouedec/fused-linear-ce={ROOT}")


def load():
    from kernels import get_kernel

    return get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---- huge shapes --------------------------------------------------------------------------
def chunked_reference(hidden, weight, targets, rows=2048):
    """fp32 loss (mean), correct count, and grads by chunks of rows (no N x V tensor)."""
    w = weight.float()
    grad_w = torch.zeros_like(w)
    grad_h = torch.empty(hidden.shape, device=hidden.device, dtype=torch.float32)
    n_valid = (targets != -100).sum()
    loss = torch.zeros((), device=hidden.device, dtype=torch.float64)
    correct = 0
    for start in range(0, hidden.shape[0], rows):
        h = hidden[start:start + rows].float().requires_grad_()
        wc = w.detach().requires_grad_()
        logits = h @ wc.T
        t = targets[start:start + rows]
        part = F.cross_entropy(logits, t, reduction="sum") / n_valid
        part.backward()
        grad_h[start:start + rows] = h.grad
        grad_w += wc.grad
        loss += part.detach().double()
        correct += int(((logits.argmax(-1) == t) & (t != -100)).sum())
    return loss, correct, grad_h, grad_w


def huge_shapes(flce):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    # (name, N, H, V): hidden past 2^31 elements, weight past 2^31, N x V far past it
    for name, n, h, v in [("hidden N*H > 2^31", 524288, 4096 + 16, 512),
                          ("weight V*H > 2^31", 512, 4096, 524288 + 16),
                          ("N*V >> 2^31", 65536, 256, 65536 + 8)]:
        g = torch.Generator(device="cuda").manual_seed(1)
        hidden = (torch.randn(n, h, device="cuda", generator=g) / h**0.5).bfloat16()
        weight = torch.randn(v, h, device="cuda", generator=g).bfloat16()
        targets = torch.randint(0, v, (n,), device="cuda", generator=g)
        targets[::7] = -100
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        t0 = time.time()
        loss, metrics = flce.fused_linear_cross_entropy(hh, ww, targets, return_metrics=True)
        loss.backward()
        torch.cuda.synchronize()
        seconds = time.time() - t0
        ref_loss, ref_correct, ref_gh, ref_gw = chunked_reference(hidden, weight, targets)
        rec = {"case": name, "N": n, "H": h, "V": v, "seconds": seconds,
               "loss_rel_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
               "num_correct": int(metrics["num_correct_tokens"]), "ref_num_correct": ref_correct,
               "grad_hidden_rel_err": rel(hh.grad, ref_gh), "grad_weight_rel_err": rel(ww.grad, ref_gw)}
        # bf16 inputs: loss within 1e-3, grads within 2e-2 (bf16 rounding of grad logits and grads);
        # argmax can flip on near-ties between the fp32 accumulations, so allow a few in a million
        argmax_slack = max(2, n // 100000)
        rec["ok"] = (rec["loss_rel_err"] < 1e-3 and rec["grad_hidden_rel_err"] < 2e-2
                     and rec["grad_weight_rel_err"] < 2e-2 and abs(rec["num_correct"] - ref_correct) <= argmax_slack)
        print(json.dumps(rec), flush=True)
        results.append(rec)
        del hidden, weight, hh, ww, ref_gh, ref_gw
        torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = prev
    return results


# ---- fuzz ---------------------------------------------------------------------------------
# A handful of shape classes (Triton compiles one kernel per divisibility pattern and flag
# set) with values varying inside each, so that thousands of cases need few compilations.
SHAPES = [(1, 40, 997), (301, 80, 2003), (128, 64, 4096)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OPTION_SETS = [
    {},
    {"return_metrics": True},
    {"return_metrics": True, "softcap": 5.0, "logit_scale": 0.7},
    {"label_smoothing": 0.1, "z_loss_scale": 1e-3, "bias": True},
    {"return_metrics": True, "bias": True, "softcap": 30.0},
]
TOL = {torch.float32: (2e-4, 2e-3), torch.float16: (2e-3, 2e-2), torch.bfloat16: (1e-2, 5e-2)}  # (loss, grads)


def fuzz_case(flce, rng):
    n, h, v = rng.choice(SHAPES)
    dtype = rng.choice(DTYPES)
    opts = {"return_metrics": False, **rng.choice(OPTION_SETS), "reduction": rng.choice(["mean", "sum", "none"])}
    use_bias = opts.pop("bias", False)
    # values vary freely inside a set (scalars are not compiled in)
    if "softcap" in opts:
        opts["softcap"] = rng.choice([1.0, 5.0, 30.0])
    if "logit_scale" in opts:
        opts["logit_scale"] = rng.choice([0.0, 0.3, 2.0])
    if "label_smoothing" in opts:
        opts["label_smoothing"] = rng.choice([0.05, 0.3])
    seed = rng.randrange(2**31)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    scale = rng.choice([0.5, 1.0, 3.0])
    hidden = (torch.randn(n, h, device=DEVICE, generator=g) * scale / h**0.25).to(dtype)
    weight = (torch.randn(v, h, device=DEVICE, generator=g) / h**0.25).to(dtype)
    bias = torch.randn(v, device=DEVICE, generator=g).to(dtype) if use_bias else None
    targets = torch.randint(0, v, (n,), device=DEVICE, generator=g)
    targets[torch.rand(n, device=DEVICE, generator=g) < rng.choice([0.0, 0.1, 0.5])] = -100

    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    bb = bias.clone().requires_grad_() if bias is not None else None
    out = flce.fused_linear_cross_entropy(hh, ww, targets, bb, **opts)
    loss, metrics = out if opts["return_metrics"] else (out, None)
    grad_out = torch.rand(loss.shape, device=DEVICE, generator=g) + 0.5
    (loss * grad_out).sum().backward()

    # float64 reference on the same (rounded) inputs
    rh, rw = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rb = bias.double().requires_grad_() if bias is not None else None
    z = (rh @ rw.T + (rb if rb is not None else 0)) * opts.get("logit_scale", 1.0)
    if "softcap" in opts:
        z = opts["softcap"] * torch.tanh(z / opts["softcap"])
    valid = targets != -100
    per_row = F.cross_entropy(z, targets, reduction="none", label_smoothing=opts.get("label_smoothing", 0.0))
    per_row = per_row + opts.get("z_loss_scale", 0.0) * z.logsumexp(-1) ** 2 * valid
    ref = {"none": per_row, "sum": per_row.sum(), "mean": per_row.sum() / valid.sum()}[opts["reduction"]]
    (ref * grad_out.double()).sum().backward()
    loss_tol, grad_tol = TOL[dtype]
    failures = []
    if valid.any():
        if rel(loss, ref) > loss_tol:
            failures.append(f"loss {rel(loss, ref):.2e}")
        pairs = [("grad_hidden", hh.grad, rh.grad), ("grad_weight", ww.grad, rw.grad)]
        if bb is not None:
            pairs.append(("grad_bias", bb.grad, rb.grad))
        for name, got, want in pairs:
            if got is not None and want.norm() > 0 and rel(got, want) > grad_tol:
                failures.append(f"{name} {rel(got, want):.2e}")
        if metrics is not None:
            p = z.softmax(-1)
            ent = -(p * p.clamp_min(1e-300).log()).sum(-1)[valid].sum()
            if abs(metrics["entropy_sum"].item() - ent.item()) > loss_tol * max(1.0, abs(ent.item())) * 10:
                failures.append("entropy")
            # argmax may differ from float64's only where the top two logits nearly tie
            top2 = z.detach().topk(min(2, v), dim=-1).values
            near_tie = ((top2[:, 0] - top2[:, -1]).abs() < 1e-2 * (1 + top2[:, 0].abs())) & valid
            exact = int(((z.argmax(-1) == targets) & valid).sum())
            if abs(int(metrics["num_correct_tokens"]) - exact) > int(near_tie.sum()):
                failures.append("num_correct")
    elif opts["reduction"] == "mean" and not torch.isnan(loss):
        failures.append("all ignored mean is not NaN")
    return {"shape": (n, h, v), "dtype": str(dtype), "opts": opts, "bias": use_bias, "seed": seed,
            "failures": failures}


def fuzz(flce, cases, seconds, seed=1234):
    rng = random.Random(seed)
    t0 = time.time()
    done, failed = 0, []
    while done < cases and time.time() - t0 < seconds:
        rec = fuzz_case(flce, rng)
        done += 1
        if rec["failures"]:
            failed.append(rec)
            print("FUZZ FAILURE", json.dumps(rec, default=str), flush=True)
    summary = {"cases": done, "failed": len(failed), "seconds": time.time() - t0, "failures": failed[:20]}
    print("fuzz:", json.dumps({k: summary[k] for k in ("cases", "failed", "seconds")}), flush=True)
    return summary


def parallel_fuzz(args):
    """The fuzz in several processes with their own seeds; the summaries added up."""
    parts = [Path(args.out).with_name(f"fuzz_{k}.json") for k in range(args.fuzz_workers)]
    share = -(-args.fuzz_cases // args.fuzz_workers)
    procs = [subprocess.Popen([sys.executable, __file__, "--fuzz-only", "--seed", str(1000 + k), "--fuzz-cases",
                               str(share), "--fuzz-seconds", str(args.fuzz_seconds), "--out", str(part)])
             for k, part in enumerate(parts)]
    for proc in procs:
        proc.wait()
    summaries = [json.loads(p.read_text()) for p in parts if p.exists()]
    total = {"cases": sum(s["cases"] for s in summaries), "failed": sum(s["failed"] for s in summaries),
             "seconds": max((s["seconds"] for s in summaries), default=0.0), "workers": len(summaries),
             "failures": [f for s in summaries for f in s["failures"]][:20]}
    for p in parts:
        p.unlink(missing_ok=True)
    print("fuzz:", json.dumps({k: total[k] for k in ("cases", "failed", "seconds", "workers")}), flush=True)
    return total


# ---- determinism and leaks ----------------------------------------------------------------
def step_digest(flce, repeat):
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    weight = torch.randn(50000, 2048, device="cuda", generator=g).bfloat16() / 40
    targets = torch.randint(0, 50000, (4096,), device="cuda", generator=g)
    digests = set()
    for _ in range(repeat):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, m = flce.fused_linear_cross_entropy(h, w, targets, return_metrics=True)
        loss.backward()
        d = hashlib.sha256()
        for t in (loss, m["num_correct_tokens"], m["entropy_sum"], h.grad, w.grad):
            d.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        digests.add(d.hexdigest())
    return digests


def leaks(flce, steps):
    hidden = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(3000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 3000, (512,), device="cuda")
    # PyTorch keeps a cuBLAS workspace (32 MiB on Hopper) from a process's first matrix
    # product on: taken here, as any model's first layer would, so that it is not counted.
    torch.mm(hidden, weight.T)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    initial = torch.cuda.memory_allocated()
    # the same call as the loop's first: compilation and autotuning (a shape not seen before
    # in this process) run here, and must not keep buffers alive
    flce.fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)[0].backward()
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(steps):
        loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)
        loss.backward()
        hidden.grad = weight.grad = None
    del loss, metrics  # the last step's outputs, which the caller would hold
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    blocks = live_blocks()
    torch.cuda.memory._record_memory_history(enabled=None)
    return {"steps": steps, "allocated_initial": initial, "allocated_after_first_call": before,
            "allocated_after": after, "ok": initial == before == after, "live_blocks": blocks}


def live_blocks(limit: int = 12) -> list:
    """The live allocations recorded since _record_memory_history started, with the Python
    frames that made them: names what a first call or a loop kept."""
    snapshot = torch.cuda.memory._snapshot()
    blocks = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in block.get("frames", [])
                      if f["filename"].endswith(".py")][:6]
            blocks.append({"bytes": block["size"], "frames": frames})
    return sorted(blocks, key=lambda b: b["bytes"])[:limit]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="robustness.json")
    parser.add_argument("--fuzz-cases", type=int, default=2000)
    parser.add_argument("--fuzz-seconds", type=float, default=240)
    parser.add_argument("--digest-only", action="store_true", help="print a digest of one step (subprocess check)")
    parser.add_argument("--fuzz-only", action="store_true")
    parser.add_argument("--fuzz-workers", type=int, default=4,
                        help="processes sharing the cases (they compile in parallel)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--parts", default="huge,fuzz,determinism,leaks",
                        help="comma-separated subset of huge, fuzz, determinism, leaks")
    args = parser.parse_args()
    flce = load()
    # one configuration of the logit kernel: the fuzz compiles fewer variants
    one_config = sys.modules[f"{flce.__name__}._settings"].override(autotune=False)
    if args.fuzz_only:
        with one_config:
            summary = fuzz(flce, args.fuzz_cases, args.fuzz_seconds, args.seed)
        Path(args.out).write_text(json.dumps(summary, default=str))
        return
    if args.digest_only:
        print(next(iter(step_digest(flce, 1))))
        return
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "command": " ".join(sys.argv)}
    parts = args.parts.split(",")
    with one_config:
        if "huge" in parts:
            record["huge_shapes"] = huge_shapes(flce)
        if "fuzz" in parts:
            record["fuzz"] = parallel_fuzz(args)
    if "determinism" in parts:
        in_process = step_digest(flce, 20)
        other = subprocess.run([sys.executable, __file__, "--digest-only"], capture_output=True, text=True)
        record["determinism"] = {"repeats": 20, "distinct_digests_in_process": len(in_process),
                                 "same_across_processes": other.stdout.strip() in in_process,
                                 "subprocess_stderr": other.stderr[-500:] if other.returncode else ""}
        print("determinism:", json.dumps(record["determinism"]), flush=True)
    if "leaks" in parts:
        record["leaks"] = leaks(flce, 1000)
        print("leaks:", json.dumps(record["leaks"]), flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
