"""A training run as users make one: a Llama-style model with a 128k vocabulary, FSDP2 over every
GPU, bf16, trained twice from the same initialisation on the same batches, once with the fused
loss (``patch_forward``) and once with the model's own logits loss.

    torchrun --nproc-per-node 2 scripts/train_fsdp.py --out gpu-out            # S = 4096, 200 steps
    torchrun --nproc-per-node 2 scripts/train_fsdp.py --max-seq --out gpu-out  # what each variant holds
    torchrun --nproc-per-node 2 scripts/train_fsdp.py --tiny --device cpu --out /tmp/flce-train  # smoke test

Training writes ``<out>/train_fsdp.json`` (per variant: the global loss of every step, step time,
tokens per second, peak memory of every GPU) and ``<out>/train_fsdp_loss.png`` (the two loss
curves and their difference). ``--max-seq`` writes ``<out>/train_fsdp_maxseq.json``: the longest
sequence (batch 1) that each variant trains on, and at the logits loss's longest sequence, the
largest batch of each, i.e. the tokens per GPU. ``--tiny --device cpu`` runs everything on CPU
processes over gloo at a toy size (fp32), to check the script end to end.

Model (``--config`` takes a JSON of LlamaConfig arguments instead): hidden 768, 12 layers, 12 heads
(4 key-value heads), MLP 2048, vocabulary 128256, untied lm_head: 272M parameters, 197M of them in
the embedding and lm_head. Every decoder layer and the lm_head are FSDP2 units of their own, in
bf16 with fp32 gradient reduction (MixedPrecisionPolicy); AdamW (0.9, 0.95), weight decay 0.1,
gradient clipping at 1, learning rate 6e-4 after a linear warm-up. Data: a generated language
over the whole vocabulary, different on every rank: even positions draw from a Zipf law (as word
frequencies do), odd ones repeat a fixed successor of the token before, 9 times out of 10.
Data parallelism as documented (README, "FSDP2, DDP and tensor parallelism"): every rank passes
``num_items_in_batch`` = the valid labels of all ranks and scales its loss by the world size,
since FSDP2 averages the gradients; the global loss is the sum of the ranks' losses.

The largest sizes are found by trying them (doubling, then bisection): a try that runs out of
memory must do so on every rank alike (the ranks are symmetric), else the others wait in a
collective until the process group's timeout (``--timeout-min``).
"""

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("LOCAL_KERNELS", f"qgallouedec/fused-linear-ce={ROOT}")

MODEL = dict(vocab_size=128256, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=500000.0)
TINY_MODEL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
VARIANTS = ("fused", "logits")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu-out", help="folder of the JSON and PNG")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a toy model and run (smoke test)")
    parser.add_argument("--config", help="JSON file of LlamaConfig arguments, instead of the built-in model")
    parser.add_argument("--seq", type=int, help="sequence length (default 4096; tiny 64)")
    parser.add_argument("--batch", type=int, help="sequences per GPU and step (default 4; tiny 2)")
    parser.add_argument("--steps", type=int, help="steps per variant (default 200; tiny 4)")
    parser.add_argument("--warmup", type=int, help="first steps left out of the timing (default 10; tiny 1)")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq", action="store_true", help="find the largest sequence and batch of each variant")
    parser.add_argument("--seq-limit", type=int, help="longest sequence tried (default 262144; tiny 256)")
    parser.add_argument("--seq-granularity", type=int, help="bisection stops at this many tokens (default 1024; "
                        "tiny 16)")
    parser.add_argument("--batch-limit", type=int, default=16, help="largest batch tried at the longest sequence")
    parser.add_argument("--timeout-min", type=float, default=10.0, help="process group timeout")
    args = parser.parse_args()
    defaults = dict(seq=(64, 4096), batch=(2, 4), steps=(4, 200), warmup=(1, 10), seq_limit=(256, 262144),
                    seq_granularity=(16, 1024))
    for name, (tiny, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    return args


# ---- data: a generated language over the whole vocabulary ---------------------------------------
def generated_tokens(vocab_size: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """(batch, seq) int64: Zipf-distributed tokens at even positions; at odd positions, 9 times out
    of 10, a fixed successor of the token before (the same map in every call), else a Zipf draw."""
    table = torch.Generator().manual_seed(1234)
    order = torch.randperm(vocab_size, generator=table)  # token of each frequency rank
    successor = torch.randperm(vocab_size, generator=table)
    weights = 1.0 / (torch.arange(vocab_size, dtype=torch.float64) + 2.7)
    g = torch.Generator().manual_seed(seed)
    tokens = order[torch.multinomial(weights, batch * seq, replacement=True, generator=g)].view(batch, seq)
    follows = torch.rand(batch, seq // 2, generator=g) < 0.9
    odd = tokens[:, 1::2]
    odd.copy_(torch.where(follows[:, :odd.shape[1]], successor[tokens[:, 0::2][:, :odd.shape[1]]], odd))
    return tokens


def step_batch(args, config, step: int, rank: int, batch: int, seq: int, device) -> torch.Tensor:
    return generated_tokens(config.vocab_size, batch, seq, seed=(args.seed * 1_000_003 + step) * 1009 + rank).to(device)


# ---- the model in FSDP2 ------------------------------------------------------------------------
def model_config(args):
    from transformers import LlamaConfig

    kwargs = json.loads(Path(args.config).read_text()) if args.config else (TINY_MODEL if args.tiny else MODEL)
    return LlamaConfig(**{"max_position_embeddings": args.seq_limit, **kwargs})


def build(args, config, variant: str, device, dtype):
    """The model (same initialisation for both variants), sharded, and its optimizer and schedule."""
    from kernels import get_kernel
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).train()
    if variant == "fused":
        flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
        flce.patch_forward(model)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model.lm_head, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, min(20, args.steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return model, optimizer, schedule


def train_step(model, optimizer, schedule, input_ids: torch.Tensor, world: int) -> torch.Tensor:
    """One step of the data-parallel recipe; returns this rank's share of the global loss."""
    num_items = torch.tensor(world * input_ids.shape[0] * (input_ids.shape[1] - 1), device=input_ids.device)
    out = model(input_ids=input_ids, labels=input_ids, num_items_in_batch=num_items, use_cache=False)
    (out.loss * world).backward()  # FSDP2 averages the gradients over the ranks
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return out.loss.detach()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory(device) -> dict:
    """Peak memory of this rank's GPU since the last reset, in GiB (None on the CPU)."""
    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}


def _release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def train(args, config, variant: str, device, dtype) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    _release(device)
    model, optimizer, schedule = build(args, config, variant, device, dtype)
    losses, times = [], []
    for step in range(args.steps):
        input_ids = step_batch(args, config, step, rank, args.batch, args.seq, device)
        _sync(device)
        start = time.perf_counter()
        loss = train_step(model, optimizer, schedule, input_ids, world)
        _sync(device)
        times.append(time.perf_counter() - start)
        dist.all_reduce(loss)
        losses.append(loss.item())
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"{variant} step {step}: loss {losses[-1]:.4f}, {times[-1] * 1e3:.0f} ms", flush=True)
    # the slowest rank's time of each step
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step_s = statistics.median(slowest.tolist()[args.warmup:] or slowest.tolist())
    tokens = world * args.batch * args.seq
    memory = [None] * world
    dist.all_gather_object(memory, _memory(device))
    del model, optimizer, schedule
    return {
        "loss": losses,
        "median_step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / world,
        "memory_per_gpu": memory,
        "timing": f"median over steps {args.warmup}..{args.steps - 1} of the slowest rank's wall time "
                  "(synchronised), optimizer step included",
    }


# ---- the largest sizes -------------------------------------------------------------------------
def fits(args, config, variant: str, device, dtype, batch: int, seq: int) -> tuple[bool, dict]:
    """Whether two training steps at (batch, seq) per GPU run on every rank; their peak memory."""
    _release(device)
    memory = _two_steps(args, config, variant, device, dtype, batch, seq)
    _release(device)  # the try's tensors died with _two_steps' frame
    everywhere = torch.tensor([int(memory is not None)], device=device)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(f"{variant} batch {batch} seq {seq}: {'fits' if everywhere.item() else 'out of memory'}", flush=True)
    return bool(everywhere.item()), memory or {}


def _two_steps(args, config, variant: str, device, dtype, batch: int, seq: int) -> dict | None:
    """Peak memory of two steps (the second holds the optimizer's state too); None when out of memory."""
    try:
        model, optimizer, schedule = build(args, config, variant, device, dtype)
        for step in range(2):
            input_ids = step_batch(args, config, step, dist.get_rank(), batch, seq, device)
            train_step(model, optimizer, schedule, input_ids, dist.get_world_size())
        _sync(device)
        return _memory(device)
    except torch.cuda.OutOfMemoryError:
        return None


def largest(try_size, start: int, limit: int, granularity: int) -> int:
    """The largest size in [start, limit] for which ``try_size`` holds (0 if none): doubling, then
    bisection down to ``granularity``."""
    if not try_size(start):
        return 0
    good, bad = start, None
    while bad is None and good < limit:
        size = min(2 * good, limit)
        if try_size(size):
            good = size
        else:
            bad = size
    while bad is not None and bad - good > granularity:
        size = (good + bad) // 2 // granularity * granularity
        if size <= good:
            break
        good, bad = (size, bad) if try_size(size) else (good, size)
    return good


def max_sizes(args, config, device, dtype) -> dict:
    records = {}

    def probe(variant, batch, seq):
        ok, memory = fits(args, config, variant, device, dtype, batch, seq)
        records.setdefault(variant, []).append({"batch": batch, "seq": seq, "fits": ok, "rank0_memory": memory})
        return ok

    seq_max = {v: largest(lambda s, v=v: probe(v, 1, s), args.seq, args.seq_limit, args.seq_granularity)
               for v in VARIANTS}
    at_seq = seq_max["logits"]
    batch_max = {v: largest(lambda b, v=v: probe(v, b, at_seq), 1, args.batch_limit, 1) if at_seq else 0
                 for v in VARIANTS}
    return {
        "max_seq_at_batch_1": seq_max,
        "seq_limit": args.seq_limit,
        "at_logits_max_seq": {"seq": at_seq, "max_batch": batch_max,
                              "tokens_per_gpu": {v: batch_max[v] * at_seq for v in VARIANTS}},
        "batch_limit": args.batch_limit,
        "tries": records,
    }


# ---- records -----------------------------------------------------------------------------------
def plot(results: dict, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot (the JSON holds the curves)")
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    for variant, style in zip(VARIANTS, ("-", "--"), strict=True):  # dashed over solid: both show where equal
        top.plot(results[variant]["loss"], style, label=f"{variant} loss", linewidth=1)
    top.set_ylabel("global loss (nats)")
    top.legend()
    top.set_title(title, fontsize=9)
    difference = [a - b for a, b in zip(results["fused"]["loss"], results["logits"]["loss"], strict=True)]
    bottom.plot(difference, color="gray", linewidth=1)
    bottom.set_ylabel("fused - logits")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    timeout = datetime.timedelta(minutes=args.timeout_min)
    if args.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    # bf16 on GPUs; fp32 on CPU processes (a smoke test, not a measurement)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model_config(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "gpus": world if device.type == "cuda" else 0,
        "processes": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "model": {**config.to_diff_dict(), "parameters": parameters},
        "data": "generated: Zipf tokens at even positions, a fixed successor at odd ones (9 in 10)",
    }
    if args.max_seq:
        record["max_sizes"] = max_sizes(args, config, device, dtype)
        name = "train_fsdp_maxseq.json"
    else:
        results = {variant: train(args, config, variant, device, dtype) for variant in VARIANTS}
        logits_gib = args.batch * args.seq * config.vocab_size * torch.finfo(dtype).bits / 8 / 2**30
        record.update(seq=args.seq, batch_per_gpu=args.batch, steps=args.steps, lr=args.lr,
                      logits_gib_per_gpu=logits_gib, variants=results)
        fused, logits = results["fused"], results["logits"]
        record["summary"] = {
            "final_loss": {v: results[v]["loss"][-1] for v in VARIANTS},
            "max_abs_loss_difference": max(abs(a - b) for a, b in zip(fused["loss"], logits["loss"], strict=True)),
            "tokens_per_s_ratio": fused["tokens_per_s"] / logits["tokens_per_s"],
        }
        if device.type == "cuda":
            peak = {v: max(m["peak_allocated_gib"] for m in results[v]["memory_per_gpu"]) for v in VARIANTS}
            record["summary"].update(peak_allocated_gib=peak, memory_saved_gib=peak["logits"] - peak["fused"])
        name = "train_fsdp.json"
        if rank == 0:
            title = (f"{parameters / 1e6:.3g}M parameters, V = {config.vocab_size}, {world} x {record['device']}, "
                     f"{record['dtype']}, batch {args.batch} x {args.seq} per GPU")
            plot(results, out / "train_fsdp_loss.png", title)
    if rank == 0:
        (out / name).write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps(record.get("summary", record.get("max_sizes")), default=str)[:2000])
        assert all(math.isfinite(x) for v in record.get("variants", {}).values() for x in v["loss"]), "non-finite loss"
    dist.barrier()  # no rank leaves while another still records
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every rank is done and the group destroyed: leave without the interpreter's teardown, in
    # which gloo's threads (the CPU run, torch 2.13) now and then abort a rank with "terminate
    # called without an active exception" after its work. An error above still exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
