"""Transformers causal LMs whose loss skips the logits: ``fused_forward`` and ``patch_forward``.

``fused_forward`` runs a ``*ForCausalLM``'s backbone and then ``causal_lm_loss`` of its last
hidden state with the output embeddings; ``patch_forward`` makes ``model(...)`` do so in training.
These read a transformers model but import nothing from transformers at module level: the kernel
has no Python dependencies. ``patch_forward`` also takes a model class, or a model type such as
``"llama"`` (then transformers is imported to find its ``*ForCausalLM`` class).
"""

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from .causal_lm import causal_lm_loss


def logit_options(config: Any) -> dict[str, float | None]:
    """``{"logit_scale", "softcap"}`` of the final logits of a transformers causal-LM config.

    Read as the models of transformers 5.x apply them after the lm_head: Gemma-2/3/3n/4's
    ``final_logit_softcapping``; Cohere's ``logit_scale``; Falcon-H1's ``lm_head_multiplier``;
    Granite's ``logits_scaling`` (a divisor; HyperCLOVA X multiplies by it). Multimodal configs
    are read through their text config.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scaling = float(text.logits_scaling)
        scale = scaling if getattr(text, "model_type", None) == "hyperclovax" else 1.0 / scaling
    return {"logit_scale": 1.0 if scale is None else float(scale), "softcap": float(softcap) if softcap else None}


@dataclass
class FusedCausalLMOutput:
    """What ``fused_forward`` returns: a ``CausalLMOutputWithPast`` without logits, plus the loss's
    metrics (and lse when asked). Indexing works as on transformers' ``ModelOutput``:
    ``out["loss"]``, or ``out[0]`` over the fields that are not None."""

    loss: Tensor | None = None
    logits: Tensor | None = None
    past_key_values: Any = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    metrics: dict[str, Tensor] | None = None
    lse: Tensor | None = None

    def to_tuple(self) -> tuple:
        return tuple(v for v in (getattr(self, f.name) for f in fields(self)) if v is not None)

    def __getitem__(self, key: str | int):
        return getattr(self, key) if isinstance(key, str) else self.to_tuple()[key]


# Arguments of a *ForCausalLM forward that its backbone does not take.
_HEAD_ONLY_ARGUMENTS = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "return_dict")


def _named_arguments(model, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, per the signature of the model class's forward."""
    if not args:
        return dict(kwargs)
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
    named = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL and name != "self":
            named[name] = value
    return named


def fused_forward(
    model,
    *args,
    labels: Tensor | None = None,
    shift_labels: Tensor | None = None,
    num_items_in_batch: Tensor | int | None = None,
    ignore_index: int = -100,
    return_metrics: bool = False,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    return_lse: bool = False,
    reduction: str = "mean",
    **kwargs,
):
    """A transformers ``*ForCausalLM`` forward whose loss skips the logits.

    Runs the backbone (``model.base_model``) on the inputs, then ``causal_lm_loss`` of its last
    hidden state with the output embeddings (``model.get_output_embeddings()``, so tied weights
    get their gradient through both uses) and the config's ``logit_options``. Same loss as
    ``model(**inputs, labels=labels).loss``.

    Args:
        model: a transformers causal LM (``LlamaForCausalLM``, ``Gemma2ForCausalLM``...).
        *args, **kwargs: the model's inputs (input_ids, attention_mask, position_ids...).
        labels, shift_labels, num_items_in_batch, ignore_index: as for the model's loss.
        return_metrics, label_smoothing, z_loss_scale, return_lse, reduction: see ``causal_lm_loss``.

    Returns:
        A ``FusedCausalLMOutput`` with ``loss`` (0-d float32; (B, S) with reduction "none"),
        ``logits=None``, the backbone's ``past_key_values``/``hidden_states``/``attentions``,
        ``metrics`` (with return_metrics) and ``lse`` (B, S) (with return_lse).
    """
    inputs = _named_arguments(model, args, kwargs)
    labels = inputs.pop("labels", labels)
    shift_labels = inputs.pop("shift_labels", shift_labels)
    num_items_in_batch = inputs.pop("num_items_in_batch", num_items_in_batch)
    for name in _HEAD_ONLY_ARGUMENTS:
        inputs.pop(name, None)
    # use_cache stays the model's own default, as in its forward with labels: without a cache (and
    # without an attention mask) transformers looks for packed sequences in the position ids and
    # reads the answer on the host, a sync that left the GPU idle every step (perf notes, run 39).
    backbone = model.base_model
    outputs = backbone(**inputs)
    hidden = outputs.last_hidden_state
    loss = functools.partial(
        causal_lm_loss, labels=labels, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
        shift_labels=shift_labels, **logit_options(model.config), return_metrics=return_metrics,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, return_lse=return_lse, reduction=reduction,
    )
    result = _output_head_loss(model.get_output_embeddings(), hidden, loss)
    result = list(result) if isinstance(result, tuple) else [result]
    return FusedCausalLMOutput(
        loss=result[0],
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        metrics=result[1] if return_metrics else None,
        lse=result[-1] if return_lse else None,
    )


def _output_head_loss(lm_head, hidden: Tensor, loss: Callable):
    """``loss(hidden, lm_head_weight=..., lm_head_bias=...)`` with lm_head's parameters as its forward sees them.

    An FSDP2 unit (``fully_shard(lm_head)``, or ``fully_shard([embed_tokens, lm_head])`` when tied)
    holds them sharded outside its forward. The loss then runs as lm_head's forward, called as the
    model's own forward calls it: FSDP2's hooks around the call gather the parameters before it and
    reshard them after (and, in the backward, gather them again and reduce-scatter their gradients),
    as for the logits. A DTensor weight of tensor parallelism (``ColwiseParallel``) is read as is:
    the loss takes it as vocabulary parallelism.
    """
    # imported wherever fully_shard was called (read off its package, not sys.modules, which
    # torch.compile would trace and guard on whole: _dtensor._dtensor_module)
    fsdp = getattr(torch.distributed, "fsdp", None)
    if fsdp is None or not isinstance(lm_head, getattr(fsdp, "FSDPModule", ())):
        return loss(hidden, lm_head_weight=lm_head.weight, lm_head_bias=lm_head.bias)
    own_forward = vars(lm_head).get("forward")  # an instance's forward (accelerate's hooks), if any
    lm_head.forward = functools.partial(_loss_of_parameters, lm_head, loss=loss)
    try:
        return lm_head(hidden)
    finally:
        if own_forward is None:
            del lm_head.forward
        else:
            lm_head.forward = own_forward


def _loss_of_parameters(module, hidden: Tensor, loss: Callable):
    return loss(hidden, lm_head_weight=module.weight, lm_head_bias=module.bias)


def _causal_lm_class(model_type: str) -> type:
    """transformers' ``*ForCausalLM`` class of a model type ("llama", "qwen2", "gemma2"...)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ValueError(f"no causal-LM class for model type {model_type!r} in transformers {transformers.__version__}")
    return getattr(transformers, name)


def _fused_or_original(call_original, signature_of, when_training: bool, reduction: str):
    """The patched forward: ``fused_forward`` when asked (``fused_loss=True``) or when training with
    labels (if ``when_training``), else ``call_original(self, *args, **kwargs)``."""

    @functools.wraps(signature_of)
    def forward(self, *args, fused_loss: bool | None = None, **kwargs):
        if fused_loss is None:
            has_labels = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
            fused_loss = when_training and self.training and has_labels
        if fused_loss:
            return fused_forward(self, *args, **{"reduction": reduction, **kwargs})
        return call_original(self, *args, **kwargs)

    forward._flce_patched = True
    return forward


def _call_unpatched(function, self, *args, **kwargs):
    # A patched class under a patched model: the model's patch has decided already.
    if getattr(function, "_flce_patched", False):
        kwargs["fused_loss"] = False
    return function(self, *args, **kwargs)


def _call_instance_original(self, *args, **kwargs):
    # Looked up on the model at each call, not kept in a closure: copy.deepcopy rebinds the
    # attribute to the copy (a reference model made by deepcopy must not run the original's weights).
    own = self._flce_original_forward
    if own is not None:  # a forward set on the model itself before the patch
        return own(*args, **kwargs)
    return _call_unpatched(type(self).forward, self, *args, **kwargs)  # the class's, as it is now


def patch_forward(model, *, when_training: bool = True, reduction: str = "mean"):
    """Makes ``model(...)`` compute its loss with ``fused_forward``, in place; returns ``model``.

    After it, ``model(**inputs, labels=labels)`` takes the fused path while ``model.training``
    (when ``when_training``), and ``model(..., fused_loss=True)`` always does; otherwise (eval,
    generation, no labels, ``fused_loss=False``) the original forward runs and returns logits.
    The fused path also takes ``return_metrics``, ``label_smoothing``, ``z_loss_scale``,
    ``return_lse`` and ``reduction`` (see ``fused_forward``); ``reduction`` here is its default.
    Wrappers (DDP, FSDP, accelerate) keep working since the call still goes through
    ``model.forward``; the patched forward keeps the class forward's signature, which the HF
    Trainer and ``generate`` inspect.

    Patching again replaces the previous patch (the latest options apply; the forward is wrapped
    once); ``unpatch_forward`` undoes it.

    Args:
        model: a transformers causal-LM model; or its class (every instance, also those made later,
            e.g. by ``from_pretrained`` inside a Trainer); or a model type such as ``"llama"``, for
            transformers' ``*ForCausalLM`` class of that type.
        when_training: take the fused path by default in training mode when labels are given.
        reduction: "mean" (transformers' loss), "sum" or "none" (a (B, S) loss per position).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    target = _causal_lm_class(model) if isinstance(model, str) else model
    unpatch_forward(target)
    if isinstance(target, type):
        original = target.forward
        target._flce_class_forward = (original, "forward" in vars(target))
        target.forward = _fused_or_original(functools.partial(_call_unpatched, original), original, when_training,
                                            reduction)
    else:
        target._flce_original_forward = vars(target).get("forward")  # None: the class's own
        forward = _fused_or_original(_call_instance_original, type(target).forward, when_training, reduction)
        target.forward = types.MethodType(forward, target)
    return target


def unpatch_forward(model):
    """Undoes ``patch_forward`` on a model, a model class or a model type; returns the model or
    class. Nothing happens if it is not patched."""
    target = _causal_lm_class(model) if isinstance(model, str) else model
    if isinstance(target, type):
        if "_flce_class_forward" in vars(target):
            original, had_own = target._flce_class_forward
            del target._flce_class_forward
            if had_own:
                target.forward = original
            else:
                del target.forward
    elif "_flce_original_forward" in vars(target):
        own = target._flce_original_forward
        del target._flce_original_forward
        if own is None:
            del target.forward
        else:
            target.forward = own
    return target
