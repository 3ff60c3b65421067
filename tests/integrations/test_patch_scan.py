"""``patch_forward`` on every causal-LM class of transformers: the patched model's loss and gradients
are its own forward's, or it is refused with the reason. Each model type is built tiny from its
default config (tests/_patch_scan.py); those that do not build are listed, with the error, in
tests/integrations/patch_scan.json (written with docs/patch-scan.md by tests/_patch_scan.py run as a
script, which compares every model type). Here one model type of each distinct forward (``forward_key``:
88 for 189 types) is built and compared, and the others' models, built on the meta device, pass
through ``patch_forward``'s checks (the same head code, their own config and attributes).
The fused loss runs on the PyTorch path (TRITON_INTERPRET=0): what is tested is the head."""

import json
import re
import warnings

import pytest
import torch
from conftest import ROOT

transformers = pytest.importorskip("transformers")
from _patch_scan import GRAD_RTOL, LOSS_RTOL, causal_lm_class, compare, forward_key, matches, scan  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

LISTING = json.loads((ROOT / "tests" / "integrations" / "patch_scan.json").read_text())
# The listing says which types do not build under the transformers it was made with.
SAME_TRANSFORMERS = LISTING["transformers"] == transformers.__version__
REFUSED = "needs a causal LM whose loss is transformers' ForCausalLMLoss of lm_head"


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the configs' own notices on the shrunk sizes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="session")
def compared_for() -> dict[str, str]:
    """model type -> the model type of the same forward that is built and compared (the first that
    builds, per the listing)."""
    groups = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        groups.setdefault(forward_key(causal_lm_class(model_type)), []).append(model_type)
    chosen = {}
    for members in groups.values():
        buildable = [t for t in members if not (SAME_TRANSFORMERS and t in LISTING["not_built"])] or members
        chosen.update(dict.fromkeys(members, buildable[0]))
    return chosen


@pytest.mark.parametrize("model_type", list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_patched_model_has_its_own_loss_or_is_refused(flce, compared_for, model_type):
    outcome = scan(flce, model_type, numbers=compared_for[model_type] == model_type)
    if "accepted" in outcome:  # checked on the meta device: its forward's head is compared under another type
        if SAME_TRANSFORMERS:
            if model_type in LISTING["not_built"]:
                pytest.skip(f"not built: {LISTING['not_built'][model_type]}")
            assert model_type in LISTING["verified"], "rerun tests/_patch_scan.py"
        return
    if "refused" in outcome:
        assert REFUSED in outcome["refused"], outcome
        if SAME_TRANSFORMERS:
            assert outcome["refused"] == LISTING["refused"].get(model_type), "rerun tests/_patch_scan.py"
        return
    if "not_built" in outcome:
        if SAME_TRANSFORMERS:
            # the exception's type: its message is torch's, and varies between torch releases
            recorded = LISTING["not_built"].get(model_type) or ""
            assert outcome["not_built"].split(":")[0] == recorded.split(":")[0], "rerun tests/_patch_scan.py"
        pytest.skip(f"not built: {outcome['not_built']}")
    assert matches(outcome), (f"{model_type}: loss {outcome['loss']} vs patched {outcome['fused_loss']} "
                              f"(rtol {LOSS_RTOL}); gradients {outcome['grad_rel_diff']:.2e} apart (rtol {GRAD_RTOL})")
    if SAME_TRANSFORMERS:
        assert model_type in LISTING["verified"], "rerun tests/_patch_scan.py"


@pytest.mark.parametrize("model_type, reason", [
    ("recurrent_gemma", None),  # its logits_soft_cap is a soft cap: reproduced
    ("xlstm", "xLSTMForCausalLM.forward does with its logits what the fused loss does not reproduce: if not "
              "self.training and self.config.max_inference_chunksize < logits.shape[1]:"),
    ("inkling_text", "InklingForCausalLM.forward does with its logits what the fused loss does not reproduce: if "
                     "unpadded_vocab_size is not None and unpadded_vocab_size < logits.shape[-1]:"),
    ("inkling2_text", "Inkling2ForCausalLM.forward does with its logits what the fused loss does not reproduce: "
                      "logits = self.logit_softcap(logits)"),
    ("git", "GitForCausalLM.forward does with its logits what the fused loss does not reproduce: "),
])
def test_the_issues_classes(flce, model_type, reason):
    """RecurrentGemma's soft cap, xLSTM's chunked soft cap, Inkling's cut to the unpadded vocabulary,
    Git's offset of the image tokens: each reproduced or refused with the statement that is not."""
    cls = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if reason is None:
        outcome = scan(flce, model_type)
        assert "loss" in outcome and matches(outcome), outcome
        return
    with pytest.raises(ValueError, match=f"patch_forward {REFUSED}.*: {re.escape(reason)}"):
        flce.patch_forward(getattr(transformers, cls))


def test_the_issues_reproducer_gets_the_unpatched_loss(flce):
    """RecurrentGemma with logits_soft_cap=2: the loss moved from 4.606041 to 4.608813 when patched."""
    config = transformers.RecurrentGemmaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, lru_width=32, attention_window_size=16,
        block_types=["recurrent", "attention"], logits_soft_cap=2.0)
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(config).eval()
    outcome = compare(flce, model, vocab=96)
    assert "loss" in outcome and matches(outcome), outcome


class _LlamaCuttingItsVocabulary(transformers.LlamaForCausalLM):
    """A remote-code Llama whose forward drops the last logits before its loss."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits[..., :100]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=100, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class _LlamaScalingByItsOwnNumber(transformers.LlamaForCausalLM):
    """A Llama whose forward scales its logits by a config attribute that ``logit_options`` does not read."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits * self.config.output_multiplier
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class _LlamaScalingItsEmbeddings(transformers.LlamaForCausalLM):
    """A Llama whose forward scales the input embeddings before its backbone (fused_forward passes the inputs)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        inputs_embeds = self.model.embed_tokens(input_ids) * 2.0
        hidden_states = self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_forward_that_changes_its_inputs_is_refused(flce):
    with pytest.raises(ValueError, match=r"_LlamaScalingItsEmbeddings.forward prepares its backbone's inputs otherwise "
                                         r"than fused_forward passes them: inputs_embeds = self.model.embed_tokens"):
        flce.patch_forward(_LlamaScalingItsEmbeddings)


def test_a_forward_that_changes_its_logits_otherwise_is_refused(flce):
    """The rule reads what the forward does after lm_head, not whether it calls self.loss_function:
    a cut of the vocabulary is refused by the class; a scale whose number the config reading does
    not know, by the model."""
    with pytest.raises(ValueError, match=r"_LlamaCuttingItsVocabulary.forward does with its logits what the fused "
                                         r"loss does not reproduce: logits = logits\[\.\.\., :100\]"):
        flce.patch_forward(_LlamaCuttingItsVocabulary)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    config.output_multiplier = 0.5
    flce.patch_forward(_LlamaScalingByItsOwnNumber)  # the class passes: the number is read per model
    try:
        with pytest.raises(ValueError, match=r"applies \{'logit_scale': 0.5, 'softcap': None\} to its logits"):
            flce.patch_forward(_LlamaScalingByItsOwnNumber(config))
    finally:
        flce.unpatch_forward(_LlamaScalingByItsOwnNumber)
