"""torch.compile(fullgraph=True) through the loss and through a tiny model with the fused
causal-LM loss: one graph, no break, and the same loss, gradients and metrics as eager.

On the CPU the graphs go through dynamo and AOTAutograd (backend "aot_eager": the fake
implementations and the autograd registration of the custom ops are what is exercised);
Inductor's C++ build takes about a minute cold on a 2-core machine, so it runs on CUDA or with
FLCE_TEST_INDUCTOR=1.
"""

import copy
import os
import re

import pytest
import torch
from _tiny import assert_grads_close, grads, tiny_batch, tiny_causal_lm
from conftest import HAS_CUDA
from torch._dynamo.testing import CompileCounterWithBackend

BACKEND = "inductor" if HAS_CUDA or os.environ.get("FLCE_TEST_INDUCTOR") == "1" else "aot_eager"
PATHS = {"interpreter": "1", "torch": "0"}  # TRITON_INTERPRET on CPU tensors


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn):
    counter = CompileCounterWithBackend(BACKEND)
    return torch.compile(fn, fullgraph=True, backend=counter), counter


def _leaves(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 8, 32, generator=g).to(device).requires_grad_()
    weight = (torch.randn(100, 32, generator=g) * 0.5).to(device).requires_grad_()
    bias = torch.randn(100, generator=g).to(device).requires_grad_()
    targets = torch.randint(0, 100, (2, 8), generator=g).to(device)
    targets[0, :3] = -100
    return hidden, weight, bias, targets


def _mean_with_metrics(flce, hidden, weight, bias, targets):
    loss, metrics = flce.fused_linear_cross_entropy(
        hidden, weight, targets, bias, softcap=5.0, logit_scale=0.8, return_metrics=True
    )
    return 2.0 * loss, metrics["num_correct_tokens"], metrics["entropy_sum"]


def _none_with_lse(flce, hidden, weight, bias, targets):
    # reduction "none" and a returned lse: the gradients are recomputed in the backward op
    losses, lse = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="none", return_lse=True)
    row_weights = torch.linspace(0.5, 1.5, losses.numel(), device=losses.device).reshape(losses.shape)
    return (losses * row_weights).sum() + 0.1 * lse.square().mean(), lse


def _class_weighted_per_token(flce, hidden, weight, bias, targets):
    # class weights with label smoothing, and the per-row predictions and metrics
    class_weight = torch.linspace(0.5, 2.0, weight.shape[0], device=weight.device)
    losses, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="none",
                                                      return_metrics=True, class_weight=class_weight,
                                                      label_smoothing=0.1)
    return losses.sum(), metrics["predictions"], metrics["correct_tokens"], metrics["entropy"]


def _per_token_log_probs(flce, hidden, weight, bias, targets):
    # per-token log-probs and entropy, gradients through both (the traced operator's recomputing
    # backward: eager mode takes another route to the same functions, ``_ops._EagerTokenForward``),
    # and the mean logits, from the column sum outside the operator (no softcap)
    out = flce.fused_linear_log_probs(hidden, weight, targets, bias, temperature=0.7,
                                      outputs=("log_probs", "entropy", "is_top1", "mean_logits"))
    token_weights = torch.linspace(0.5, 1.5, targets.numel(), device=hidden.device).reshape(targets.shape)
    loss = (out.log_probs * token_weights).sum() + 0.1 * out.entropy.sum()
    return loss, out.log_probs, out.is_top1, out.mean_logits


@pytest.mark.parametrize(("path", "fn"), [
    ("interpreter", _mean_with_metrics), ("torch", _mean_with_metrics), ("torch", _none_with_lse),
    ("torch", _class_weighted_per_token), ("interpreter", _per_token_log_probs), ("torch", _per_token_log_probs),
])
def test_compiled_loss_matches_eager(flce, device, monkeypatch, path, fn):
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", PATHS[path])
    elif path == "interpreter":
        pytest.skip("the interpreter path is the CPU stand-in for the Triton kernels")
    leaves = _leaves(device)
    compiled, counter = _compiled(lambda *args: fn(flce, *args))
    out = compiled(*leaves)
    out[0].backward()
    compiled_grads = [t.grad.clone() for t in leaves[:3]]
    assert counter.frame_count == 1  # one graph: fullgraph=True would have raised on a break

    for t in leaves[:3]:
        t.grad = None
    expected = fn(flce, *leaves)
    expected[0].backward()
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for got, t in zip(compiled_grads, leaves[:3], strict=True):
        torch.testing.assert_close(got, t.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["interpreter", "torch"])
def test_compiled_model_with_fused_loss_matches_eager(flce, monkeypatch, path):
    """A patched tiny Llama compiled whole: backbone, lm_head weight, fused loss and metrics."""
    pytest.importorskip("transformers")
    if path == "interpreter" and torch.cuda.is_available():
        pytest.skip("the interpreter path is the CPU stand-in for the Triton kernels (decorated for the GPU here)")
    monkeypatch.setenv("TRITON_INTERPRET", PATHS[path])
    eager = flce.patch_forward(tiny_causal_lm("llama-tied"))
    batch = tiny_batch(eager)
    model = copy.deepcopy(eager)
    compiled, counter = _compiled(model)
    out = compiled(**batch, num_items_in_batch=torch.tensor(15), return_metrics=True)
    out.loss.backward()
    assert counter.frame_count == 1

    ref = eager(**batch, num_items_in_batch=torch.tensor(15), return_metrics=True)
    ref.loss.backward()
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
    # aot_eager replays the same fp32 ops; Inductor fuses and reorders the backbone's fp32
    # reductions, a few ulps that a couple of layers amplify to ~1e-6 relative
    assert_grads_close(model, grads(eager), rel=1e-6 if BACKEND == "aot_eager" else 2e-5)
    for key, value in ref.metrics.items():
        torch.testing.assert_close(out.metrics[key], value, rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", ["interpreter", "torch"])
def test_a_compiled_loss_guards_on_no_module_table(flce, device, monkeypatch, path):
    """The DTensor and FSDP checks read their modules off ``torch.distributed``, not
    ``sys.modules``: dynamo would trace that as a dict of every loaded module and guard on it (a
    recompile at any import, and a failed compile when an import grows it mid-trace). A patched
    tiny Llama's loss goes through both checks."""
    pytest.importorskip("transformers")
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", PATHS[path])
    elif path == "interpreter":
        pytest.skip("the interpreter path is the CPU stand-in for the Triton kernels")
    model = tiny_causal_lm("llama-tied")
    batch = {k: v.to(device) for k, v in tiny_batch(model).items()}  # labels from the CPU model
    model = flce.patch_forward(model).to(device)
    hidden, weight, _, targets = _leaves(device)
    for fn, args in ((lambda h, w, t: flce.fused_linear_cross_entropy(h, w, t), (hidden, weight, targets)),
                     (lambda b: model(**b).loss, (batch,))):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0
        names = [guard.name for guard in explained.out_guards]  # e.g. "G['__import_sys'].modules"
        assert names and not [name for name in names if re.search(r"sys\W*\.modules", name)], names
