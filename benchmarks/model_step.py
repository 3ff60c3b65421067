"""A transformers model's training step with this kernel's loss, against the same model's own.

    python benchmarks/model_step.py --out model-step.json [--layers 2] [--batch 4] [--seq 2048]

A ``LlamaForCausalLM`` built from a config with Llama-3-8B's sizes (hidden 4096, vocabulary
128256, 32 heads, 8 key-value heads, MLP 14336) and ``--layers`` decoder layers, random weights,
bf16 on CUDA (fp32 on a CPU, where ``--tiny`` shrinks it to a smoke test). Labels are the input
tokens with 10% of them -100. The same model, after ``patch_forward``, takes two paths:
``transformers`` (its own forward: logits, then its loss; ``fused_loss=False``) and
``fused-linear-ce`` (the patched forward: the backbone, then the fused loss). For each: the median
time of a step (forward + backward, no optimizer) after ``--warmup-ms`` of warm-up, its peak
memory above what was allocated before it, the loss, the same of an evaluation forward (``eval_*``:
``model.eval()`` under ``torch.no_grad()``, the loss alone), and on CUDA the GPU's clock and power during
the timing, its joules a step, and the profiler's busy time against the span of three steps back to
back (``bench.kernel_breakdown``): a patched model's step should keep the GPU as busy as the
model's own.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import GpuSampler, environment, joules_per_step, kernel_breakdown, load_flce  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, vocab_size=128256, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8)
TINY = dict(hidden_size=32, vocab_size=128, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def build(layers: int, seq: int, tiny: bool, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = TINY if tiny else LLAMA3_8B
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max(seq, 64), tie_word_embeddings=False,
                         **sizes)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a CPU init of 1.5e9 weights takes a while
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype).train()


def batch(model, n_batch: int, seq: int, device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    input_ids = torch.randint(0, model.config.vocab_size, (n_batch, seq), generator=g)
    labels = input_ids.clone()
    labels[torch.rand(labels.shape, generator=g) < 0.1] = -100
    return {"input_ids": input_ids.to(device), "labels": labels.to(device)}


def time_step(step, device: str, warmup_ms: float, rep_ms: float) -> float:
    """Median ms of ``step``: CUDA events through do_bench on a GPU, the host clock on a CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_mib(step, device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test, e.g. on a CPU)")
    parser.add_argument("--warmup-ms", type=float, default=1000)
    parser.add_argument("--rep-ms", type=float, default=1000)
    parser.add_argument("--trace", action="store_true",
                        help="a chrome trace (CPU and CUDA) of three steps per method, next to --out")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    flce, _ = load_flce()
    model = flce.patch_forward(build(args.layers, args.seq, args.tiny, device, dtype))
    inputs = batch(model, args.batch, args.seq, device)
    result = {"environment": environment() if device == "cuda" else {"device": "cpu"},
              "model": {"layers": args.layers, "batch": args.batch, "seq": args.seq, "tiny": args.tiny,
                        "dtype": str(dtype), **(TINY if args.tiny else LLAMA3_8B)},
              "results": []}
    for name, fused in (("transformers", False), ("fused-linear-ce", True)):
        def step(fused=fused):
            model.zero_grad(set_to_none=True)
            loss = model(**inputs, fused_loss=fused).loss
            loss.backward()
            return loss

        loss = step().item()  # compile, autotune
        entry = {"method": name, "loss": loss}
        if device == "cuda":
            with GpuSampler() as sampler:
                entry["step_ms"] = time_step(step, device, args.warmup_ms, args.rep_ms)
            entry["step_gpu"] = sampler.summary()
            entry["step_joules"] = joules_per_step(step, entry["step_ms"])
            anatomy = kernel_breakdown(step)
            entry.update(span_ms=anatomy["span_ms"], busy_ms=anatomy["busy_ms"],
                         busy_share=anatomy["busy_ms"] / anatomy["span_ms"] if anatomy["span_ms"] else None,
                         kernel_ms=anatomy["kernel_ms"], kernels_per_step=anatomy["kernels_per_step"],
                         largest_gaps_ms=anatomy["largest_gaps_ms"])
        else:
            entry["step_ms"] = time_step(step, device, args.warmup_ms, args.rep_ms)
        if args.trace and args.out and device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(Path(args.out).with_name(f"trace_{name}.json")))
        model.zero_grad(set_to_none=True)
        entry["step_peak_mib"] = peak_mib(step, device)

        def evaluate(fused=fused):
            with torch.no_grad():
                return model(**inputs, fused_loss=fused).loss

        model.eval()
        entry["eval_loss"] = evaluate().item()
        entry["eval_ms"] = time_step(evaluate, device, args.warmup_ms, args.rep_ms)
        entry["eval_peak_mib"] = peak_mib(evaluate, device)
        model.train()
        result["results"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k not in ("kernel_ms", "largest_gaps_ms")}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    ours, theirs = (next(r for r in result["results"] if r["method"] == m) for m in ("fused-linear-ce", "transformers"))
    print(f"step {ours['step_ms']:.2f} ms against transformers' {theirs['step_ms']:.2f} "
          f"({ours['step_ms'] / theirs['step_ms']:.2f}); loss {ours['loss']:.5f} against {theirs['loss']:.5f}; "
          f"evaluation forward {ours['eval_ms']:.2f} ms against {theirs['eval_ms']:.2f} "
          f"({ours['eval_ms'] / theirs['eval_ms']:.2f})")


if __name__ == "__main__":
    main()
