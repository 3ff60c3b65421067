"""Transformers causal LMs whose loss skips the logits: ``fused_forward`` and ``patch_forward``.

``fused_forward`` runs a ``*ForCausalLM``'s backbone and then ``causal_lm_loss`` of its last
hidden state with the output embeddings; ``patch_forward`` makes ``model(...)`` do so in training.
These read a transformers model but import nothing from transformers at module level: the kernel
has no Python dependencies. ``patch_forward`` also takes a model class, or a model type such as
``"llama"`` (then transformers is imported to find its ``*ForCausalLM`` class).

Both refuse a model whose own loss is not transformers' ``ForCausalLMLoss`` of
``lm_head(last hidden state)`` (``_causal_lm_parts``): for any other the fused loss is another loss.
"""

import functools
import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from ._head_source import HeadPlan, head_plan, plan_options, read_path
from .causal_lm import causal_lm_loss


def logit_options(config: Any) -> dict[str, float | None]:
    """``{"logit_scale", "softcap"}`` of the final logits of a transformers causal-LM config.

    Read as the models of transformers 5.x apply them after the lm_head: Gemma-2/3/3n/4's
    ``final_logit_softcapping`` (RecurrentGemma's ``logits_soft_cap``); Cohere's ``logit_scale``;
    Falcon-H1's ``lm_head_multiplier``; Granite's ``logits_scaling`` (a divisor; HyperCLOVA X
    multiplies by it). Multimodal configs are read through their text config. ``patch_forward``
    checks each model's forward against these (``_head_source``).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    if softcap is None:
        softcap = getattr(text, "logits_soft_cap", None)
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


# ---- which models: transformers' ForCausalLMLoss of lm_head(last hidden state) ---------------------
_ACCEPTED = ("a transformers causal LM (a model such as LlamaForCausalLM(config)), its class, or a model type "
             "such as 'llama'")
_REFUSED = ("needs a causal LM whose loss is transformers' ForCausalLMLoss of lm_head(last hidden state), or the "
            "fused loss would be another loss")


def _transformers_bases(cls: type) -> list[type]:
    """The classes of ``cls.__mro__`` that transformers itself defines."""
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "transformers"]


def _loss_type_of_name(name: str) -> str | None:
    """The ``loss_type`` transformers gives a model class of this name (``PreTrainedModel.__init__``)."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    if name in LOSS_MAPPING:
        return name
    found = re.findall(f"({'|'.join(LOSS_MAPPING)})", name)
    return found[0] if found else None


@functools.lru_cache
def _class_problem(cls: type) -> str | None:
    """Why a model of class ``cls`` has another loss than ForCausalLMLoss of its lm_head, as far as the
    class tells; None when it tells none.

    A class qualifies if it is, or subclasses, a class of transformers' MODEL_FOR_CAUSAL_LM_MAPPING
    (what AutoModelForCausalLM makes; FSDP2 subclasses the model's class), or, for a class outside
    that table (remote code), if transformers' loss_type for its name is ForCausalLM; and if its
    forward computes the loss with ``self.loss_function`` (transformers' ForCausalLMLoss for that
    loss_type; BartForCausalLM's own CrossEntropyLoss does not shift the labels, say). Tied output
    embeddings that are no direct child (BertLMHeadModel's ``cls.predictions.decoder``) come after a
    head transform of the hidden state.
    """
    if not any(c.__name__ == "PreTrainedModel" for c in _transformers_bases(cls)):
        return f"{cls.__name__} is not a transformers model"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    registered = any(c.__name__ in causal_lm_names for c in _transformers_bases(cls))
    if not registered and _loss_type_of_name(cls.__name__) != "ForCausalLM":
        return (f"{cls.__name__} is no class of transformers' MODEL_FOR_CAUSAL_LM_MAPPING (nor a subclass of one), "
                f"and its loss_type is {_loss_type_of_name(cls.__name__)!r}, not 'ForCausalLM'")
    plan = head_plan(cls)  # None: no source to read (a frozen install), nothing tells against the class
    if isinstance(plan, str):
        return f"{cls.__name__}.forward {plan}"
    backbone = getattr(cls, "base_model_prefix", "") + "."
    for key in getattr(cls, "_tied_weights_keys", None) or ():  # {output parameter: input parameter}
        head = key.rsplit(".", 1)[0]
        if "." in head and not key.startswith(backbone):
            return f"{cls.__name__}'s output embeddings ({head}) come after a head transform of the hidden state"
    return None


def _model_problem(model) -> str | None:
    """Why ``model``'s own loss is not ForCausalLMLoss of ``lm_head(base_model(...).last_hidden_state)``;
    None if it is. The class first (``_class_problem``), then the model's parts: a backbone, an
    ``nn.Linear`` lm_head (its forward uses nothing but its weight and bias), and no other module
    at the top, which could act between the two."""
    problem = _class_problem(type(model))
    if problem is not None:
        return problem
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    name = type(model).__name__
    loss_type = getattr(model, "loss_type", None)
    if LOSS_MAPPING.get(loss_type, ForCausalLMLoss) is not ForCausalLMLoss:  # unknown: transformers takes ForCausalLM
        return f"the loss_type of this {name} is {loss_type!r}"
    own_loss = vars(model).get("_loss_function")
    if own_loss is not None and own_loss is not ForCausalLMLoss:
        return f"this {name}'s loss_function is replaced (by {own_loss!r})"
    backbone, lm_head = model.base_model, model.get_output_embeddings()
    if backbone is model:
        return f"this {name} has no backbone (its base_model is itself)"
    if not isinstance(lm_head, nn.Linear) or type(lm_head).forward is not nn.Linear.forward:
        return f"this {name}'s output embeddings are a {type(lm_head).__name__}, not an nn.Linear"
    children = dict(model.named_children())
    if not any(child is lm_head for child in children.values()):
        return f"this {name}'s output embeddings are not a direct child of the model (a head module holds them)"
    others = [child_name for child_name, child in children.items() if child is not backbone and child is not lm_head]
    if others:
        return f"this {name} has modules besides its backbone and lm_head, which may act between them: {others}"
    return _plan_problem(model, head_plan(type(model)))


def _plan_problem(model, plan: HeadPlan | None) -> str | None:
    """Why ``model``'s forward, as ``plan`` reads it, makes another loss than ``causal_lm_loss`` with
    ``logit_options(model.config)`` (which fused_forward takes, also in a compiled graph)."""
    if plan is None:
        return None
    name = type(model).__name__
    if getattr(model, plan.head, None) is not model.get_output_embeddings():
        return f"this {name}'s forward takes its logits from self.{plan.head}, not from its output embeddings"
    for path in plan.zero:
        if read_path(model, path):
            return f"this {name} adds a term to its loss unless {path.removeprefix('self.')} is 0"
    applied, read = plan_options(model, plan), logit_options(model.config)
    if applied["softcap"] != read["softcap"] or not math.isclose(applied["logit_scale"], read["logit_scale"]):
        return (f"this {name}'s forward applies {applied} to its logits ({plan.steps}), but its config reads as "
                f"{read}")
    return None


def _patch_target(model, caller: str):
    """``model`` as a patch target (a model type resolved to its class); raises TypeError for what is
    not a model, a model class or a model type, ValueError for a model of another loss."""
    if isinstance(model, str):
        model = _causal_lm_class(model)
    elif not (isinstance(model, nn.Module) or (isinstance(model, type) and issubclass(model, nn.Module))):
        raise TypeError(f"{caller} takes {_ACCEPTED}; got {type(model).__name__} {model!r:.80}")
    return model


# ---- the forward ------------------------------------------------------------------------------------
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
    ``model(**inputs, labels=labels).loss``. A model whose own loss is not transformers'
    ``ForCausalLMLoss`` of ``lm_head(last hidden state)`` (a masked LM, a head transform before the
    lm_head, a MoE model adding its router loss) raises ValueError.

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
    if not torch.compiler.is_compiling():  # checked in eager calls; a compiled graph traces the loss alone
        problem = _model_problem(model)
        if problem is not None:
            raise ValueError(f"fused_forward {_REFUSED}: {problem}")
    inputs = _named_arguments(model, args, kwargs)
    labels = inputs.pop("labels", labels)
    shift_labels = inputs.pop("shift_labels", shift_labels)
    num_items_in_batch = inputs.pop("num_items_in_batch", num_items_in_batch)
    for name in _HEAD_ONLY_ARGUMENTS:
        inputs.pop(name, None)
    if labels is None and shift_labels is None:
        raise ValueError("fused_forward computes the loss and no logits: it needs labels or shift_labels")
    router_loss = inputs.get("output_router_logits")
    if router_loss is None:
        router_loss = getattr(model.config, "output_router_logits", False)
    if router_loss:
        raise ValueError("fused_forward leaves out the router's auxiliary loss that this MoE model adds to its loss "
                         "with output_router_logits: pass output_router_logits=False")
    # use_cache stays the model's own default, as in its forward with labels: without a cache (and
    # without an attention mask) transformers looks for packed sequences in the position ids and
    # reads the answer on the host, a sync that left the GPU idle every step.
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
        past_key_values=_output_field(outputs, "past_key_values"),
        hidden_states=_output_field(outputs, "hidden_states"),
        attentions=_output_field(outputs, "attentions"),
        metrics=result[1] if return_metrics else None,
        lse=result[-1] if return_lse else None,
    )


def _output_field(outputs, name: str):
    """A field of the backbone's output, read as the mapping a transformers ``ModelOutput`` is: an
    attribute read would run the properties that transformers keeps for renamed fields, which warn
    that the old name (``past_key_values`` / ``cache_params``) is deprecated."""
    if isinstance(outputs, Mapping):
        return outputs.get(name)
    return getattr(outputs, name, None)


def _is_zero3_parameter(weight: Tensor) -> bool:
    # DeepSpeed ZeRO-3 marks the parameters it partitions (read without importing deepspeed)
    return hasattr(weight, "ds_id") and hasattr(weight, "ds_status")


def _output_head_loss(lm_head, hidden: Tensor, loss: Callable):
    """``loss(hidden, lm_head_weight=..., lm_head_bias=...)`` with lm_head's parameters as its forward sees them.

    An FSDP2 unit (``fully_shard(lm_head)``, or ``fully_shard([embed_tokens, lm_head])`` when tied)
    and DeepSpeed ZeRO-3 hold them partitioned outside the module's forward (ZeRO-3: a weight of
    numel 0). The loss then runs as lm_head's forward, called as the model's own forward calls it:
    the engine's hooks around the call gather the parameters before it and release them after
    (and, in the backward, gather them again and reduce-scatter their gradients), as for the
    logits. A DTensor weight of tensor parallelism (``ColwiseParallel``) is read as is: the loss
    takes it as vocabulary parallelism.
    """
    # imported wherever fully_shard was called (read off its package, not sys.modules, which
    # torch.compile would trace and guard on whole: _dtensor._dtensor_module)
    fsdp = getattr(torch.distributed, "fsdp", None)
    sharded = fsdp is not None and isinstance(lm_head, getattr(fsdp, "FSDPModule", ()))
    if not (sharded or _is_zero3_parameter(lm_head.weight)):
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


# ---- the patch ----------------------------------------------------------------------------------------
# Keyword arguments that only the fused path takes, with the value that asks for nothing. Given
# another value they take the fused path in any mode (eval too): the original forward would
# swallow them (transformers passes unknown kwargs on to its loss, which ignores them).
_FUSED_ONLY_ARGUMENTS = {"return_metrics": False, "return_lse": False, "label_smoothing": 0.0, "z_loss_scale": 0.0,
                         "reduction": None}


def _route(model, when_training: bool, reduction: str, fused_loss: bool | None, args: tuple, kwargs: dict,
           call_original: Callable):
    """The patched forward of ``model``: ``fused_forward`` when asked (``fused_loss=True``, or a
    fused-only argument), or when training with labels (if ``when_training``); else
    ``call_original(model, *args, **kwargs)``."""
    asked = [name for name, nothing in _FUSED_ONLY_ARGUMENTS.items() if name in kwargs and kwargs[name] != nothing]
    if fused_loss is None:
        has_labels = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        fused_loss = bool(asked) or (when_training and model.training and has_labels)
    if fused_loss:
        if kwargs.get("reduction") is None:
            kwargs["reduction"] = reduction
        return fused_forward(model, *args, **kwargs)
    if asked:
        raise ValueError(f"{', '.join(asked)}: only the fused path computes these; fused_loss=False runs the model's "
                         f"own forward, which would ignore them")
    return call_original(model, *args, **kwargs)


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


def _patched_forward(model, when_training: bool, reduction: str, /, *args, fused_loss: bool | None = None, **kwargs):
    return _route(model, when_training, reduction, fused_loss, args, kwargs, _call_instance_original)


class _PatchedForward(functools.partial):
    """A patched model's ``forward``: ``_patched_forward`` with the model and the patch's options bound.

    A partial rather than a bound method: a bound method pickles as ``getattr(model, "forward")``,
    which unpickling resolves to the class's forward (the patch silently lost), while a partial
    pickles its function by name and its arguments, so ``pickle`` and ``torch.save(model)`` keep
    the patch, and ``copy.deepcopy`` binds the copy's forward to the copy. Its signature is the
    class forward's, which the HF Trainer (its dataset columns) and ``generate`` inspect.
    """

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(type(self.args[0]).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])  # bound: no self

    def __repr__(self) -> str:
        return f"<forward of a {type(self.args[0]).__name__} patched by fused_linear_ce>"


def _class_forward(original: Callable, when_training: bool, reduction: str) -> Callable:
    """A patched class's ``forward`` (a class attribute: pickled instances refer to their class by name)."""
    call_original = functools.partial(_call_unpatched, original)

    @functools.wraps(original)
    def forward(self, *args, fused_loss: bool | None = None, **kwargs):
        return _route(self, when_training, reduction, fused_loss, args, kwargs, call_original)

    forward._flce_patched = True
    return forward


def patch_forward(model, *, when_training: bool = True, reduction: str = "mean"):
    """Makes ``model(...)`` compute its loss with ``fused_forward``, in place; returns ``model``.

    After it, ``model(**inputs, labels=labels)`` takes the fused path while ``model.training``
    (when ``when_training``), and so does any call with ``fused_loss=True`` or with an argument
    that only the fused path takes (``return_metrics=True``, ``return_lse=True``,
    ``label_smoothing``, ``z_loss_scale``, ``reduction``), in eval mode too; otherwise (eval,
    generation, no labels, ``fused_loss=False``) the original forward runs and returns logits.
    Wrappers (DDP, FSDP, DeepSpeed, accelerate) keep working since the call still goes through
    ``model.forward``; the patched forward keeps the class forward's signature, which the HF
    Trainer and ``generate`` inspect. A patched model keeps its patch through ``copy.deepcopy``,
    ``pickle`` and ``torch.save``/``torch.load`` (which then need this kernel loaded, as the
    pickle refers to its module).

    Only models whose own loss is transformers' ``ForCausalLMLoss`` of ``lm_head(last hidden
    state)`` are patched: a masked LM, a model with a head transform before its lm_head
    (``BertLMHeadModel``) or without a plain ``nn.Linear`` lm_head raises ValueError.

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
    target = _patch_target(model, "patch_forward")
    problem = _class_problem(target) if isinstance(target, type) else _model_problem(target)
    if problem is not None:
        raise ValueError(f"patch_forward {_REFUSED}: {problem}")
    unpatch_forward(target)
    if isinstance(target, type):
        original = target.forward
        target._flce_class_forward = (original, "forward" in vars(target))
        target.forward = _class_forward(original, when_training, reduction)
    else:
        target._flce_original_forward = vars(target).get("forward")  # None: the class's own
        target.forward = _PatchedForward(_patched_forward, target, when_training, reduction)
    return target


def unpatch_forward(model):
    """Undoes ``patch_forward`` on a model, a model class or a model type; returns the model or
    class. Nothing happens if it is not patched."""
    target = _patch_target(model, "unpatch_forward")
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
