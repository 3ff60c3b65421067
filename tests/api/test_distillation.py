"""``fused_linear_divergence``: TRL's generalised JSD (beta 0, 0.5, 1) between a student's and a
teacher's LM heads, and the student's entropy, against float64 autograd on the materialised
logits, on both paths (the Triton row kernel, in the interpreter on the CPU, and the PyTorch
ops), for the three ways the gradient is made: in the forward for a mean (scaled for another
uniform upstream), and recomputed for any per-token upstream (TRL's masked rows). The teacher's
hidden size differs from the student's in every case; chunks of 4 rows make several chunks."""

import math

import pytest
import torch
from conftest import DTYPES, assert_rel, submodule, tolerance

N_ROWS, VOCAB, STUDENT_H, TEACHER_H = 9, 50, 16, 24

OPTIONS = {
    "plain": {},
    "transforms": dict(temperature=0.7, student_logit_scale=1.3, student_softcap=3.0, teacher_logit_scale=0.8,
                       teacher_softcap=2.0, bias=True),
}


def make_pair(n_rows, dtype, device, *, seed, bias=False, lead=None):
    """Student (hidden, weight, bias) leaves and teacher (hidden, weight, bias), seeded, logits O(3)."""
    gen = torch.Generator().manual_seed(seed)
    lead = (n_rows,) if lead is None else lead

    def side(h, requires_grad):
        hidden = torch.randn(*lead, h, generator=gen)
        weight = torch.randn(VOCAB, h, generator=gen) * (3 / h**0.5)
        b = torch.randn(VOCAB, generator=gen) if bias else None
        return [None if t is None else t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
                for t in (hidden, weight, b)]

    return side(STUDENT_H, True), side(TEACHER_H, False)


def reference(student, teacher, beta=1.0, temperature=1.0, student_logit_scale=1.0, student_softcap=None,
              teacher_logit_scale=1.0, teacher_softcap=None):
    """(divergence, entropy, float64 student leaves) from the materialised logits, TRL's definitions."""
    student, teacher = (list(side) + [None] * (3 - len(side)) for side in (student, teacher))
    leaves = [None if t is None else t.detach().cpu().double().requires_grad_() for t in student]

    def final(hidden, weight, bias, scale, softcap):
        z = hidden.double() @ weight.double().T
        z = (z if bias is None else z + bias.double()) * scale
        z = z if softcap is None else softcap * torch.tanh(z / softcap)
        return torch.log_softmax(z / temperature, dim=-1)

    lp = final(*leaves, student_logit_scale, student_softcap)
    lq = final(*(None if t is None else t.detach().cpu() for t in teacher), teacher_logit_scale, teacher_softcap)
    p, q = lp.exp(), lq.exp()
    if beta == 0:
        divergence = (q * (lq - lp)).sum(-1)
    elif beta == 1:
        divergence = (p * (lp - lq)).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lp + math.log1p(-beta), lq + math.log(beta)]), dim=0)
        divergence = beta * (q * (lq - lm)).sum(-1) + (1 - beta) * (p * (lp - lm)).sum(-1)
    return divergence, -(p * lp).sum(-1), leaves


def check_grads(student, leaves, dtype, what):
    for name, got, ref in zip(("hidden", "weight", "bias"), student, leaves, strict=True):
        if got is not None and got.requires_grad:
            assert_rel(got.grad, ref.grad, tolerance(dtype, "grad"), f"{what} grad_{name}")
            got.grad = None
        if ref is not None:
            ref.grad = None


def masked_weights(n_rows, seed):
    """Per-token upstream weights, 0 on about 40% of the rows (the first among them)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(n_rows, generator=gen, dtype=torch.float64) * (torch.rand(n_rows, generator=gen) < 0.6)
    weights[0] = 0.0
    return weights


def mean(d):
    return d.sum() / d.numel()


def run_and_check(flce, student, teacher, expected, leaves, dtype, options, steps):
    """For each (name, upstream) of ``steps``: the divergence and entropy, and the student's
    gradients of ``upstream(divergence)`` against the reference's."""
    expected_divergence, expected_entropy = expected
    for name, upstream in steps:
        divergence, entropy = flce.fused_linear_divergence(*student[:2], *teacher[:2], student[2], teacher[2],
                                                           **options)
        assert divergence.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
        # the scale of both is that of the log-probs (a few units)
        assert_rel(divergence, expected_divergence, tolerance(dtype, "loss"), f"{name}: divergence", floor=1.0)
        assert_rel(entropy, expected_entropy, tolerance(dtype, "loss"), f"{name}: entropy", floor=1.0)
        upstream(divergence).backward()
        upstream(expected_divergence).backward(retain_graph=True)
        check_grads(student, leaves, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_matches_float64(flce, tune, path, dtype, options, beta):
    """TRL's mean over the rows it passes (the forward's gradients as they are), then its masked
    rows with random per-token weights (recomputed, the rows of weight 0 left out)."""
    options = dict(OPTIONS[options], beta=beta)
    tune(chunk_rows=4)
    student, teacher = make_pair(N_ROWS, dtype, path.device, seed=int(beta * 10), bias=options.pop("bias", False))
    *expected, leaves = reference(student, teacher, **options)
    weights = masked_weights(N_ROWS, seed=3)
    steps = [("mean", mean), ("masked", lambda d: (d * weights.to(d)).sum())]
    run_and_check(flce, student, teacher, expected, leaves, dtype, options, steps)


def test_every_upstream(flce, tune, path):
    """The forward's gradients scaled for a uniform upstream other than the mean's; after a
    recomputing backward (a non-uniform upstream), a forward that makes none and a backward that
    recomputes for the mean, then the forward's gradients again."""
    tune(chunk_rows=4)
    student, teacher = make_pair(N_ROWS, torch.float32, path.device, seed=8, bias=True)
    *expected, leaves = reference(student, teacher, 0.5, temperature=1.5)
    weights = masked_weights(N_ROWS, seed=4)
    steps = [("sum over 7.5", lambda d: d.sum() / 7.5), ("masked", lambda d: (d * weights.to(d)).sum()),
             ("mean after masked", mean), ("mean", mean)]
    run_and_check(flce, student, teacher, expected, leaves, torch.float32, dict(beta=0.5, temperature=1.5), steps)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_float64(flce, path, beta):
    """float64 inputs compute in float64 throughout (gradcheck's arithmetic): within 1e-12 of the
    reference, a few float64 roundings over 50 logits and 16 products. (The kernel takes its
    float options as fp32 arguments: these are fp32 numbers, as are their quotients by T.)"""
    student, teacher = make_pair(N_ROWS, torch.float64, path.device, seed=12, bias=True)
    options = dict(beta=beta, temperature=0.5, student_logit_scale=1.25, student_softcap=3.0, teacher_logit_scale=0.75,
                   teacher_softcap=2.0)
    *expected, leaves = reference(student, teacher, **options)
    divergence, entropy = flce.fused_linear_divergence(*student[:2], *teacher[:2], student[2], teacher[2], **options)
    assert divergence.dtype == torch.float64
    assert_rel(divergence, expected[0], 1e-12, "divergence", floor=1.0)
    assert_rel(entropy, expected[1], 1e-12, "entropy", floor=1.0)
    weights = masked_weights(N_ROWS, seed=6)
    (divergence * weights.to(divergence)).sum().backward()
    (expected[0] * weights).sum().backward()
    for name, got, ref in zip(("hidden", "weight", "bias"), student, leaves, strict=True):
        assert_rel(got.grad, ref.grad, 1e-12, f"grad_{name}")


def test_frozen_head_any_upstream(flce, tune, path):
    """Gradients to the student's hidden states alone (its head frozen, as under LoRA): the
    forward's rows, scaled by any per-token upstream, are exact."""
    tune(chunk_rows=4)
    student, teacher = make_pair(N_ROWS, torch.float32, path.device, seed=10)
    student[1].requires_grad_(False)
    *expected, leaves = reference(student, teacher, 0.5)
    leaves[1].requires_grad_(False)
    weights = masked_weights(N_ROWS, seed=5)
    # (the mean first: after it the forwards make their gradients, whatever the tests before did)
    steps = [("mean", mean), ("masked", lambda d: (d * weights.to(d)).sum()),
             ("masked again", lambda d: d @ weights.to(d))]
    run_and_check(flce, student, teacher, expected, leaves, torch.float32, dict(beta=0.5), steps)
    assert submodule(flce, "distillation").SPECULATION.speculates()  # no backward recomputed


def test_leading_shape_no_grad_and_the_teacher_untouched(flce, path):
    """(2, 5) rows in and out; a forward without gradients gives the same values bit for bit; the
    teacher's tensors get no gradient even when they require one."""
    student, teacher = make_pair(0, torch.float32, path.device, seed=4, lead=(2, 5))
    teacher = [t.requires_grad_() for t in teacher[:2]]
    expected, _, leaves = reference(student, teacher, 0.5)
    divergence, entropy = flce.fused_linear_divergence(*student[:2], *teacher, beta=0.5)
    assert divergence.shape == entropy.shape == (2, 5)
    assert_rel(divergence, expected, tolerance(torch.float32, "loss"), "divergence", floor=1.0)
    with torch.no_grad():
        plain, plain_entropy = flce.fused_linear_divergence(*student[:2], *teacher, beta=0.5)
    assert torch.equal(plain, divergence) and torch.equal(plain_entropy, entropy)
    divergence.mean().backward()
    expected.mean().backward()
    assert teacher[0].grad is None and teacher[1].grad is None
    check_grads(student, leaves, torch.float32, "leading shape")


def test_empty_batch(flce, path):
    """No rows (a rank whose completions are all masked): empty outputs, exactly zero gradients."""
    student, teacher = make_pair(0, torch.float32, path.device, seed=5, bias=True)
    divergence, entropy = flce.fused_linear_divergence(*student[:2], *teacher[:2], student[2], teacher[2])
    assert divergence.shape == entropy.shape == (0,)
    (divergence.sum() / 1).backward()
    for t in student:
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_second_backward_recomputes(flce, path):
    """retain_graph=True: the forward's gradients serve the first backward, the second recomputes."""
    student, teacher = make_pair(N_ROWS, torch.float32, path.device, seed=6)
    expected, _, leaves = reference(student, teacher, 1.0)
    divergence, _ = flce.fused_linear_divergence(*student[:2], *teacher[:2])
    loss = divergence.mean()
    loss.backward(retain_graph=True)
    first = student[0].grad.clone()
    student[0].grad = student[1].grad = None
    loss.backward()
    expected.mean().backward()
    assert_rel(first, leaves[0].grad, tolerance(torch.float32, "grad"), "first backward")
    check_grads(student, leaves, torch.float32, "second backward")


def test_bad_inputs_are_refused(flce):
    student, teacher = make_pair(3, torch.float32, "cpu", seed=7)
    with pytest.raises(ValueError, match="vocabulary"):
        flce.fused_linear_divergence(*student[:2], teacher[0], teacher[1][:-1])
    with pytest.raises(ValueError, match="leading shapes"):
        flce.fused_linear_divergence(*student[:2], teacher[0][:2], teacher[1])
    with pytest.raises(ValueError, match="beta"):
        flce.fused_linear_divergence(*student[:2], *teacher[:2], beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        flce.fused_linear_divergence(*student[:2], *teacher[:2], temperature=0.0)


def test_chunks_of_the_llama3_head(flce):
    """A bf16 step of 8192 rows on the Llama-3 head takes 8 chunks of 1024 rows (two fp32 buffers
    of 1 GiB, half the fp32 sum of grad_weight that 16 chunks of 512 would need); an fp32 one
    takes chunks of 512 rows (its grad_weight is its own fp32 sum), within 512 MiB."""
    chunk_rows = submodule(flce, "_plan").divergence_chunk_rows
    assert chunk_rows(8192, 128256, 4096, torch.float32, torch.bfloat16, True) == 1024
    assert chunk_rows(8192, 128256, 4096, torch.float32, torch.float32, True) == 512
    assert chunk_rows(8192, 128256, 4096, torch.float32, torch.bfloat16, False) == 512
    assert chunk_rows(100, 128256, 4096, torch.float32, torch.bfloat16, True) == 100


def test_under_torch_compile(flce, path):
    """Inside a compiled function the divergence runs eagerly (a graph break), with the same
    values and gradients as the reference."""
    student, teacher = make_pair(N_ROWS, torch.float32, path.device, seed=9)
    expected, _, leaves = reference(student, teacher, 0.5)

    def loss(hidden):
        return 2 * flce.fused_linear_divergence(hidden, student[1], *teacher[:2], beta=0.5)[0].mean()

    got = torch.compile(loss, backend="eager")(student[0])
    assert_rel(got, 2 * expected.mean(), tolerance(torch.float32, "loss"), "compiled loss", floor=1.0)
    got.backward()
    (2 * expected.mean()).backward()
    check_grads(student, leaves, torch.float32, "compiled")
