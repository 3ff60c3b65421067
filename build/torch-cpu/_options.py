"""Plain data shared by the layers: the loss options and the per-row statistics."""

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossOptions:
    """Everything but the tensors that defines the loss of one call."""

    ignore_index: int = -100
    logit_scale: float = 1.0
    softcap: float | None = None
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    return_metrics: bool = False
    total_vocab_size: int | None = None  # V of the whole vocabulary when weight is a shard

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


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax statistics, per-row results and accumulators: float32 for
    16- and 32-bit inputs, float64 for float64 inputs (so that gradcheck's finite differences
    see float64 arithmetic)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class RowStats:
    """Merged softmax statistics of a block of rows, all [rows]; see ``_kernels`` for the maths.

    ``sum_exp`` and ``entropy_term`` are relative to ``row_max``; ``target_logit`` is NaN
    where no vocabulary entry matched the target (ignored or out of range).
    """

    row_max: torch.Tensor  # fp32 (fp64 for fp64 inputs, as every fp32 below)
    sum_exp: torch.Tensor  # fp32
    target_logit: torch.Tensor  # fp32
    entropy_term: torch.Tensor | None = None  # fp32, with metrics
    argmax: torch.Tensor | None = None  # int64, with metrics
    logit_sum: torch.Tensor | None = None  # fp32, with label smoothing; sum_j w_j z_j with class weights w


@dataclass
class RowResults:
    """Per-row outputs of the forward, all [rows]."""

    lse: torch.Tensor  # fp32 (fp64 for fp64 inputs, as every fp32 below)
    loss: torch.Tensor  # fp32, 0 on ignored rows
    correct: torch.Tensor | None = None  # int32, with metrics
    entropy: torch.Tensor | None = None  # fp32, 0 on ignored rows, with metrics
    prediction: torch.Tensor | None = None  # int64 argmax, with metrics


def env_int(name: str, default: int) -> int:
    """An integer knob from the environment (used by tests and benchmarks), else ``default``."""
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)
