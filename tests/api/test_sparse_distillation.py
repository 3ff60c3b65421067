"""``fused_linear_sparse_kl`` and ``fused_linear_top1_divergence`` against TRL 1.16's own
``ServerDistillationTrainer`` loss methods (``_compute_server_forward_kl_loss``,
``_compute_server_sparse_top_1_divergence_loss``, with their ``_add_tail_bucket`` and
``_jsd_divergence``) run in float64 on the student's full log-softmax: the loss and its gradients
to hidden, weight and bias. The teacher's top-k log-probs come from a seeded random teacher.

With the tail bucket and reduction "mean" or "sum" the forward makes the gradients chunk by chunk
from each chunk's buffer (pipeline "sparse"), the backward only scaling them: checked on both
paths, with several chunks, ignored rows, temperature, softcap, bias and an upstream other than 1."""

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


def make_case(dtype, k, *, seed, bias=False, device=DEVICE):
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
    leaves = [None if t is None else t.to(device, dtype).requires_grad_() for t in (hidden, weight, b)]
    case = dict(top_ids=top_ids, top_log_probs=top_log_probs, tokens=tokens,
                actual=teacher.gather(-1, tokens[..., None]).squeeze(-1), labels=labels)
    return leaves, {name: t.to(device) for name, t in case.items()}  # beside the student's log-probs


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
    """Without the tail the loss takes the K logits alone: no vocabulary sweep, forward or backward;
    with it one sweep, whose buffers give the gradients (no recompute)."""
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
    assert sorted(set(sweeps)) == (["row_stats"] if add_tail else []), sweeps


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


# ---- the gradients made in the forward (pipeline "sparse") --------------------------------------
LOSSES = {  # name: (the public function, TRL's method, beta, K)
    "forward-kl": ("fused_linear_sparse_kl", "_compute_server_forward_kl_loss", 0.0, 4),
    "top1-reverse": ("fused_linear_top1_divergence", "_compute_server_sparse_top_1_divergence_loss", 1.0, 1),
    "top1-jsd": ("fused_linear_top1_divergence", "_compute_server_sparse_top_1_divergence_loss", 0.5, 1),
}


def sparse_loss(flce, name, leaves, case, device, **options):
    """Ours on the case's rows with a label (the others' ids ignored), and TRL's method's keywords."""
    function, _, beta, k = LOSSES[name]
    rows = case["labels"] != IGNORE
    if function == "fused_linear_sparse_kl":
        ids = torch.where(rows[..., None], case["top_ids"], IGNORE).to(device)
        loss = flce.fused_linear_sparse_kl(leaves[0], leaves[1], ids, case["top_log_probs"].float().to(device),
                                           leaves[2], **options)
        trl = dict(teacher_result=dict(topk_logprobs=case["top_log_probs"], topk_token_ids=case["top_ids"]),
                   labels=case["labels"])
        return loss, trl
    loss = flce.fused_linear_top1_divergence(
        leaves[0], leaves[1], torch.where(rows, case["tokens"], IGNORE).to(device), case["actual"].float().to(device),
        leaves[2], beta=beta, teacher_top1_ids=case["top_ids"][..., 0].to(device),
        teacher_top1_log_probs=case["top_log_probs"][..., 0].float().to(device), **options)
    trl = dict(teacher_result=dict(actual_logprobs=case["actual"], topk_logprobs=case["top_log_probs"],
                                   topk_token_ids=case["top_ids"]), completion_tokens=case["tokens"],
               labels=case["labels"])
    return loss, trl


def backend_of(flce, path):
    return submodule(flce, "_torch_backend" if path.name == "torch" else "_triton_backend")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("option", ["plain", "bias-softcap-temperature"])
def test_gradients_made_in_the_forward(flce, trainer_class, path, tune, dtype, name, reduction, option):
    """Loss and gradients of 3 x the loss against TRL's method on the float64 full log-softmax
    ("sum": its batchmean times the rows with a label), over chunks of 5 rows (the first of the
    computed rows, those with a label, then the others), with ignored rows and -inf teacher entries."""
    tune(chunk_rows=5)
    _, method, beta, k = LOSSES[name]
    options = dict(temperature=0.7, softcap=3.0) if option != "plain" else dict(temperature=1.0, softcap=None)
    leaves, case = make_case(dtype, k, seed=30 + len(name) + (reduction == "sum"), bias=option != "plain",
                             device=path.device)
    loss, trl = sparse_loss(flce, name, leaves, case, path.device, reduction=reduction, **options)
    leaves64, student = student_log_softmax(leaves, **options)
    expected = trl_loss(trainer_class, method, beta, True, student_log_probs=student, **trl)
    if reduction == "sum":
        expected = expected * (case["labels"] != IGNORE).sum()
    check(3.0 * loss, 3.0 * expected, leaves, leaves64, dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_forward_makes_the_gradients_unless_the_upstream_is_per_row(flce, path, tune, monkeypatch, reduction):
    """Mean and sum: every sweep and grad-logits pass runs in the forward, one a chunk (12 rows with
    10 labels in chunks of 4: 3), and the backward launches none (no recompute); "none" (a per-row
    upstream) keeps today's path: the sweep in the forward, the recompute in the backward."""
    tune(chunk_rows=4)
    backend = backend_of(flce, path)
    calls = []

    def counted(name, function):
        return lambda *args, **kwargs: calls.append(name) or function(*args, **kwargs)

    for name in ("row_stats", "grad_from_kept", "grad_logits"):
        monkeypatch.setattr(backend, name, counted(name, getattr(backend, name)))
    leaves, case = make_case(torch.float32, 4, seed=40, bias=True, device=path.device)
    loss, _ = sparse_loss(flce, "forward-kl", leaves, case, path.device, reduction=reduction)
    in_forward = list(calls)
    (loss if reduction != "none" else loss.sum()).backward()
    in_backward = calls[len(in_forward):]
    if reduction == "none":
        assert "grad_from_kept" not in calls and "grad_logits" in in_backward
    else:
        assert in_forward == ["row_stats", "grad_from_kept"] * 3 and in_backward == []
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.abs().sum() > 0


def test_the_plan_of_the_forward_says_so(flce, tune):
    """The plan of a top-k loss's forward with gradients: pipeline "sparse", its gradients in the forward."""
    chunked, options = submodule(flce, "_chunked"), submodule(flce, "_options")
    leaves, _ = make_case(torch.float32, 4, seed=41)
    hidden, weight = leaves[0].reshape(-1, H), leaves[1]
    request = options.Request(options.LossOptions(), grad_hidden=True, grad_weight=True, reduction="none",
                              outputs="log_probs")
    text = chunked.plan_of(hidden, weight, None, request, sparse=True).explain()
    assert "pipeline: sparse" in text and "gradients in the forward: hidden, weight" in text
    assert "sparse loss: each chunk's grad logits from its buffer" in text


def test_a_second_backward_raises(flce, path):
    """The forward's gradients are scaled in place by the first backward: a second one through the
    same graph (retain_graph=True) is refused, as the loss's; a double backward (create_graph=True)
    raises as today's path (reduction "none") does."""
    leaves, case = make_case(torch.float32, 4, seed=42, device=path.device)
    loss, _ = sparse_loss(flce, "forward-kl", leaves, case, path.device)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    for reduction in ("mean", "none"):
        loss, _ = sparse_loss(flce, "forward-kl", leaves, case, path.device, reduction=reduction)
        with pytest.raises(RuntimeError, match="does not support double backward"):
            torch.autograd.grad(loss.sum(), leaves[0], create_graph=True)


def test_per_row_reduction_keeps_todays_path(flce, trainer_class, path, tune):
    """Reduction "none" (its upstream per row, known in the backward): 2 x its sum has the gradients
    of 2 x TRL's batchmean times the rows with a label, over several chunks."""
    tune(chunk_rows=4)
    leaves, case = make_case(torch.float32, 4, seed=43, bias=True, device=path.device)
    per_row, trl = sparse_loss(flce, "forward-kl", leaves, case, path.device, reduction="none", temperature=0.8,
                               softcap=4.0)
    leaves64, student = student_log_softmax(leaves, temperature=0.8, softcap=4.0)
    expected = trl_loss(trainer_class, "_compute_server_forward_kl_loss", 0.0, True, student_log_probs=student, **trl)
    assert per_row.shape == (B, T)
    check(2.0 * per_row.sum(), 2.0 * expected * (case["labels"] != IGNORE).sum(), leaves, leaves64, torch.float32)
