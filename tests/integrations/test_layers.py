"""The kernels layers: they follow kernels' layer rules, ``kernelize`` swaps them in, and the
swapped-in loss equals the logits-based one. Also pins down what transformers 5.23 does with
its own "ForCausalLMLoss" kernel mapping."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from _tiny import ROOT, assert_grads_close, grads, tiny_batch, tiny_causal_lm
from torch import nn

kernels = pytest.importorskip("kernels")
pytest.importorskip("transformers")


class CausalLMLoss(nn.Module):
    """A model-side loss module as a user (or a future transformers) would write it: the lm_head
    and ``ForCausalLMLoss`` from the logits, replaceable by the layer named "ForCausalLMLoss"."""

    def forward(self, logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                shift_labels=None, hidden_states=None, lm_head_weight=None, lm_head_bias=None, **kwargs):
        from transformers.loss.loss_utils import ForCausalLMLoss

        if logits is None:
            logits = F.linear(hidden_states, lm_head_weight, lm_head_bias)
            if kwargs.get("final_logit_softcapping"):
                cap = kwargs["final_logit_softcapping"]
                logits = cap * torch.tanh(logits / cap)
        return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch, ignore_index, shift_labels)


class TinyLMWithLossModule(nn.Module):
    """Backbone + lm_head of a tiny transformers model, with the loss in a kernelizable module."""

    def __init__(self, causal_lm):
        super().__init__()
        self.lm = causal_lm
        self.loss = kernels.use_kernel_forward_from_hub("ForCausalLMLoss")(CausalLMLoss)()

    def forward(self, input_ids, attention_mask, labels, num_items_in_batch=None):
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        head = self.lm.get_output_embeddings()
        return self.loss(labels=labels, num_items_in_batch=num_items_in_batch, hidden_states=hidden,
                         lm_head_weight=head.weight, lm_head_bias=head.bias, final_logit_softcapping=3.0)


def test_layers_follow_the_kernels_rules(flce):
    """No constructor, no members but the two flags, the forward of the layer it replaces."""
    layers = [obj for obj in vars(flce.layers).values() if isinstance(obj, type) and issubclass(obj, nn.Module)]
    assert [cls.__name__ for cls in layers] == ["ForCausalLMLoss"]
    module_members = {name for name, _ in inspect.getmembers(nn.Module)}
    for cls in layers:
        assert cls.__init__ is nn.Module.__init__
        assert {name for name, _ in inspect.getmembers(cls)} - module_members == {"can_torch_compile", "has_backward"}
        assert cls.can_torch_compile is True and cls.has_backward is True
    ours = inspect.signature(flce.layers.ForCausalLMLoss.forward).parameters.values()
    theirs = inspect.signature(CausalLMLoss.forward).parameters.values()
    assert [(p.name, p.kind) for p in ours] == [(p.name, p.kind) for p in theirs]


@pytest.mark.parametrize("mode", ["TRAINING", "TRAINING|TORCH_COMPILE"])
def test_kernelize_swaps_in_the_fused_loss(flce, monkeypatch, mode):
    """kernelize (local repository, CPU) replaces the loss module's forward; same loss and
    gradients as the original logits-based forward. Torch CPU path: only the wiring is new."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = TinyLMWithLossModule(tiny_causal_lm("gemma2-softcap"))
    batch = tiny_batch(model.lm)
    loss = model(**batch, num_items_in_batch=torch.tensor(30))
    loss.backward()
    ref_loss, ref_grads = loss.detach(), grads(model)
    model.zero_grad()

    repo = kernels.LocalLayerRepository(repo_path=ROOT, layer_name="ForCausalLMLoss")
    kernel_mode = kernels.Mode.TRAINING
    if "TORCH_COMPILE" in mode:
        kernel_mode |= kernels.Mode.TORCH_COMPILE
    with kernels.use_kernel_mapping({"ForCausalLMLoss": {"cpu": repo}}):
        kernels.kernelize(model, mode=kernel_mode, device="cpu")
    assert model.loss.forward.__func__.__module__.endswith(".layers")  # swapped in
    loss = model(**batch, num_items_in_batch=torch.tensor(30))
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=0)
    assert_grads_close(model, ref_grads)


def test_layer_from_logits_is_transformers_loss(flce):
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    logits, labels = torch.randn(2, 7, 30), torch.randint(0, 30, (2, 7))
    labels[0, :2] = -100
    layer = flce.layers.ForCausalLMLoss()
    for num_items in (None, torch.tensor(17)):
        expected = ForCausalLMLoss(logits, labels, 30, num_items_in_batch=num_items)
        assert torch.equal(layer(logits=logits, labels=labels, vocab_size=30, num_items_in_batch=num_items), expected)


