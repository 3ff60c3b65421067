"""``patch_forward``'s entry points: the models it refuses (their loss is another one), a patch that
survives pickle and torch.save, and the fused-only arguments in eval mode. The fused loss runs on
the PyTorch path (TRITON_INTERPRET=0): what is tested here is the routing, not the kernel."""

import copy
import inspect
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from _tiny import VOCAB, assert_grads_close, grads, logits_metrics, tiny_batch, tiny_causal_lm

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")

REFUSED = "needs a causal LM whose loss is transformers' ForCausalLMLoss of lm_head"


def _tiny_bert_mlm():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config).train()


class _LlamaWithAnExtraModule(transformers.LlamaForCausalLM):
    """A Llama whose own forward could apply ``self.adapter`` between the backbone and the lm_head."""

    def __init__(self, config):
        super().__init__(config)
        self.adapter = torch.nn.Linear(config.hidden_size, config.hidden_size)


def test_bert_mlm_would_get_another_loss(flce):
    """Why the refusal matters: the fused loss of BertForMaskedLM's backbone and decoder skips
    Bert's head transform (dense, gelu, layer norm) and shifts the labels, another loss than its own."""
    model = _tiny_bert_mlm()
    batch = tiny_batch(tiny_causal_lm("llama"))
    own = model(**batch).loss
    hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    decoder = model.get_output_embeddings()
    fused = flce.causal_lm_loss(hidden, decoder.weight, batch["labels"], decoder.bias)
    assert abs(fused.item() - own.item()) > 1e-2
    with pytest.raises(ValueError, match=f"fused_forward {REFUSED}.*BertForMaskedLM.*'ForMaskedLM'"):
        flce.fused_forward(model, **batch)


@pytest.mark.parametrize("target, reason", [
    pytest.param(_tiny_bert_mlm, "BertForMaskedLM is no class of transformers' MODEL_FOR_CAUSAL_LM_MAPPING",
                 id="BertForMaskedLM-model"),
    pytest.param(lambda: transformers.BertForMaskedLM, "loss_type is 'ForMaskedLM'", id="BertForMaskedLM-class"),
    pytest.param(lambda: "bert", r"BertLMHeadModel's output embeddings \(cls.predictions.decoder\) come after a head",
                 id="bert-type"),
    pytest.param(lambda: transformers.BartForCausalLM, "BartForCausalLM.forward computes its loss without "
                 "self.loss_function", id="BartForCausalLM-class"),  # its CrossEntropyLoss does not shift
    pytest.param(lambda: torch.nn.Linear(4, 4), "Linear is not a transformers model", id="Linear"),
    pytest.param(lambda: _LlamaWithAnExtraModule(tiny_causal_lm("llama").config),
                 r"modules besides its backbone and lm_head, which may act between them: \['adapter'\]", id="extra"),
])
def test_patch_forward_refuses_models_of_another_loss(flce, target, reason):
    target = target()
    with pytest.raises(ValueError, match=f"patch_forward {REFUSED}.*{reason}"):
        flce.patch_forward(target)
    if not isinstance(target, str):
        assert "_flce_original_forward" not in vars(target) and "_flce_class_forward" not in vars(target)


def test_patch_forward_refuses_a_replaced_loss_or_head(flce):
    model = tiny_causal_lm("llama")
    model.loss_function = lambda *args, **kwargs: torch.tensor(0.0)
    with pytest.raises(ValueError, match=f"{REFUSED}.*loss_function is replaced"):
        flce.patch_forward(model)
    model = tiny_causal_lm("llama")
    model.lm_head = torch.nn.Sequential(model.lm_head)  # a module whose forward is not F.linear
    with pytest.raises(ValueError, match=f"{REFUSED}.*output embeddings are a Sequential, not an nn.Linear"):
        flce.patch_forward(model)


def test_patch_forward_names_what_it_accepts(flce):
    accepted = ("takes a transformers causal LM (a model such as LlamaForCausalLM(config)), its class, or a model type "
                "such as 'llama'; got int 42")
    with pytest.raises(TypeError, match=f"^patch_forward {accepted.replace('(', '.').replace(')', '.')}$"):
        flce.patch_forward(42)
    with pytest.raises(TypeError, match="^unpatch_forward takes a transformers causal LM"):
        flce.unpatch_forward(3.5)


def test_a_patched_class_refuses_its_models_at_their_call(flce):
    """A subclass of a causal LM passes the class check; its models' extra module shows at the call."""
    try:
        flce.patch_forward(_LlamaWithAnExtraModule)
        model = _LlamaWithAnExtraModule(tiny_causal_lm("llama").config).train()
        with pytest.raises(ValueError, match=r"fused_forward .*\['adapter'\]"):
            model(**tiny_batch(tiny_causal_lm("llama")))
    finally:
        flce.unpatch_forward(_LlamaWithAnExtraModule)


def test_moe_router_loss_is_refused(flce):
    """A MoE model adds its router's auxiliary loss with output_router_logits: the fused loss has none."""
    config = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=4, num_experts_per_tok=2, output_router_logits=True)
    model = flce.patch_forward(transformers.Qwen2MoeForCausalLM(config).train())
    batch = tiny_batch(tiny_causal_lm("llama"))
    with pytest.raises(ValueError, match="router's auxiliary loss .* pass output_router_logits=False"):
        model(**batch)
    assert model(**batch, output_router_logits=False).logits is None


# ---- pickle and torch.save ---------------------------------------------------------------------
def _pickled(model):
    return pickle.loads(pickle.dumps(model))


def _torch_saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("round_trip", [_pickled, _torch_saved, copy.deepcopy], ids=["pickle", "torch.save", "copy"])
def test_the_patch_survives_a_round_trip(flce, round_trip):
    """The loaded model's ``model(..., labels=...)`` in training takes the fused path (no logits),
    with the same loss and gradients as before, on its own weights; its forward keeps the signature."""
    model = flce.patch_forward(tiny_causal_lm("llama"))
    batch = tiny_batch(model)
    before = model(**batch)
    before.loss.backward()

    loaded = round_trip(model)
    loaded.zero_grad()
    out = loaded(**batch)
    out.loss.backward()
    assert type(out).__name__ == "FusedCausalLMOutput" and out.logits is None
    torch.testing.assert_close(out.loss.detach(), before.loss.detach(), rtol=0, atol=0)  # the same computation
    assert_grads_close(loaded, grads(model), rel=0)
    assert inspect.signature(loaded.forward) == inspect.signature(type(model).forward).replace(
        parameters=list(inspect.signature(type(model).forward).parameters.values())[1:])
    with torch.no_grad():  # the loaded model's forward runs the loaded weights
        loaded.get_output_embeddings().weight.mul_(2.0)
    assert not torch.allclose(loaded(**batch).loss, before.loss)
    flce.unpatch_forward(loaded)
    assert loaded(**batch).logits is not None


# ---- eval mode -----------------------------------------------------------------------------------
def test_fused_only_arguments_take_the_fused_path_in_eval(flce):
    """The README Quickstart on a model in eval mode (as from_pretrained returns it): return_metrics=True
    takes the fused path (the original forward would swallow it), with the model's own eval loss and
    metrics from its logits; the other fused-only arguments too; fused_loss=False refuses them."""
    model = flce.patch_forward(tiny_causal_lm("llama")).eval()
    batch = tiny_batch(model)
    own = model(**batch)  # eval: the original forward, with logits
    assert own.logits is not None

    out = model(**batch, return_metrics=True)
    assert out.logits is None
    torch.testing.assert_close(out.loss, own.loss, rtol=1e-5, atol=0)
    expected = logits_metrics(own.logits.detach(), batch["labels"])
    assert int(out.metrics["num_valid_tokens"]) == expected["num_valid_tokens"]
    assert int(out.metrics["num_correct_tokens"]) == expected["num_correct_tokens"] > 0
    assert float(out.metrics["entropy_sum"]) == pytest.approx(expected["entropy_sum"], rel=1e-5)

    targets = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    per_position = F.cross_entropy(own.logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    torch.testing.assert_close(model(**batch, reduction="none").loss, per_position, rtol=1e-5, atol=1e-6)
    assert model(**batch, return_lse=True).lse.shape == targets.shape
    assert model(**batch, return_metrics=False).logits is not None  # asking for nothing: the original

    with pytest.raises(ValueError, match="^return_metrics: only the fused path computes these; fused_loss=False"):
        model(**batch, return_metrics=True, fused_loss=False)
    with pytest.raises(ValueError, match="fused_forward computes the loss and no logits: it needs labels"):
        model(input_ids=batch["input_ids"], return_metrics=True)


# ---- what a patched forward says and prints -----------------------------------------------------
def test_a_label_shape_error_names_the_shapes_passed(flce):
    """Labels of another sequence length: the error gives the shapes passed, not flattened counts."""
    model = flce.patch_forward(tiny_causal_lm("llama"))
    batch = tiny_batch(model, seq=16)
    with pytest.raises(ValueError, match=r"^labels of shape \(2, 15\) do not match hidden_states of shape "
                                         r"\(2, 16, 32\): one label per position of its leading shape \(2, 16\)$"):
        model(**{**batch, "labels": batch["labels"][:, :15]})
    with pytest.raises(ValueError, match=r"^shift_labels of shape \(2, 14\) do not match hidden_states"):
        model(**{**batch, "labels": None, "shift_labels": batch["labels"][:, :14]})


class _OutputWarningOnRenamedFields(transformers.modeling_outputs.BaseModelOutputWithPast):
    """A backbone output as transformers 5.25 makes Mamba's: its attributes for the renamed cache field
    warn that the old name is deprecated."""

    def __getattribute__(self, name):
        if name in ("past_key_values", "cache_params"):
            warnings.warn(f"`{name}` is deprecated", FutureWarning, stacklevel=2)
        return super().__getattribute__(name)


def test_the_patched_forward_reads_no_deprecated_output_field(flce, monkeypatch):
    """fused_forward reads the backbone's output as a mapping: no attribute of a renamed field, whose
    property warns (under warnings as errors here)."""
    model = flce.patch_forward(tiny_causal_lm("llama"))
    batch = tiny_batch(model)
    backbone_forward = model.model.forward

    def forward(*args, **kwargs):
        return _OutputWarningOnRenamedFields(**backbone_forward(*args, **kwargs))

    monkeypatch.setattr(model.model, "forward", forward)
    with pytest.warns(FutureWarning, match="deprecated"):  # the stand-in warns on an attribute read
        _ = _OutputWarningOnRenamedFields(last_hidden_state=torch.zeros(1)).past_key_values
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(**batch)
    expected = model(**batch, fused_loss=False).loss
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=0)  # fp32: reassociated sums
