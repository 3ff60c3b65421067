"""The causal-LM loss from hidden states equals transformers' own logits-based loss: loss, the
gradient of every parameter and the metrics, on tiny random models (float32, CPU)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from _tiny import ARCHS, assert_grads_close, grads, logits_metrics, tiny_batch, tiny_causal_lm

pytest.importorskip("transformers")


def _reference(model, batch, **loss_kwargs):
    """The model's own loss (from its logits), its gradients, and metrics from its logits."""
    model.zero_grad()
    out = model(**batch, **loss_kwargs)
    out.loss.backward()
    return out.loss.detach(), grads(model), logits_metrics(out.logits.detach(), batch["labels"])


def _check_metrics(metrics, expected):
    assert metrics["num_valid_tokens"].dtype == torch.int64
    assert metrics["num_correct_tokens"].dtype == torch.int64
    assert int(metrics["num_valid_tokens"]) == expected["num_valid_tokens"]
    assert int(metrics["num_correct_tokens"]) == expected["num_correct_tokens"]
    assert expected["num_correct_tokens"] > 0  # the batch makes accuracy non-trivial
    assert float(metrics["entropy_sum"]) == pytest.approx(expected["entropy_sum"], rel=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_forward_matches_model_loss(flce, arch):
    """Interpreter path: loss, every gradient and the metrics, per architecture."""
    model = tiny_causal_lm(arch)
    batch = tiny_batch(model)
    ref_loss, ref_grads, ref_metrics = _reference(model, batch)

    model.zero_grad()
    out = flce.fused_forward(model, **batch, return_metrics=True)
    out.loss.backward()

    assert out.logits is None
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(model, ref_grads)
    _check_metrics(out.metrics, ref_metrics)


def test_logit_options_read_the_config(flce):
    """The final-logit transforms of the configs, as their modeling code applies them."""
    from transformers import CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

    assert flce.logit_options(LlamaConfig()) == {"logit_scale": 1.0, "softcap": None}
    assert flce.logit_options(Gemma2Config(final_logit_softcapping=30.0)) == {"logit_scale": 1.0, "softcap": 30.0}
    assert flce.logit_options(Gemma2Config(final_logit_softcapping=None))["softcap"] is None
    assert flce.logit_options(CohereConfig(logit_scale=0.0625))["logit_scale"] == 0.0625
    assert flce.logit_options(GraniteConfig(logits_scaling=8.0))["logit_scale"] == 1 / 8


def test_num_items_in_batch_and_shift_labels(flce):
    """Sum divided by num_items_in_batch (gradient accumulation), and pre-shifted labels, through
    the patched forward with positional input_ids."""
    model = flce.patch_forward(tiny_causal_lm("qwen2"))
    batch = tiny_batch(model, seed=1)
    shift_labels = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:].contiguous()  # transformers views it
    num_items = torch.tensor(41)  # > this micro-batch's count, as over accumulated micro-batches
    ref_loss, ref_grads, _ = _reference(
        model, batch, fused_loss=False, num_items_in_batch=num_items, shift_labels=shift_labels
    )
    expected = F.cross_entropy(
        model(**batch, fused_loss=False).logits.detach().flatten(0, 1), shift_labels.flatten(),
        reduction="sum") / 41
    torch.testing.assert_close(ref_loss, expected, rtol=1e-6, atol=0)  # transformers' semantics

    model.zero_grad()
    out = model(batch["input_ids"], batch["attention_mask"], shift_labels=shift_labels, num_items_in_batch=num_items)
    out[0].backward()
    torch.testing.assert_close(out["loss"].detach(), ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(model, ref_grads)


def test_patched_model_keeps_logits_outside_training(flce):
    model = flce.patch_forward(tiny_causal_lm("llama"))
    batch = tiny_batch(model)
    assert model(**batch).logits is None  # training with labels: fused
    model.eval()
    out = model(**batch)  # eval: the original forward, with logits and the same loss
    assert out.logits.shape == (2, 12, 128)
    fused = model(**batch, fused_loss=True)
    torch.testing.assert_close(fused.loss, out.loss, rtol=1e-5, atol=0)
    # a deepcopy (a reference model, say) runs its own weights on both paths
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.get_output_embeddings().weight.mul_(2.0)
    twin_out = twin(**batch)
    assert not torch.allclose(twin_out.logits, out.logits)
    torch.testing.assert_close(twin(**batch, fused_loss=True).loss, twin_out.loss, rtol=1e-5, atol=0)


def test_loss_terms_pass_through(flce, monkeypatch):
    """label_smoothing, z_loss_scale and return_lse reach the core (torch CPU path, fp64 reference)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(50, 16).requires_grad_()
    labels = torch.randint(0, 50, (2, 9))
    labels[1, :3] = -100
    eps, z_scale = 0.1, 1e-2
    loss, metrics, lse = flce.causal_lm_loss(
        hidden, weight, labels, num_items_in_batch=20, logit_scale=0.7, softcap=4.0, return_metrics=True,
        label_smoothing=eps, z_loss_scale=z_scale, return_lse=True,
    )
    loss.backward()

    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    z = 4.0 * torch.tanh(h @ w.T * 0.7 / 4.0)
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    valid = targets != -100
    ref_lse = z.logsumexp(-1)
    ce = F.cross_entropy(z.flatten(0, 1), targets.flatten(), label_smoothing=eps, reduction="sum")
    ref = (ce + z_scale * (ref_lse[valid] ** 2).sum()) / 20
    ref.backward()
    assert lse.shape == labels.shape
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(hidden.grad.double(), h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad.double(), w.grad, rtol=1e-4, atol=1e-6)
    assert int(metrics["num_valid_tokens"]) == int(valid.sum())


def test_all_ignored_is_nan_as_transformers(flce, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hidden, weight = torch.randn(1, 4, 8), torch.randn(10, 8)
    labels = torch.full((1, 4), -100)
    assert math.isnan(flce.causal_lm_loss(hidden, weight, labels).item())
    assert flce.causal_lm_loss(hidden, weight, labels, num_items_in_batch=3).item() == 0.0


def test_token_metrics_sums_over_ranks_before_dividing(flce, tmp_path):
    """Two gloo ranks: the ratio of the totals (7/10), not the mean of the ratios (0.625)."""
    import torch.multiprocessing as mp
    from _ranks import token_metrics_on_rank  # a light module: each rank imports it

    results = str(tmp_path / "metrics")
    # fork: the ranks start in a fraction of a second, with the kernel already imported
    mp.start_processes(token_metrics_on_rank, args=(str(tmp_path / "store"), results), nprocs=2, start_method="fork")
    for rank in range(2):
        out = torch.load(f"{results}.{rank}")
        assert out["mean_token_accuracy"] == pytest.approx(7 / 10)
        assert out["entropy"] == pytest.approx(5 / 10)


def test_token_metrics_single_process_and_empty(flce):
    metrics = {
        "num_correct_tokens": torch.tensor(3), "entropy_sum": torch.tensor(1.5), "num_valid_tokens": torch.tensor(4)
    }
    out = flce.token_metrics(metrics, sum_across=lambda t: t * 2)  # as if two identical ranks
    assert (out["mean_token_accuracy"].item(), out["entropy"].item()) == (0.75, 0.375)
    empty = flce.token_metrics({k: torch.zeros_like(v) for k, v in metrics.items()})
    assert (empty["mean_token_accuracy"].item(), empty["entropy"].item()) == (0.0, 0.0)


def test_autocast_bf16_matches_model_loss(flce, monkeypatch):
    """Under CPU autocast the backbone gives bf16 hidden states and the lm_head stays fp32: the
    loss casts both as ``lm_head`` would, and agrees with the model's own within bf16 rounding."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_causal_lm("llama", initializer_range=0.02)
    batch = tiny_batch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads, _ = _reference(model, batch)
        model.zero_grad()
        out = flce.fused_forward(model, **batch)
        out.loss.backward()
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=2e-3, atol=0)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert_grads_close(model, ref_grads, rel=3e-2)
