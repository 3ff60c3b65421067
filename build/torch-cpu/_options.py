"""Plain data shared by the layers: the loss options, the request, the operators' outputs and
the per-row statistics."""

import types
import typing
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class LossOptions:
    """Everything but the tensors and the flags that defines the loss of one call, checked by the
    API layer; the kernels read it as it is (``Request`` carries it to the operators)."""

    ignore_index: int = -100
    logit_scale: float = 1.0
    softcap: float | None = None
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    total_vocab_size: int | None = None  # V of the whole vocabulary when weight is a shard
    group: object | None = None  # vocabulary parallelism: the torch.distributed ProcessGroup
    vocab_start: int = 0  # vocabulary parallelism: this rank's first row of the vocabulary

    def inv_vocab_size(self, local_vocab_size: int) -> float:
        """1 / V for label smoothing, V being the whole vocabulary's size."""
        return 1.0 / (self.total_vocab_size or local_vocab_size)

    @property
    def has_softcap(self) -> bool:
        return self.softcap is not None

    @property
    def has_smoothing(self) -> bool:
        return self.label_smoothing != 0.0

    @property
    def has_z_loss(self) -> bool:
        return self.z_loss_scale != 0.0


@dataclass(frozen=True)
class Request:
    """One call as the operators take it: the loss options and the flags that say what to compute.

    The only conversion to and from the operators' flat schema arguments is ``encode`` /
    ``decode`` (a dataclass is no schema type), with ``schema()`` written from the same field
    list, so that a new option is one field here. The process group travels as its registered
    name through a schema (a ProcessGroup is no schema type), and as itself in eager mode, where
    no operator is dispatched. ``options`` has no default: torch 2.11's compiler cannot wrap a
    dataclass instance held in ``__init__``'s defaults, and gives up on every traced call."""

    options: LossOptions
    reduction: str = "mean"
    return_metrics: bool = False  # per-row argmax, correctness and entropy (per-token: entropy, is_top1)
    grad_hidden: bool = False  # gradients computed in the forward's sweep (backward: those wanted)
    grad_weight: bool = False
    grad_bias: bool = False
    all_rows: bool = False  # every row's lse, ignored rows too
    outputs: str = ""  # the per-token outputs asked for ("entropy,log_probs"); "" for the loss
    logit_sum: bool = False  # each row's mean logit (per-token)
    sum_sq: bool = False  # each row's log sum_j p_j^2 (per-token)

    @property
    def grads(self) -> tuple[bool, bool, bool]:
        return self.grad_hidden, self.grad_weight, self.grad_bias

    def with_grads(self, grads) -> "Request":
        """The same request for the gradients ``grads`` (hidden, weight, bias)."""
        grad_hidden, grad_weight, grad_bias = (bool(g) for g in grads)
        return replace(self, grad_hidden=grad_hidden, grad_weight=grad_weight, grad_bias=grad_bias)

    def encode(self) -> tuple:
        """The request as the operators' flat schema arguments (``schema()``'s order)."""
        options = self.options
        values = [getattr(options, name) for name in _OPTION_NAMES]
        values[_GROUP_SLOT] = None if options.group is None else options.group.group_name
        return (*values, *(getattr(self, name) for name in _FLAG_NAMES))

    @classmethod
    def decode(cls, args) -> "Request":
        """The request back from an operator's flat arguments (``encode``'s)."""
        values = list(args[:len(_OPTION_NAMES)])
        if values[_GROUP_SLOT] is not None:
            from ._distributed import resolve_group

            values[_GROUP_SLOT] = resolve_group(values[_GROUP_SLOT])
        return cls(LossOptions(*values), *args[len(_OPTION_NAMES):])

    @classmethod
    def schema(cls) -> str:
        """Its part of an operator's schema: ``"int ignore_index, float logit_scale, ..."``."""
        parts = [f"{'str?' if f.name == 'group' else _schema_type(f.type)} {f.name}" for f in fields(LossOptions)]
        parts += [f"{_schema_type(f.type)} {f.name}" for f in fields(cls) if f.name != "options"]
        return ", ".join(parts)


# The fields in order, read once (``dataclasses.fields`` costs host time at every call).
_OPTION_NAMES = tuple(f.name for f in fields(LossOptions))
_GROUP_SLOT = _OPTION_NAMES.index("group")
_FLAG_NAMES = tuple(f.name for f in fields(Request) if f.name != "options")


_SCHEMA_TYPES = {int: "int", float: "float", str: "str", bool: "bool"}


def _schema_type(annotation) -> str:
    """The schema type of a field annotation: ``int`` -> "int", ``float | None`` -> "float?"."""
    if isinstance(annotation, types.UnionType):
        (inner,) = (a for a in typing.get_args(annotation) if a is not type(None))
        return _SCHEMA_TYPES[inner] + "?"
    return _SCHEMA_TYPES[annotation]


class LossOutputs(NamedTuple):
    """The loss operator's outputs; the last three per row with metrics, else empty."""

    loss: torch.Tensor
    lse: torch.Tensor
    num_correct: torch.Tensor
    entropy_sum: torch.Tensor
    grad_hidden: torch.Tensor  # empty unless computed in the forward
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor
    prediction: torch.Tensor
    correct: torch.Tensor
    entropy: torch.Tensor


class TokenOutputs(NamedTuple):
    """The per-token operator's outputs, all [N] but the gradients; those not asked for empty."""

    lse: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor
    is_top1: torch.Tensor
    mean_logits: torch.Tensor
    log_sum_sq: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor


class Gradients(NamedTuple):
    """A backward operator's outputs, empty where not wanted."""

    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor
    grad_bias: torch.Tensor


def returns(outputs: type) -> str:
    """An operator schema's named returns for a NamedTuple of tensors: ``(Tensor loss, ...)``."""
    return "(" + ", ".join(f"Tensor {name}" for name in outputs._fields) + ")"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax statistics, per-row results and accumulators: float32 for
    16- and 32-bit inputs, float64 for float64 inputs (so that gradcheck's finite differences
    see float64 arithmetic)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class RowStats:
    """Merged softmax statistics of a block of rows, all [rows]; see ``_kernel_math`` for the maths.

    ``sum_exp`` and ``entropy_term`` are relative to ``row_max``; ``target_logit`` is NaN
    where no vocabulary entry matched the target (ignored or out of range).
    """

    row_max: torch.Tensor  # fp32 (fp64 for fp64 inputs, as every fp32 below)
    sum_exp: torch.Tensor  # fp32
    target_logit: torch.Tensor  # fp32
    entropy_term: torch.Tensor | None = None  # fp32, with metrics
    argmax: torch.Tensor | None = None  # int64, with metrics
    logit_sum: torch.Tensor | None = None  # fp32, with label smoothing; sum_j w_j z_j with class weights w
    sum_sq: torch.Tensor | None = None  # fp32 sum_j exp(2 (z_j - row_max)), for sum_j p_j^2


@dataclass
class RowResults:
    """Per-row outputs of the forward, all [rows]."""

    lse: torch.Tensor  # fp32 (fp64 for fp64 inputs, as every fp32 below)
    loss: torch.Tensor  # fp32, 0 on ignored rows
    correct: torch.Tensor | None = None  # int32, with metrics
    entropy: torch.Tensor | None = None  # fp32, 0 on ignored rows, with metrics
    prediction: torch.Tensor | None = None  # int64 argmax, with metrics
    mean_logit: torch.Tensor | None = None  # fp32 sum_j z_j / V, 0 on ignored rows (token outputs)
    log_sum_sq: torch.Tensor | None = None  # fp32 log sum_j p_j^2, 0 on ignored rows (token outputs)
