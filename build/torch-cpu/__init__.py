"""fused-linear-ce: the cross-entropy of ``hidden @ weight.T (+ bias)`` without the logits.

A clean-room Triton implementation of the method of "Cut Your Losses in Large-Vocabulary
Language Models" (Wijmans et al., 2024, arXiv 2411.09009).

``trl`` (a TRL trainer) is imported on first use, as ``fused_linear_ce.trl`` or as the attribute:
the package itself imports neither TRL nor transformers.
"""

import os as _os
from importlib.util import find_spec as _find_spec

import torch as _torch

from . import causal_lm, layers, patching
from .causal_lm import causal_lm_loss, token_metrics
from .distillation import fused_linear_divergence
from .interface import fused_linear_cross_entropy
from .log_probs import TokenOutputs, fused_linear_log_probs
from .patching import fused_forward, logit_options, patch_forward, unpatch_forward
from .sparse import fused_linear_sparse_kl, fused_linear_top1_divergence

__all__ = [
    # the loss, and the per-token outputs of RL and preference training
    "fused_linear_cross_entropy",
    "fused_linear_log_probs",
    "TokenOutputs",
    # the student/teacher divergence of distillation (TRL's DistillationTrainer)
    "fused_linear_divergence",
    # top-k distillation on sparse teacher targets
    "fused_linear_sparse_kl",
    "fused_linear_top1_divergence",
    # integrations: transformers causal LMs, kernels layers, training metrics
    "causal_lm",
    "causal_lm_loss",
    "fused_forward",
    "layers",
    "logit_options",
    "patch_forward",
    "patching",
    "token_metrics",
    "unpatch_forward",
]

_LAZY_SUBMODULES = ("trl",)  # they import optional libraries

# On a CUDA build with Triton, Triton's cache key, which a process's first compile waits for, is
# made in a thread from here, off the first call's path (docs/design.md, "The cold start").
if _torch.backends.cuda.is_built() and _os.environ.get("TRITON_INTERPRET") != "1" and _find_spec("triton"):
    from . import _precompile

    _precompile.start_triton_key()


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib  # here, not at the top: it would show among the package's names

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
