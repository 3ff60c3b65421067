"""TRL's fused LM head on fused-linear-ce: ``use_in_trl()``.

TRL 1.16's trainers (SFT, DPO, GRPO, KTO, RLOO) patch their model with
``trl.trainer.utils.add_fused_lm_head`` and call it with ``fused_lm_head=True``. That glue keeps
the label mask and shift, ``shift_labels``, the FSDP2 DTensor gather, the ZeRO-3 gather, PEFT,
the temperature, softcap and logit scale, and hands the rows with a label to one kernel, which
returns per-token log-probabilities (and, on request, entropy, ``log_sum_sq_probs``,
``mean_logits``, ``is_top1``). ``use_in_trl()`` makes that kernel ``fused_linear_log_probs``;
everything else stays TRL's.

Imported on first use (``fused_linear_ce.trl``, or ``flce.trl`` on the kernel loaded by
``kernels``); the rest of the package imports neither TRL nor transformers.
"""

import importlib.metadata

import torch
from torch import Tensor

from .distillation import use_in_distillation_trainer
from .log_probs import fused_linear_log_probs

__all__ = ["TESTED_TRL_VERSIONS", "use_in_trl"]

# The TRL releases whose fused-head contract (the kernel's arguments and outputs) was tested.
TESTED_TRL_VERSIONS = ("1.16",)

_trl_own_kernel = None  # TRL's own, while ours stands in for it


class FusedLogProbs:
    """Stands in for TRL's ``ChunkedLogProbFunction``: the same ``apply`` arguments, defaults and outputs.

    TRL's kernel is an ``autograd.Function`` whose ``apply`` takes its arguments by position; this
    one takes them by position or by name. Where it differs (docs/integrations.md): ``chunk_size``,
    TRL's tiling of the tokens, has no use (the kernel plans its own tiles), and the logits are never
    rounded to the inputs' dtype (bf16 inputs give outputs computed from fp32 logits)."""

    @staticmethod
    def apply(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
              chunk_size: int, final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
              outputs: tuple[str, ...] = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
              ) -> tuple[Tensor | None, ...]:
        """(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1) of ``hidden`` (N, H) against
        ``targets`` (N,), None where not in ``outputs`` (log_probs always). Outside autocast, a
        weight (and bias) of another dtype than hidden is cast to hidden's, as TRL's kernel does
        (the gradient reaches it in its own dtype)."""
        if isinstance(hidden, Tensor) and not _autocast_enabled(hidden):
            weight, bias = (t.to(hidden.dtype) if isinstance(t, Tensor) and t.is_floating_point() else t
                            for t in (weight, bias))
        return tuple(fused_linear_log_probs(
            hidden, weight, targets, bias, temperature=temperature, logit_scale=logit_scale,
            softcap=final_logit_softcapping or None, outputs=outputs))


def _autocast_enabled(hidden: Tensor) -> bool:
    device_type = hidden.device.type
    return device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)


def _trl_utils():
    try:
        version = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("use_in_trl needs TRL: pip install trl==1.16.*") from None
    if not any(version == v or version.startswith(v + ".") for v in TESTED_TRL_VERSIONS):
        raise RuntimeError(f"use_in_trl was tested with TRL {', '.join(TESTED_TRL_VERSIONS)}, not {version}: its "
                           "fused LM head may call its kernel differently. Install a tested version.")
    from trl.trainer import utils

    if not hasattr(utils, "_ChunkedLogProbFunction") or not hasattr(utils, "add_fused_lm_head"):
        raise RuntimeError(f"TRL {version} has no fused LM head kernel to replace (trl.trainer.utils)")
    return utils


def use_in_trl(enabled: bool = True) -> None:
    """Makes TRL's fused LM head compute through fused-linear-ce (``enabled=False``: TRL's own again).

    Call it once, before or after building the trainer: every ``model(..., fused_lm_head=True)``
    from then on (SFTTrainer, DPOTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer and the others that
    use ``add_fused_lm_head``) takes its per-token outputs from ``fused_linear_log_probs``, with
    TRL's own masking, shifting and parameter gathering around it. DistillationTrainer's divergence
    kernel becomes ``fused_linear_divergence`` likewise. Raises on a TRL version whose
    contract was not tested (``TESTED_TRL_VERSIONS``)."""
    global _trl_own_kernel
    utils = _trl_utils()
    use_in_distillation_trainer(enabled)  # DistillationTrainer's divergence: fused_linear_divergence
    if enabled and utils._ChunkedLogProbFunction is not FusedLogProbs:
        _trl_own_kernel = utils._ChunkedLogProbFunction
        utils._ChunkedLogProbFunction = FusedLogProbs
    elif not enabled and utils._ChunkedLogProbFunction is FusedLogProbs:
        utils._ChunkedLogProbFunction = _trl_own_kernel
        _trl_own_kernel = None
