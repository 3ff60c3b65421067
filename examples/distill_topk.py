"""Offline top-k distillation: a tiny Llama student learns from a tiny Llama teacher's top-k
log-probs, precomputed once (as a vLLM or SGLang server returns them), without the student's logits.

    python examples/distill_topk.py                    # CUDA GPU (bf16) if there is one, else CPU (fp32)
    python examples/distill_topk.py --top-k 1 --beta 1 # the top-1 reverse KL on sampled tokens

1. The teacher (2 layers, width 64) is trained a few steps on the bytes of examples/data/ with the
   fused cross-entropy, then its top-k log-probs of every training position are stored
   (ids and log-probs, K per position: all a distillation run keeps of the teacher).
2. The student (1 layer, width 32) is trained on them twice from the same initialisation and
   batches: with ``fused_linear_sparse_kl`` on its hidden states (no (B, T, V) logits), and with
   the same loss written on its materialised log-softmax (TRL's ServerDistillationTrainer
   definitions: the top-k forward KL with the tail bucket, the mass outside the top-k). The two
   columns of the table agree up to rounding.

With ``--beta 1`` (and ``--top-k 1``) the loss is ServerDistillationTrainer's top-1 reverse KL on
tokens sampled from the teacher (``fused_linear_top1_divergence``).
"""

import argparse
import copy
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "qgallouedec/fused-linear-ce"
if "LOCAL_KERNELS" not in os.environ:  # this checkout; its build/ (not tracked) is made from torch-ext/ first
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_variants.py")], check=True)
    os.environ["LOCAL_KERNELS"] = f"{REPO_ID}={ROOT}"

import torch  # noqa: E402
from kernels import get_kernel  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

IGNORE = -100


def tiny_llama(width: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def hidden_states(model: LlamaForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, H): the input of lm_head, position t predicting token t + 1."""
    return model.model(input_ids=tokens).last_hidden_state


def tail_bucket(log_probs: torch.Tensor) -> torch.Tensor:
    """One more element, log(1 - sum exp(log_probs)), the sum held below 1 (TRL's _add_tail_bucket)."""
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(log_sum))], dim=-1)


def reference_loss(model, tokens, ids, teacher_log_probs, beta: float) -> torch.Tensor:
    """The same loss from the student's materialised (B, T, V) log-softmax, TRL's way."""
    student = torch.log_softmax(model.lm_head(hidden_states(model, tokens)).float(), dim=-1).gather(-1, ids)
    student, teacher = tail_bucket(student), tail_bucket(teacher_log_probs)
    if beta == 0:  # forward KL(teacher || student) on the top-k and the tail
        per_row = (teacher.exp() * (teacher - student)).sum(-1)
    else:  # the reverse KL(student || teacher) on the sampled token and the tail
        per_row = (student.exp() * (student - teacher)).sum(-1)
    return per_row.mean()


def fused_loss(flce, model, tokens, ids, teacher_log_probs, beta: float) -> torch.Tensor:
    hidden, weight = hidden_states(model, tokens), model.lm_head.weight
    if beta == 0:
        return flce.fused_linear_sparse_kl(hidden, weight, ids, teacher_log_probs)
    return flce.fused_linear_top1_divergence(hidden, weight, ids[..., 0], teacher_log_probs[..., 0])


def train_teacher(flce, teacher, batches, steps: int, lr: float) -> None:
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=lr)
    for step in range(steps):
        tokens = batches[step % len(batches)]
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE)], dim=1)
        loss = flce.fused_linear_cross_entropy(hidden_states(teacher, tokens), teacher.lm_head.weight, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@torch.no_grad()
def teacher_top_k(teacher, batches, k: int, sample: bool, seed: int):
    """Per batch: ids (B, T, k) and the teacher's log-probs of them (B, T, k), fp32: its top-k,
    or (``sample``) one token drawn from it, as a server's answer for on-policy tokens."""
    gen = torch.Generator(device=batches[0].device).manual_seed(seed)
    answers = []
    for tokens in batches:
        log_probs = torch.log_softmax(teacher(input_ids=tokens).logits.float(), dim=-1)
        if sample:
            ids = torch.multinomial(log_probs.exp().flatten(0, 1), 1, generator=gen).view(*tokens.shape, 1)
        else:
            ids = log_probs.topk(k, dim=-1).indices
        answers.append((ids, log_probs.gather(-1, ids)))
    return answers


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="student training steps")
    p.add_argument("--teacher-steps", type=int, default=40)
    p.add_argument("--top-k", type=int, default=8, help="teacher log-probs kept per position")
    p.add_argument("--beta", type=float, default=0.0, choices=[0.0, 1.0],
                   help="0: top-k forward KL; 1: top-1 reverse KL on sampled tokens (needs --top-k 1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--data", type=Path, default=ROOT / "examples" / "data" / "declaration.txt")
    args = p.parse_args()
    if args.beta == 1 and args.top_k != 1:
        p.error("--beta 1 is the top-1 reverse KL: pass --top-k 1")
    return args


def main():
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)  # the models are too small to gain from more
    flce = get_kernel(REPO_ID, version=1, trust_remote_code=True)

    data = torch.tensor(list(args.data.read_bytes()), dtype=torch.int64)
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(data) - args.seq, (8, args.batch), generator=gen)
    batches = [torch.stack([data[s:s + args.seq] for s in row]).to(device) for row in starts]

    teacher = tiny_llama(64, 2, args.seed).to(device, dtype)
    train_teacher(flce, teacher, batches, args.teacher_steps, args.lr)
    answers = teacher_top_k(teacher, batches, args.top_k, sample=args.beta == 1, seed=args.seed)
    del teacher  # distillation from here on reads only the stored answers

    fused_student = tiny_llama(32, 1, args.seed + 1).to(device, dtype)
    reference_student = copy.deepcopy(fused_student)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (fused_student, reference_student)]
    kind = "top-1 reverse KL" if args.beta == 1 else f"top-{args.top_k} forward KL, tail bucket"
    print(f"# {kind}; {device.type} {str(dtype).removeprefix('torch.')}; teacher answers: "
          f"{sum(ids.numel() for ids, _ in answers)} ids")
    print(f"{'step':>4} {'fused':>10} {'reference':>10}")
    worst = 0.0
    for step in range(1, args.steps + 1):
        tokens = batches[(step - 1) % len(batches)]
        ids, teacher_log_probs = answers[(step - 1) % len(batches)]
        losses = []
        for which, optimizer in enumerate(optimizers):
            if which == 0:
                loss = fused_loss(flce, fused_student, tokens, ids, teacher_log_probs, args.beta)
            else:
                loss = reference_loss(reference_student, tokens, ids, teacher_log_probs, args.beta)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        print(f"{step:4d} {losses[0]:10.6f} {losses[1]:10.6f}")
    print(f"max |loss fused - loss reference| = {worst:.3g}")


if __name__ == "__main__":
    main()
