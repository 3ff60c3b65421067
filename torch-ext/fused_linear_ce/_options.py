"""Plain data shared by the layers: the loss options and the per-row statistics."""

import types
import typing
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class LossOptions:
    """Everything but the tensors that defines the loss of one call, checked by the API layer.

    The operators take these as flat schema arguments (a dataclass is no schema type):
    ``op_args`` / ``from_op_args`` convert, and ``op_schema`` writes their part of the schema,
    all in the order of the fields, so that a new option is one field here."""

    ignore_index: int = -100
    logit_scale: float = 1.0
    softcap: float | None = None
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    total_vocab_size: int | None = None  # V of the whole vocabulary when weight is a shard
    group_name: str | None = None  # vocabulary parallelism: the process group's registered name
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

    def op_args(self) -> tuple:
        """The options as the operators' flat arguments."""
        return tuple(getattr(self, name) for name in _FIELD_NAMES)

    @classmethod
    def from_op_args(cls, args) -> "LossOptions":
        """The options back from the first ``num_op_args()`` of an operator's arguments."""
        return cls(*args[: len(_FIELD_NAMES)])

    @classmethod
    def num_op_args(cls) -> int:
        return len(_FIELD_NAMES)

    @classmethod
    def op_schema(cls) -> str:
        """Their part of an operator's schema, e.g. ``"int ignore_index, float logit_scale, ..."``."""
        return ", ".join(f"{_schema_type(f.type)} {f.name}" for f in fields(cls))


# The fields in order, read once (``dataclasses.fields`` costs host time at every call).
_FIELD_NAMES = tuple(f.name for f in fields(LossOptions))


_SCHEMA_TYPES = {int: "int", float: "float", str: "str", bool: "bool"}


def _schema_type(annotation) -> str:
    """The schema type of a field annotation: ``int`` -> "int", ``float | None`` -> "float?"."""
    if isinstance(annotation, types.UnionType):
        (inner,) = (a for a in typing.get_args(annotation) if a is not type(None))
        return _SCHEMA_TYPES[inner] + "?"
    return _SCHEMA_TYPES[annotation]


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
