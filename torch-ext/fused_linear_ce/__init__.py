"""fused-linear-ce: the cross-entropy of ``hidden @ weight.T (+ bias)`` without the logits.

A clean-room Triton implementation of the method of "Cut Your Losses in Large-Vocabulary
Language Models" (Wijmans et al., 2024, arXiv 2411.09009).
"""

from . import causal_lm, layers
from .causal_lm import causal_lm_loss, fused_forward, logit_options, patch_forward, token_metrics
from .interface import fused_linear_cross_entropy

__all__ = [
    # the loss
    "fused_linear_cross_entropy",
    # integrations: transformers causal LMs, kernels layers, training metrics
    "causal_lm",
    "causal_lm_loss",
    "fused_forward",
    "layers",
    "logit_options",
    "patch_forward",
    "token_metrics",
]
