"""TRL's trainers on CUDA with fused-linear-ce's head (``flce.trl.use_in_trl()``) against TRL's own.

1. The trainer checks of tests/integrations/test_trl.py (SFT, DFT, DPO, KTO, GRPO, RLOO on a tiny random Llama),
   with a float32 model under ``bf16=True`` autocast, as TRL and transformers train in bf16.
2. One SFTTrainer step on a 2-layer Llama-3-shaped model (vocab 128256, hidden 4096, intermediate
   14336, 32 heads, 8 kv heads, bf16 weights, batch 4 x 2048 random tokens with a quarter of the
   labels -100): the median time of the measured steps after warm-up and the peak memory, with
   TRL's head, then with ours.
3. A GRPO-shaped step on the same model through TRL's glue (``add_fused_lm_head`` at temperature
   0.7, log-probs and entropy): GRPOTrainer's loss on given completions (the first iteration's
   importance ratio exp(log p - log p.detach()), per-sequence advantages, the entropy bonus 0.01),
   its backward and an SGD step; no generation. Both heads in alternating laps; ours keeps rows at
   its default budget (``--grpo-keep-mib`` sets FLCE_KEEP_MIB's value instead).
4. A DistillationTrainer-shaped step: the same 2-layer student against a frozen 2-layer teacher of the
   same shape (another seed), the completions three quarters of each sequence, through TRL's own
   ``_chunked_divergence_loss`` (beta 1, TRL's default) with TRL's kernel or ours (``use_in_trl``
   replaces it), backward and SGD; both heads in alternating laps.

Writes one JSON (GPU, versions, date, command, each check, each head's ms and MiB, ratios) and
exits 1 if a check failed. No network: the kernel is this checkout (LOCAL_KERNELS).

    python scripts/trl_gpu.py --out trl_gpu.json
    python scripts/trl_gpu.py --cpu-smoke --out /tmp/trl_smoke.json   # the same logic, tiny, on the CPU

``--accuracy DEVICE`` instead prints the bf16 accuracy of TRL's fused-head kernel and of
``flce.trl.FusedLogProbs`` against float64 (the numbers of docs/integrations.md; on a CPU the
kernel's PyTorch path, on cuda the Triton kernels):

    python scripts/trl_gpu.py --accuracy cpu
"""

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# bf16 autocast: both heads take the same hidden states and weights, but each rounds its own way
# (which products run in bf16, whether the logits are rounded to bf16 before the softmax): per-token
# log-probs and entropies then differ by about 2^-8 of the logits, and so do the losses, the
# metrics and the gradients; parameters after two SGD steps differ by lr times that.
BF16_REL = 3e-2
# One near-tie rounded the other way flips a token's top-1 or one of DPO's 4 pairs per batch.
BF16_FRACTION_TOL = 0.25
FP32_REL = 1e-5  # the CPU smoke run: float32, as tests/test_trl.py

LLAMA3_2_LAYERS = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                       num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False)
TINY_SHAPES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   tie_word_embeddings=False)


def worst_differences(reference, run) -> dict:
    """The largest relative difference of each logged key over the steps, and of the parameters."""
    worst = {}
    for ref, got in zip(reference.logs, run.logs, strict=False):  # a failed run may log less
        for key, value in ref.items():
            if key in got:
                diff = abs(got[key] - value) / max(abs(value), 1e-12)
                worst[key] = max(worst.get(key, 0.0), diff)
    worst["parameters"] = max(
        ((run.params[n].double() - p.double()).abs().max() / p.abs().max().clamp_min(1e-30)).item()
        for n, p in reference.params.items())
    return worst


def check_trainers(flce, kinds, workdir: Path, cpu: bool) -> list[dict]:
    """Each trainer with TRL's head and with ours, from the same checkpoint: the comparison of
    tests/test_trl.py, with the bf16 tolerances on CUDA."""
    from _tiny import GENERATING, assert_runs_match, save_tiny_checkpoint, train_trl

    checkpoint = save_tiny_checkpoint(workdir / "tiny-llama")
    records = []
    for kind in kinds:
        # bf16: after the first step the two runs' weights differ by bf16 rounding, enough to
        # sample other completions: the generating trainers compare their first step only
        steps = 3 if cpu else (1 if kind in GENERATING else 2)
        record = {"trainer": kind, "steps": steps}
        start = time.perf_counter()
        try:
            device = dict(use_cpu=cpu, bf16=not cpu, steps=steps)
            reference = train_trl(kind, checkpoint, workdir / f"{kind}-trl", **device)
            fused = train_trl(kind, checkpoint, workdir / f"{kind}-flce", use_in_trl=flce.trl.use_in_trl, **device)
            record["worst_rel_difference"] = worst_differences(reference, fused)
            record["last_log"] = reference.logs[-1]
            assert fused.head.__module__ == f"{flce.__name__}.trl", f"the head was {fused.head!r}"
            assert fused.head_calls and fused.head_calls == reference.head_calls, "other head calls"
            if cpu:
                assert_runs_match(reference, fused, FP32_REL)
            else:
                assert_runs_match(reference, fused, BF16_REL, fraction_tol=BF16_FRACTION_TOL)
            record["ok"] = True
        except Exception as error:  # recorded, and the next trainer runs
            record.update(ok=False, error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
        record["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({k: v for k, v in record.items() if k != "traceback"}, default=str), flush=True)
        records.append(record)
    return records


def sft_step_dataset(vocab_size: int, seq_len: int, num_rows: int, prompt_fraction: float):
    """Random token ids, the first ``prompt_fraction`` of each row a prompt (labels -100)."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    prompt = int(seq_len * prompt_fraction)
    ids = torch.randint(3, vocab_size, (num_rows, seq_len), generator=g).tolist()
    mask = [0] * prompt + [1] * (seq_len - prompt)
    return Dataset.from_dict({"input_ids": ids, "completion_mask": [mask] * num_rows})


def time_sft_step(flce, ours: bool, shapes: dict, batch: int, seq_len: int, warmup: int, steps: int,
                  workdir: Path, cpu: bool) -> dict:
    """Median wall time of one SFTTrainer optimizer step (synchronized) over ``steps`` steps after
    ``warmup`` ones, and the peak memory allocated during the measured steps."""
    import torch
    from _tiny import trl_example
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    device = "cpu" if cpu else "cuda"

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ms, self.start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            if state.global_step == warmup and not cpu:
                gc.collect()  # as in timed_steps: no model of the lap before in this lap's peak
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            if state.global_step > warmup:  # global_step counts the step just done
                self.ms.append((time.perf_counter() - self.start) * 1e3)

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(pad_token_id=0, **shapes)).to(torch.bfloat16)
    dataset = sft_step_dataset(shapes["vocab_size"], seq_len, batch * (warmup + steps), prompt_fraction=0.25)
    args = SFTConfig(
        output_dir=str(workdir / ("sft-flce" if ours else "sft-trl")), max_steps=warmup + steps,
        per_device_train_batch_size=batch, max_length=seq_len, optim="sgd", learning_rate=1e-5, bf16=not cpu,
        use_cpu=cpu, logging_steps=warmup + steps, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_drop_last=True,
    )
    # the data is tokenized: the tokenizer only pads (and names the pad token)
    _, tokenizer, _ = trl_example().tiny_setup(num_examples=1)
    timer = StepTimer()
    if ours:
        flce.trl.use_in_trl()
    try:
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[timer])
        trainer.train()
    finally:
        if ours:
            flce.trl.use_in_trl(False)
    assert len(timer.ms) == steps, timer.ms
    result = {"ms": round(statistics.median(timer.ms), 3), "ms_each": [round(t, 3) for t in timer.ms],
              "peak_mib": None if cpu else round(torch.cuda.max_memory_allocated() / 2**20, 1),
              "loss": trainer.state.log_history[0].get("loss"),
              "gradient_checkpointing": args.gradient_checkpointing}
    del trainer, model
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    print(json.dumps({"head": "flce" if ours else "trl", **result}), flush=True)
    return result


GRPO_TEMPERATURE, GRPO_ENTROPY_COEF = 0.7, 0.01


def timed_steps(flce, ours: bool, step, warmup: int, steps: int, cpu: bool, head: str, **recorded) -> dict:
    """Runs ``step()`` (one optimizer step, returning its loss) ``warmup + steps`` times with our
    head (``use_in_trl``) or TRL's, each synchronized: the median wall time of the last ``steps``,
    each one, their peak memory and the last loss, with ``recorded`` beside them."""
    import torch

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    ms = []
    if ours:
        flce.trl.use_in_trl()
    try:
        for index in range(warmup + steps):
            if index == warmup and not cpu:
                # the peak of these steps alone: a model of the lap before, held by reference cycles
                # until a collection, would otherwise count in this lap's peak
                gc.collect()
                torch.cuda.reset_peak_memory_stats()
            sync()
            start = time.perf_counter()
            loss = step()
            sync()
            if index >= warmup:
                ms.append((time.perf_counter() - start) * 1e3)
    finally:
        if ours:
            flce.trl.use_in_trl(False)
    result = {"ms": round(statistics.median(ms), 3), "ms_each": [round(t, 3) for t in ms],
              "peak_mib": None if cpu else round(torch.cuda.max_memory_allocated() / 2**20, 1),
              "loss": loss.item(), **recorded}
    del loss
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    print(json.dumps({"head": "flce" if ours else "trl", "step": head, **result}), flush=True)
    return result


def time_grpo_step(flce, ours: bool, shapes: dict, batch: int, seq_len: int, warmup: int, steps: int, cpu: bool,
                   keep_mib: int | None = None) -> dict:
    """``timed_steps`` of a GRPO-shaped optimizer step through TRL's fused LM head
    (``add_fused_lm_head``): a quarter of each sequence a prompt (labels -100), each completion its
    advantage, the loss GRPOTrainer's at its first iteration with an entropy bonus, then backward and SGD."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    device = "cpu" if cpu else "cuda"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(pad_token_id=0, **shapes)).to(torch.bfloat16)
    add_fused_lm_head(model, temperature=GRPO_TEMPERATURE, outputs=("log_probs", "entropy"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, shapes["vocab_size"], (batch, seq_len), generator=g).to(device)
    labels = input_ids.clone()
    labels[:, : seq_len // 4] = -100  # the prompts
    advantages = torch.randn(batch, 1, generator=g).to(device)

    def step():
        out = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
        mask = out.label_mask.float()
        ratio = torch.exp(out.log_probs - out.log_probs.detach())
        per_token = -ratio * advantages - GRPO_ENTROPY_COEF * out.entropy
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    settings = sys.modules[flce.__name__ + "._settings"]
    with settings.override(keep_mib=keep_mib) if ours and keep_mib is not None else contextlib.nullcontext():
        return timed_steps(flce, ours, step, warmup, steps, cpu, "grpo", keep_mib=keep_mib if ours else None)


def time_distill_step(flce, ours: bool, shapes: dict, batch: int, seq_len: int, warmup: int, steps: int,
                      cpu: bool) -> dict:
    """``timed_steps`` of a DistillationTrainer-shaped optimizer step: the student's and the frozen
    teacher's backbones, TRL's ``_chunked_divergence_loss`` over the completion tokens (the last three
    quarters of each sequence) at beta 1, then backward and SGD on the student."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer import distillation_trainer

    device = "cpu" if cpu else "cuda"
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.device(device):
            models.append(LlamaForCausalLM(LlamaConfig(pad_token_id=0, **shapes)).to(torch.bfloat16))
    student, teacher = models
    teacher.requires_grad_(False)
    optimizer = torch.optim.SGD(student.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, shapes["vocab_size"], (batch, seq_len), generator=g).to(device)
    completion_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
    completion_mask[:, : seq_len // 4] = 0  # the prompts

    def step():
        student_hidden = student.model(input_ids=input_ids).last_hidden_state
        with torch.no_grad():
            teacher_hidden = teacher.model(input_ids=input_ids).last_hidden_state
        loss, _, _ = distillation_trainer._chunked_divergence_loss(
            student_hidden, teacher_hidden, student.lm_head.weight, teacher.lm_head.weight, completion_mask, 1.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return timed_steps(flce, ours, step, warmup, steps, cpu, "distill")


def alternating_laps(run, laps: int) -> dict:
    """``run(head)`` for the heads "trl" and "flce" in alternating order over ``laps`` laps (trl,
    flce, flce, trl, ...): each head's results with the median of all its steps, and the ratios."""
    results = {"trl": [], "flce": []}
    for lap in range(laps):
        for head in ("trl", "flce") if lap % 2 == 0 else ("flce", "trl"):
            results[head].append(run(head))
    timing = {}
    for head, runs in results.items():
        ms_each = [t for result in runs for t in result["ms_each"]]
        peaks = [result["peak_mib"] for result in runs]
        timing[head] = {**runs[0], "ms": round(statistics.median(ms_each), 3), "ms_each": ms_each,
                        "peak_mib": None if None in peaks else max(peaks), "lap_ms": [r["ms"] for r in runs]}
    timing["laps"] = laps
    pairs = zip(results["trl"], results["flce"], strict=True)
    timing["lap_ratios_ms"] = [round(f["ms"] / t["ms"], 4) for t, f in pairs]
    timing["ratio_ms"] = round(timing["flce"]["ms"] / timing["trl"]["ms"], 4)
    if timing["trl"]["peak_mib"] is not None:
        timing["ratio_mib"] = round(timing["flce"]["peak_mib"] / timing["trl"]["peak_mib"], 4)
    return timing


def bf16_accuracy(device: str, shape: tuple[int, int, int]) -> None:
    """Prints the largest error of a log-prob and of an entropy of both heads, for logits of O(1)
    and O(4): both get the same bf16 hidden states and weight, the reference is float64 from those
    rounded inputs."""
    import torch
    from kernels import get_local_kernel
    from trl.kernels import ChunkedLogProbFunction

    flce = get_local_kernel(ROOT / "build" / ("torch-cuda" if device == "cuda" else "torch-cpu"))
    n, h, v = shape
    torch.manual_seed(0)
    for scale in (1.0, 4.0):
        hidden = torch.randn(n, h, device=device).bfloat16()
        weight = (torch.randn(v, h, device=device) * scale / h**0.5).bfloat16()
        targets = torch.randint(0, v, (n,), device=device)
        log_p = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1)
        expected = log_p.gather(1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
        for name, kernel in (("TRL", ChunkedLogProbFunction), ("fused-linear-ce", flce.trl.FusedLogProbs)):
            out = kernel.apply(hidden, weight, None, targets, 1.0, 128, None, 1.0, ("entropy",))
            errors = [(got.double() - want).abs().max().item() for got, want in zip(out[:2], expected, strict=True)]
            print(f"{device} logits O({scale:g}) {name:>16}: log_probs {errors[0]:.1e}  entropy {errors[1]:.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON to write (needed but with --accuracy)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks the logic")
    parser.add_argument("--trainers", default="sft,dft,dpo,kto,grpo,rloo", help="comma-separated, for part 1")
    parser.add_argument("--no-checks", action="store_true", help="skip part 1")
    parser.add_argument("--no-timing", action="store_true", help="skip part 2")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (3; 1 with --cpu-smoke)")
    parser.add_argument("--steps", type=int, default=None, help="steps timed (10; 2 with --cpu-smoke)")
    parser.add_argument("--laps", type=int, default=1, help="part 2's runs of each head, in alternating order")
    parser.add_argument("--no-grpo", action="store_true", help="skip part 3")
    parser.add_argument("--grpo-laps", type=int, default=4, help="part 3's runs of each head, in alternating order")
    parser.add_argument("--no-distill", action="store_true", help="skip part 4")
    parser.add_argument("--distill-laps", type=int, default=4, help="part 4's runs of each head, alternating")
    parser.add_argument("--grpo-keep-mib", type=int, default=None,
                        help="part 3: FLCE_KEEP_MIB for our head (default: the package's budget)")
    parser.add_argument("--accuracy", metavar="DEVICE", help="print the bf16 accuracy of both heads on DEVICE, only")
    parser.add_argument("--accuracy-shape", type=int, nargs=3, default=(512, 256, 4096), metavar=("N", "H", "V"))
    args = parser.parse_args()
    if args.accuracy is None and args.out is None:
        parser.error("--out is needed")
    cpu = args.cpu_smoke or args.accuracy == "cpu"
    if cpu:
        os.environ["TRITON_INTERPRET"] = "0"  # CPU tensors take the PyTorch path, before triton is imported
    if args.accuracy is not None:
        return bf16_accuracy(args.accuracy, args.accuracy_shape)

    import torch
    from _tiny import trl_example

    if not cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke on the CPU")
    flce = trl_example().load_kernel()
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": "cpu-smoke" if cpu else torch.cuda.get_device_name(),
        "versions": {name: version(name) for name in ("torch", "triton", "trl", "transformers", "accelerate")},
    }
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if not args.no_checks:
            record["tolerances"] = ({"rel": FP32_REL} if cpu else
                                    {"rel": BF16_REL, "fractions": BF16_FRACTION_TOL, "autocast": "bf16"})
            record["checks"] = check_trainers(flce, args.trainers.split(","), workdir, cpu)
            failed = not all(c["ok"] for c in record["checks"])
        if not args.no_timing:
            shapes = TINY_SHAPES if cpu else LLAMA3_2_LAYERS
            batch, seq_len = (2, 64) if cpu else (4, 2048)
            warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
            steps = args.steps if args.steps is not None else (2 if cpu else 10)
            timing = {"model": shapes, "batch": batch, "seq_len": seq_len, "ignored_label_fraction": 0.25,
                      "dtype": "bfloat16", "optimizer": "sgd", "warmup_steps": warmup, "timed_steps": steps}
            # laps in alternating order (trl, flce, flce, trl, ...): a drift of the clock under the power
            # cap weighs on both heads alike; each head's ms is the median of all its laps' steps
            laps = {"trl": [], "flce": []}
            for lap in range(args.laps):
                for head in ("trl", "flce") if lap % 2 == 0 else ("flce", "trl"):
                    laps[head].append(time_sft_step(flce, head == "flce", shapes, batch, seq_len, warmup, steps,
                                                    workdir, cpu))
            for head, results in laps.items():
                ms_each = [t for result in results for t in result["ms_each"]]
                timing[head] = {**results[0], "ms": round(statistics.median(ms_each), 3), "ms_each": ms_each,
                                "peak_mib": None if cpu else max(result["peak_mib"] for result in results),
                                "lap_ms": [result["ms"] for result in results]}
            timing["laps"] = args.laps
            timing["lap_ratios_ms"] = [round(f["ms"] / t["ms"], 4)
                                       for t, f in zip(laps["trl"], laps["flce"], strict=True)]
            timing["ratio_ms"] = round(timing["flce"]["ms"] / timing["trl"]["ms"], 4)
            if not cpu:
                timing["ratio_mib"] = round(timing["flce"]["peak_mib"] / timing["trl"]["peak_mib"], 4)
            record["sft_step"] = timing
        if not args.no_grpo:
            shapes = TINY_SHAPES if cpu else LLAMA3_2_LAYERS
            batch, seq_len = (2, 64) if cpu else (4, 2048)
            warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
            steps = args.steps if args.steps is not None else (2 if cpu else 10)
            grpo = alternating_laps(lambda head: time_grpo_step(flce, head == "flce", shapes, batch, seq_len, warmup,
                                                                steps, cpu, args.grpo_keep_mib), args.grpo_laps)
            record["grpo_step"] = {"model": shapes, "batch": batch, "seq_len": seq_len, "prompt_fraction": 0.25,
                                   "temperature": GRPO_TEMPERATURE, "entropy_coef": GRPO_ENTROPY_COEF,
                                   "dtype": "bfloat16", "warmup_steps": warmup, "timed_steps": steps, **grpo}
        if not args.no_distill:
            shapes = TINY_SHAPES if cpu else LLAMA3_2_LAYERS
            batch, seq_len = (2, 64) if cpu else (4, 2048)
            warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
            steps = args.steps if args.steps is not None else (2 if cpu else 10)
            distill = alternating_laps(lambda head: time_distill_step(flce, head == "flce", shapes, batch, seq_len,
                                                                      warmup, steps, cpu), args.distill_laps)
            record["distill_step"] = {"model": shapes, "teacher": shapes, "batch": batch, "seq_len": seq_len,
                                      "prompt_fraction": 0.25, "beta": 1.0, "dtype": "bfloat16",
                                      "warmup_steps": warmup, "timed_steps": steps, **distill}
    Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {args.out}" + (" (a check failed)" if failed else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
