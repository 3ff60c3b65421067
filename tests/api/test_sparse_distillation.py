"""``fused_linear_sparse_kl`` and ``fused_linear_top1_divergence`` against TRL 1.16's own
``ServerDistillationTrainer`` loss methods (``_compute_server_forward_kl_loss``,
``_compute_server_sparse_top_1_divergence_loss``, with their ``_add_tail_bucket`` and
``_jsd_divergence``) run in float64 on the student's full log-softmax: the loss and its gradients
to hidden, weight and bias. The teacher's top-k log-probs come from a seeded random teacher."""

import os

import pytest
import torch
from conftest import DEVICE, DTYPES, assert_rel, submodule, tolerance

IGNORE = -100
B, T, H, V = 3, 4, 16, 41


@pytest.fixture(scope="module")
def trainer_class():
    pytest.importorskip("trl")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.server_distillation.server_distillation_trainer import ServerDistillationTrainer

    return ServerDistillationTrainer


def trl_loss(trainer_class, method: str, beta: float, add_tail: bool, **inputs) -> torch.Tensor:
    """The trainer's loss method on an instance that holds only its loss settings."""
    trainer = object.__new__(trainer_class)
    trainer.beta, trainer.loss_add_tail, trainer.reverse_kl_top_1_mode = beta, add_tail, "sampled"
    return getattr(trainer, method)(**inputs)


def make_case(dtype, k, *, seed, bias=False):
    """Student hidden (B, T, H), weight, bias; the teacher's top-k ids and log-probs (B, T, k) of a
    random teacher (on two rows only its first k - 1, the rest -inf, as a server's short answer),
    the sampled tokens (the teacher's top-1 on some rows) and labels (-100 on the first row's
    first two positions, the prompt)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5 * 2
    b = torch.randn(V, generator=gen) * 0.5 if bias else None
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2, dim=-1)
    top_log_probs, top_ids = teacher.topk(k, dim=-1)
    if k > 1:
        top_log_probs[1, 2, -1] = top_log_probs[2, 0, -1] = float("-inf")
        top_ids[1, 2, -1] = top_ids[2, 0, -1] = 0
    tokens = torch.randint(0, V, (B, T), generator=gen)
    tokens[0, 3] = top_ids[0, 3, 0]
    tokens[2, 1] = top_ids[2, 1, 0]
    labels = tokens.clone()
    labels[0, :2] = IGNORE
    leaves = [None if t is None else t.to(DEVICE, dtype).requires_grad_() for t in (hidden, weight, b)]
    case = dict(top_ids=top_ids, top_log_probs=top_log_probs, tokens=tokens,
                actual=teacher.gather(-1, tokens[..., None]).squeeze(-1), labels=labels)
    return leaves, {name: t.to(DEVICE) for name, t in case.items()}  # beside the student's log-probs


def student_log_softmax(leaves, temperature, softcap):
    hidden, weight, bias = (None if t is None else t.detach().double().requires_grad_() for t in leaves)
    z = hidden @ weight.T + (0 if bias is None else bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return [t for t in (hidden, weight, bias) if t is not None], torch.log_softmax(z / temperature, dim=-1)


def check(loss, expected, leaves, leaves64, dtype):
    loss.backward()
    expected.backward()
    assert_rel(loss, expected, tolerance(dtype, "loss"), "loss", floor=1e-3)
    names = ("grad_hidden", "grad_weight", "grad_bias")[: len(leaves64)]
    for name, leaf, leaf64 in zip(names, [t for t in leaves if t is not None], leaves64, strict=True):
        assert_rel(leaf.grad, leaf64.grad, tolerance(dtype, "grad"), name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("add_tail", [True, False], ids=["tail", "no-tail"])
def test_forward_kl_is_trl(flce, trainer_class, monkeypatch, dtype, k, add_tail):
    """Without the tail the loss takes the K logits alone: no vocabulary sweep, forward or backward."""
    backend = submodule(flce, "_triton_backend" if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
                        else "_torch_backend")
    sweeps = []

    def counted(name, function):
        return lambda *args, **kwargs: sweeps.append(name) or function(*args, **kwargs)

    for name in ("row_stats", "grad_logits"):
        monkeypatch.setattr(backend, name, counted(name, getattr(backend, name)))
    options = dict(temperature=0.8, softcap=4.0) if k == 4 else dict(temperature=1.0, softcap=None)
    leaves, case = make_case(dtype, k, seed=k + 2 * add_tail, bias=k == 4)
    rows = case["labels"] != IGNORE
    loss = flce.fused_linear_sparse_kl(
        leaves[0], leaves[1], torch.where(rows[..., None], case["top_ids"], IGNORE).to(DEVICE),
        case["top_log_probs"].float().to(DEVICE), leaves[2], add_tail=add_tail, **options)
    leaves64, student = student_log_softmax(leaves, **options)
    teacher_result = dict(topk_logprobs=case["top_log_probs"], topk_token_ids=case["top_ids"])
    expected = trl_loss(trainer_class, "_compute_server_forward_kl_loss", 0.0, add_tail,
                        teacher_result=teacher_result, student_log_probs=student, labels=case["labels"])
    if k == 1 and not add_tail:
        assert expected.item() == 0.0  # one renormalised element: TRL's loss is 0 (hence its tail)
    check(loss, expected, leaves, leaves64, dtype)
    assert sorted(set(sweeps)) == (["grad_logits", "row_stats"] if add_tail else []), sweeps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [1.0, 0.5])
@pytest.mark.parametrize("add_tail", [True, False], ids=["tail", "no-tail"])
def test_top1_divergence_is_trl(flce, trainer_class, dtype, beta, add_tail):
    options = dict(temperature=0.7, softcap=3.0) if beta == 1 else dict(temperature=1.0, softcap=None)
    leaves, case = make_case(dtype, 1, seed=10 + add_tail, bias=beta == 0.5)
    rows = case["labels"] != IGNORE
    loss = flce.fused_linear_top1_divergence(
        leaves[0], leaves[1], torch.where(rows, case["tokens"], IGNORE).to(DEVICE), case["actual"].float().to(DEVICE),
        leaves[2], beta=beta, teacher_top1_ids=case["top_ids"][..., 0].to(DEVICE),
        teacher_top1_log_probs=case["top_log_probs"][..., 0].float().to(DEVICE), add_tail=add_tail, **options)
    leaves64, student = student_log_softmax(leaves, **options)
    teacher_result = dict(actual_logprobs=case["actual"], topk_logprobs=case["top_log_probs"],
                          topk_token_ids=case["top_ids"])
    expected = trl_loss(trainer_class, "_compute_server_sparse_top_1_divergence_loss", beta, add_tail,
                        teacher_result=teacher_result, student_log_probs=student, completion_tokens=case["tokens"],
                        labels=case["labels"])
    if beta == 1 and not add_tail:
        assert expected.item() == 0.0
    check(loss, expected, leaves, leaves64, dtype)


def test_reductions_and_no_rows(flce, trainer_class):
    """"sum" is TRL's batchmean times the rows that take part, "none" their per-row terms (which
    sum to it); without any row the loss is 0 with zero gradients (TRL's clamp of the count)."""
    leaves, case = make_case(torch.float32, 4, seed=20)
    rows = case["labels"] != IGNORE
    ids = torch.where(rows[..., None], case["top_ids"], IGNORE).to(DEVICE)
    teacher = case["top_log_probs"].float().to(DEVICE)
    leaves64, student = student_log_softmax(leaves, temperature=1.0, softcap=None)
    teacher_result = dict(topk_logprobs=case["top_log_probs"], topk_token_ids=case["top_ids"])
    mean = trl_loss(trainer_class, "_compute_server_forward_kl_loss", 0.0, True, teacher_result=teacher_result,
                    student_log_probs=student, labels=case["labels"])
    per_row = flce.fused_linear_sparse_kl(leaves[0], leaves[1], ids, teacher, reduction="none")
    total = flce.fused_linear_sparse_kl(leaves[0], leaves[1], ids, teacher, reduction="sum")
    tol = tolerance(torch.float32, "loss")
    assert per_row.shape == (B, T) and not per_row[~rows.to(DEVICE)].any()
    assert_rel(total, mean * rows.sum(), tol, "sum")
    assert_rel(per_row.sum(), total, tol, "none")
    none_left = flce.fused_linear_sparse_kl(leaves[0], leaves[1], torch.full_like(ids, IGNORE), teacher)
    none_left.backward()
    assert none_left.item() == 0.0 and not leaves[0].grad.any() and not leaves[1].grad.any()
    with pytest.raises(ValueError, match="beta must be in"):
        flce.fused_linear_top1_divergence(leaves[0], leaves[1], ids[..., 0], teacher[..., 0], beta=0.0)
    with pytest.raises(ValueError, match="needs teacher_top1_ids"):
        flce.fused_linear_top1_divergence(leaves[0], leaves[1], ids[..., 0], teacher[..., 0], beta=0.5)
