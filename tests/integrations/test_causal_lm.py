"""The causal-LM loss from hidden states equals transformers' own logits-based loss: loss, the
gradient of every parameter and the metrics, on tiny random models (float32, CPU)."""

import copy
import math
import types

import pytest
import torch
import torch.nn.functional as F
from _tiny import ARCHS, assert_grads_as_accurate, assert_grads_close, grads, logits_metrics, tiny_batch, tiny_causal_lm

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
    """Interpreter path: loss, every gradient and the metrics, per architecture; the gradients
    against a float64 copy of the model, as accurate as the fp32 model's own."""
    model = tiny_causal_lm(arch)
    batch = tiny_batch(model)
    ref_loss, ref_grads, ref_metrics = _reference(model, batch)
    _, exact_grads, _ = _reference(copy.deepcopy(model).double(), batch)

    model.zero_grad()
    out = flce.fused_forward(model, **batch, return_metrics=True)
    out.loss.backward()

    assert out.logits is None
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=1e-5, atol=0)
    assert_grads_as_accurate(model, exact_grads, ref_grads)
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


def test_fused_forward_keeps_the_models_cache_default(flce, monkeypatch):
    """Without an attention mask, the patched forward runs the backbone as the model's own forward
    does (its use_cache default): without a cache, transformers looks for packed sequences in the
    position ids and reads the answer on the host, one sync a step (perf notes, run 39). Counted:
    the search runs in neither forward by default, and runs with use_cache=False (so the count can
    see it)."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        pytest.skip("this transformers has no packed-sequence search")
    calls = []
    search = masking_utils.find_packed_sequence_indices

    def counted(*args, **kwargs):
        calls.append(1)
        return search(*args, **kwargs)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    model = flce.patch_forward(tiny_causal_lm("llama"))
    batch = tiny_batch(model)
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    counts = {}
    for name, kwargs in (("fused", {}), ("original", dict(fused_loss=False)),
                         ("fused without cache", dict(use_cache=False))):
        calls.clear()
        model(**inputs, **kwargs).loss.backward()
        counts[name] = len(calls)
    assert counts == {"fused": 0, "original": 0, "fused without cache": 1}


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


# ---- the raw function with shift=1 ------------------------------------------------------------
def test_raw_function_with_shift_matches_model_loss(flce):
    """``fused_linear_cross_entropy(hidden, lm_head.weight, labels, shift=1)``: the model's own loss
    with Hugging Face labels (unshifted), and its metrics through ``token_metrics``."""
    model = tiny_causal_lm("llama")
    batch = tiny_batch(model)
    ref_loss, ref_grads, ref_metrics = _reference(model, batch)

    model.zero_grad()
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    loss, metrics = flce.fused_linear_cross_entropy(hidden, model.lm_head.weight, batch["labels"], shift=1,
                                                    return_metrics=True)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(model, ref_grads)
    _check_metrics(metrics, ref_metrics)
    means = flce.token_metrics(metrics)
    n = ref_metrics["num_valid_tokens"]
    assert means["mean_token_accuracy"].item() == pytest.approx(ref_metrics["num_correct_tokens"] / n)
    assert means["entropy"].item() == pytest.approx(ref_metrics["entropy_sum"] / n, rel=1e-5)
    # without the shift the loss is another one (the mismatch shift=1 exists to avoid)
    unshifted = flce.fused_linear_cross_entropy(hidden.detach(), model.lm_head.weight.detach(), batch["labels"])
    assert abs(unshifted.item() - ref_loss.item()) > 1e-3


def test_token_metrics_needs_the_three_sums(flce):
    with pytest.raises(KeyError, match="num_valid_tokens"):
        flce.token_metrics({"num_correct_tokens": torch.tensor(1), "entropy_sum": torch.tensor(1.0)})


# ---- patching: idempotent, undone, by class or model type, reduction ------------------------------
def _fused_path_taken(model, batch) -> bool:
    return model(**batch).logits is None


def test_patch_forward_twice_patches_once(flce):
    """A re-run notebook cell: patching again wraps the forward once (no recursion in eval or
    training), with the latest options."""
    model = tiny_causal_lm("qwen2")
    batch = tiny_batch(model)
    ref_loss, ref_grads, _ = _reference(model, batch)
    assert flce.patch_forward(flce.patch_forward(model)) is model
    assert model._flce_original_forward is None  # the class's forward under the patch, not the first patch
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    assert out.logits is None
    torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(model, ref_grads)
    model.eval()
    torch.testing.assert_close(model(**batch).loss, ref_loss, rtol=1e-6, atol=0)  # the original forward
    model.train()
    flce.patch_forward(model, when_training=False)
    assert not _fused_path_taken(model, batch)


def test_unpatch_forward_restores_the_model(flce):
    model = tiny_causal_lm("llama")
    batch = tiny_batch(model)
    assert flce.unpatch_forward(model) is model  # not patched: nothing to undo
    flce.patch_forward(model)
    twin = copy.deepcopy(model)  # a patched copy is undone on its own
    assert flce.unpatch_forward(model) is model
    assert "forward" not in vars(model) and "_flce_original_forward" not in vars(model)
    assert not _fused_path_taken(model, batch) and _fused_path_taken(twin, batch)
    flce.unpatch_forward(twin)
    assert not _fused_path_taken(twin, batch)
    # a forward set on the model itself before the patch comes back
    own = types.MethodType(lambda self, **kwargs: "own forward", model)
    model.forward = own
    flce.patch_forward(model)
    assert model(**batch, fused_loss=False) == "own forward"
    flce.unpatch_forward(model)
    assert model.forward == own


def test_patch_by_model_type(flce):
    """``patch_forward("llama")`` patches transformers' LlamaForCausalLM (instances made later too,
    as ``from_pretrained`` inside a Trainer), not other families; a model patched on top of its
    patched class decides once; ``unpatch_forward("llama")`` restores the class."""
    import transformers

    cls = transformers.LlamaForCausalLM
    original = cls.forward
    try:
        assert flce.patch_forward("llama") is cls
        flce.patch_forward("llama")  # once
        assert cls.forward.__wrapped__ is original
        model = tiny_causal_lm("llama")
        batch = tiny_batch(model, seed=2)
        assert _fused_path_taken(model, batch)
        other = tiny_causal_lm("qwen2")
        assert not _fused_path_taken(other, tiny_batch(other))
        model.zero_grad()
        fused_loss = model(**batch).loss
        fused_loss.backward()
        fused_grads = grads(model)
        ref_loss, _, _ = _reference(model, batch, fused_loss=False)  # the class's original forward
        torch.testing.assert_close(fused_loss.detach(), ref_loss, rtol=1e-5, atol=0)
        assert_grads_close(model, fused_grads)  # the reference's gradients against the fused ones
        flce.patch_forward(model, when_training=False)  # the model's patch decides, not the class's
        assert not _fused_path_taken(model, batch)
        assert model(**batch, fused_loss=True).logits is None
        flce.unpatch_forward(model)
        assert _fused_path_taken(model, batch)
    finally:
        flce.unpatch_forward("llama")
    assert cls.forward is original and "_flce_class_forward" not in vars(cls)
    assert not _fused_path_taken(model, batch)
    with pytest.raises(ValueError, match="no-such-model"):
        flce.patch_forward("no-such-model")


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_patched_reduction(flce, reduction):
    """``patch_forward(model, reduction=...)``: the sum over the positions, or the loss of each
    position (B, S) against the next label (0 where ignored), from the model's own logits."""
    model = flce.patch_forward(tiny_causal_lm("gemma2-softcap"), reduction=reduction)
    batch = tiny_batch(model)
    logits = model(**batch, fused_loss=False).logits.detach()
    targets = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
    out = model(**batch)
    assert out.logits is None
    if reduction == "none":
        assert out.loss.shape == batch["labels"].shape
        expected = expected.reshape(targets.shape)
    torch.testing.assert_close(out.loss.detach(), expected, rtol=1e-5, atol=1e-6)
    # a call's own reduction wins; num_items_in_batch divides the default "mean" only
    mean = model(**batch, reduction="mean", num_items_in_batch=torch.tensor(7)).loss
    torch.testing.assert_close(mean.detach() * 7, F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                                  reduction="sum"), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="reduction"):
        flce.patch_forward(model, reduction="avg")
