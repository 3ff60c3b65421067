"""``flce.trl.FusedLogProbs`` against the contract of TRL 1.16's ``trl.kernels.ChunkedLogProbFunction``.

Equivalents of TRL's own kernel tests (``TestChunkedLogProbFunction``), with our stand-in in the
kernel's place: its ``apply`` takes every argument form TRL's takes (the public signature of its
``forward``, with the same defaults), returns the same outputs (None where not asked for), and its
values and gradients match a float64 reference computed here and TRL's kernel itself (called as a
black box), on both code paths. A bf16 hidden with an fp32 weight outside autocast works as TRL's
does (the weight is cast; its gradient comes back in fp32). TRL's own tests of its token tiling
(``chunk_size``) have no counterpart: ours plans its own tiles. Where TRL's reference rounds the
logits to bf16, ours is compared with float64 instead (docs/integrations.md has the numbers).
"""

import inspect

import pytest
import torch
from conftest import BF16_ON_CPU, HAS_CUDA, assert_rel, make_inputs, tolerance

trl_kernels = pytest.importorskip("trl.kernels")
ChunkedLogProbFunction = trl_kernels.ChunkedLogProbFunction

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
ALL_BUT_LOG_PROBS = OUTPUTS[1:]


def reference(hidden, weight, bias, targets, temperature, softcap, logit_scale):
    """The five outputs in float64 from the logits: z = softcap(scale (h w^T + b)) / T."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z * logit_scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    return {
        "log_probs": log_p.gather(-1, targets[:, None])[:, 0],
        "entropy": -(log_p.exp() * log_p).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * log_p, dim=-1),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == targets,
    }


def test_apply_has_trls_parameters_and_defaults(flce):
    """The names, order, kinds and defaults of TRL's forward (without ctx)."""
    theirs = list(inspect.signature(ChunkedLogProbFunction.forward).parameters.values())[1:]
    ours = list(inspect.signature(flce.trl.FusedLogProbs.apply).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]


# (positional arguments after hidden, weight, bias, targets; whether a bias is given)
FORMS = {
    "six-args": ((1.0, 4), False),  # the defaults: no softcap, scale 1, every output
    "temperature-bias": ((0.7, 4), True),
    "softcap": ((1.0, 4, 2.0), False),
    "scale": ((1.3, 4, None, 0.5), True),
    "outputs-entropy": ((1.0, 4, None, 1.0, ("entropy",)), False),
    "outputs-none": ((0.9, 4, 3.0, 2.0, ()), True),
    "outputs-all": ((1.0, 4, 2.5, 1.0, ALL_BUT_LOG_PROBS), True),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_argument_form_matches_the_reference_and_trls_kernel(flce, path, form):
    args, has_bias = FORMS[form]
    hidden, weight, targets, bias = make_inputs(7, 8, 24, torch.float32, seed=len(form), device=path.device,
                                                bias=has_bias, scale=3.0)
    temperature, softcap = args[0], args[2] if len(args) > 2 else None
    logit_scale = args[3] if len(args) > 3 else 1.0
    asked = ALL_BUT_LOG_PROBS if len(args) < 5 else args[4]
    ours = flce.trl.FusedLogProbs.apply(hidden, weight, bias, targets, *args)
    theirs = ChunkedLogProbFunction.apply(*(t.detach().cpu() if t is not None else None
                                            for t in (hidden, weight, bias)), targets.cpu(), *args)
    expected = reference(hidden, weight, bias, targets, temperature, softcap, logit_scale)
    assert len(ours) == 5
    for name, got, trl_got in zip(OUTPUTS, ours, theirs, strict=True):
        wanted = name == "log_probs" or name in asked
        assert (got is None) == (trl_got is None) == (not wanted), name
        if not wanted:
            continue
        assert got.dtype == trl_got.dtype and got.shape == trl_got.shape, name
        if name == "is_top1":
            assert torch.equal(got.cpu(), expected[name].cpu()) and torch.equal(got.cpu(), trl_got), name
        else:
            # fp32: the reference's float64 vs ours and TRL's float32 sums over V = 24 logits
            assert_rel(got, expected[name], tolerance(torch.float32, "loss"), f"{name} vs float64")
            assert_rel(got, trl_got, tolerance(torch.float32, "loss"), f"{name} vs TRL's kernel")


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradients_match_the_reference_and_trls_kernel(flce, path, with_entropy):
    """A per-token upstream gradient on log_probs (and entropy, GRPO's bonus) reaches hidden, weight
    and bias as in the float64 reference and in TRL's kernel."""
    hidden, weight, targets, bias = make_inputs(9, 8, 24, torch.float32, seed=5, device=path.device, bias=True,
                                                scale=3.0)
    upstream = torch.randn(2, 9, generator=torch.Generator().manual_seed(6)).to(path.device)
    args = (0.8, 4, 2.0, 0.5, ("entropy",) if with_entropy else ())

    def grads(function, tensors):
        out = function(*tensors[:3], targets.to(tensors[0].device), *args)
        objective = (upstream[0].to(out[0]) * out[0]).sum()
        if with_entropy:
            objective = objective + (upstream[1].to(out[1]) * out[1]).sum()
        return torch.autograd.grad(objective, tensors)

    leaves = (hidden, weight, bias)
    ours = grads(flce.trl.FusedLogProbs.apply, leaves)
    theirs = grads(ChunkedLogProbFunction.apply, [t.detach().cpu().requires_grad_() for t in leaves])
    doubles = [t.detach().double().requires_grad_() for t in leaves]

    def float64_function(h, w, b, t, temperature, _chunk_size, softcap, logit_scale, _outputs):
        expected = reference(h, w, b, t, temperature, softcap, logit_scale)
        return expected["log_probs"], expected["entropy"]

    expected = grads(float64_function, doubles)
    for name, got, trl_got, want in zip(("hidden", "weight", "bias"), ours, theirs, expected, strict=True):
        assert_rel(got, want, tolerance(torch.float32, "grad"), f"grad {name} vs float64")
        assert_rel(got, trl_got, 10 * tolerance(torch.float32, "grad"), f"grad {name} vs TRL's kernel")


def test_bf16_hidden_with_an_fp32_weight_casts_the_weight(flce, path):
    """Outside autocast TRL's kernel casts an fp32 weight to the bf16 hidden's dtype; ours does too,
    and the weight's gradient comes back in fp32. The expectation is float64 from the same rounded
    inputs: ours keeps the logits in fp32, so it is held to fp32-accumulation accuracy on the outputs
    (the bf16 tolerance on the gradients, which are rounded to bf16 on the way)."""
    if path.name == "kernels" and not HAS_CUDA:
        pytest.skip(BF16_ON_CPU)
    hidden, weight, targets, _ = make_inputs(7, 16, 32, torch.float32, seed=3, device=path.device, scale=3.0)
    hidden = hidden.detach().bfloat16().requires_grad_()
    out = flce.trl.FusedLogProbs.apply(hidden, weight, None, targets, 1.0, 4)
    rounded = weight.detach().bfloat16()
    expected = reference(hidden.detach(), rounded, None, targets, 1.0, None, 1.0)
    # bf16 products are exact in fp32 and summed in fp32 over H = 16: fp32 accuracy, not bf16's
    for name in ("log_probs", "entropy"):
        assert_rel(out[OUTPUTS.index(name)], expected[name], 1e-5, name)
    out[0].sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    doubles = [hidden.detach().double().requires_grad_(), rounded.double().requires_grad_()]
    reference(doubles[0], doubles[1], None, targets, 1.0, None, 1.0)["log_probs"].sum().backward()
    assert_rel(hidden.grad, doubles[0].grad, 2e-2, "grad hidden")  # rounded to bf16 (2^-8) on the way
    assert_rel(weight.grad, doubles[1].grad, 2e-2, "grad weight")


def test_keyword_arguments_work_too(flce):
    """A superset of TRL's apply (positional only, as any autograd.Function's): names work too."""
    hidden, weight, targets, _ = make_inputs(5, 8, 24, torch.float32, seed=8, requires_grad=False)
    by_name = flce.trl.FusedLogProbs.apply(hidden=hidden, weight=weight, bias=None, targets=targets, temperature=1.0,
                                           chunk_size=4, outputs=("entropy",))
    by_position = flce.trl.FusedLogProbs.apply(hidden, weight, None, targets, 1.0, 4, None, 1.0, ("entropy",))
    for a, b in zip(by_name, by_position, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert by_name[1] is not None and by_name[2] is None
