"""Per-token log-probabilities of ``hidden @ weight.T (+ bias)``, with entropy and top-1, without the logits.

What RL and preference trainers take from their LM head (TRL, verl and Unsloth return these per
token): for each row i with target t_i, over the temperature-scaled logits z_i,

    log_probs_i        = z_it - lse_i                       (gradient: [j = t] - p_ij)
    entropy_i          = lse_i - sum_j p_ij z_ij            (gradient: -p_ij (log p_ij + entropy_i))
    log_sum_sq_probs_i = log sum_j p_ij^2                   (no gradient)
    mean_logits_i      = sum_j z_ij / V                     (no gradient)
    is_top1_i          = argmax_j z_ij == t_i               (no gradient)

The vocabulary sweep is the loss's (``fused_linear_cross_entropy``): the same tiles, the same
statistics, merged by the same online softmax; only what is read off them per row differs.

Why a function of its own and not options of the loss: the loss is one number whose gradient the
sweep can compute as it goes (its upstream gradient is a scalar, applied in the backward), while
these outputs take any per-token upstream gradient, known only in the backward. The backward
therefore recomputes the logits (8 N V H flops in all instead of 6) of the rows whose upstream
gradient is not 0 (not those of GRPO's tokens of advantage 0 without an entropy bonus), but for the
rows that the forward kept within a memory budget (``_kept``: 6 N V H), except when it finds the
gradient of ``log_probs`` equal on every row with a target and no gradient on ``entropy`` (SFT's
negative log-likelihood): then the gradients computed in the forward's sweep, those of the mean
of -log_probs over the rows with a target, are exact once scaled, and need no scaling at all where
the loss divides by that count (TRL's SFT head); the forward computes them as long as the last
backward of the same outputs found the weights equal (``grad_in_forward`` decides per call).
"""

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from ._chunked import backend_for
from ._ops import TOKEN_SPECULATION, affine_mean_logits, token_forward
from ._options import Request
from ._plan import mean_logits_in_sweep, token_grads_in_forward
from ._validation import checked_token_arguments, finish_target_check, start_target_check

TOKEN_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TokenOutputs(NamedTuple):
    """Per-token outputs, each of the targets' shape, or None where not asked for; 0 (False) on
    rows whose target is ``ignore_index``. float32 (float64 for float64 inputs), ``is_top1`` bool."""

    log_probs: Tensor | None
    entropy: Tensor | None
    log_sum_sq_probs: Tensor | None
    mean_logits: Tensor | None
    is_top1: Tensor | None


def _checked_outputs(outputs) -> tuple[str, ...]:
    names = tuple(outputs) if isinstance(outputs, Iterable) and not isinstance(outputs, str) else None
    if names is None or not all(isinstance(name, str) for name in names):
        raise TypeError(f"outputs must be a tuple of names among {TOKEN_OUTPUTS}, got {outputs!r}")
    unknown = sorted(set(names) - set(TOKEN_OUTPUTS))
    if unknown:
        raise ValueError(f"unknown outputs {unknown}: choose among {TOKEN_OUTPUTS}")
    return names


def _speculation_allowed(hidden: Tensor) -> bool:
    # The backward decides on the host whether the sweep's gradients apply: not while tracing or
    # capturing a graph. float64 (gradcheck) always recomputes, as the loss does.
    if torch.compiler.is_compiling() or hidden.dtype == torch.float64:
        return False
    return not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())


def fused_linear_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    outputs: tuple[str, ...] = ("log_probs",),
    grad_in_forward: bool | None = None,
) -> TokenOutputs:
    """Per-token log-probabilities of the targets (and entropy, top-1...), without the logits.

    The logits are ``z = (hidden @ weight.T + bias) * logit_scale``, then
    ``softcap * tanh(z / softcap)`` when ``softcap`` is set, then divided by ``temperature`` (as
    TRL's trainers do); ``log_probs[i] = log_softmax(z[i])[targets[i]]``.

    Args:
        hidden: (..., H) float32, bfloat16, float16 or float64.
        weight: (V, H), hidden's dtype.
        targets: hidden's leading shape, int64 (or int32); ``ignore_index`` marks rows without one.
            Of shape (..., K), K ids a row: ``sparse.sparse_token_outputs`` (log_probs (..., K)).
        bias: (V,) in hidden's dtype, or None.
        temperature: > 0, divides the final logits.
        logit_scale: multiplies the logits (before the softcap).
        softcap: if set (> 0), the logits become ``softcap * tanh(z / softcap)``.
        ignore_index: target value of rows without outputs (all 0 there, and no gradient).
        outputs: which of ``log_probs`` (always computed), ``entropy``, ``log_sum_sq_probs``,
            ``mean_logits`` and ``is_top1`` to return; the others are None. ``entropy`` costs a
            multiply-add a logit, ``log_sum_sq_probs`` one more, ``mean_logits`` one more with a
            softcap and otherwise one read of the weight (the mean is then affine in the row).
        grad_in_forward: whether the forward computes, in its sweep, the gradients of
            ``-log_probs.sum() / n`` over the n rows with a target (SFT's loss; exact for any equal
            weights, and recomputed if the backward finds them unequal or an entropy gradient).
            None (default): yes unless the last backward of these outputs found unequal weights,
            and again once one finds them equal; False: never (RL and preference losses; the
            forward then keeps rows for its backward within ``FLCE_KEEP_MIB``).

    Returns:
        A ``TokenOutputs`` (a named tuple in the order above). ``log_probs`` and ``entropy`` take
        gradients (to hidden, weight and bias) from any per-token upstream gradient; the others
        have none. The outputs are the same bit for bit whether or not gradients are wanted.
    """
    if isinstance(hidden, Tensor) and isinstance(targets, Tensor) and targets.dim() == hidden.dim():
        from .sparse import sparse_token_outputs  # (..., K) targets: K ids a row

        return sparse_token_outputs(hidden, weight, targets, bias, temperature=temperature, logit_scale=logit_scale,
                                    softcap=softcap, ignore_index=ignore_index, outputs=outputs)
    outputs = _checked_outputs(outputs)
    hidden, weight, bias, options = checked_token_arguments(hidden, weight, targets, bias, temperature, logit_scale,
                                                            softcap, ignore_index)
    vocab_size, hidden_size = weight.shape
    leading_shape = targets.shape
    hidden_2d = hidden.reshape(-1, hidden_size)
    targets_1d = targets.reshape(-1).contiguous()
    if targets_1d.dtype == torch.int32:  # compared in int64, as any ignore_index fits there
        targets_1d = targets_1d.long()
    key = ",".join(sorted(set(outputs) | {"log_probs"}))
    backend_for(hidden.device).precompile("tokens:" + key, hidden.device)
    target_check = start_target_check(targets_1d, vocab_size, options.ignore_index)
    metrics = "entropy" in outputs or "is_top1" in outputs
    sum_sq = "log_sum_sq_probs" in outputs
    logit_sum = "mean_logits" in outputs and mean_logits_in_sweep(options)
    needs = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    # Gradients in the sweep only for the statistics the factored sweep keeps (not the two sums).
    in_forward = token_grads_in_forward(needs, not (logit_sum or sum_sq) and _speculation_allowed(hidden),
                                        grad_in_forward, TOKEN_SPECULATION, key)
    request = Request(options, "none", metrics, *in_forward, outputs=key, logit_sum=logit_sum, sum_sq=sum_sq)
    out = token_forward(hidden_2d, weight, targets_1d, None if bias is None else bias.contiguous(), request)
    log_probs, entropy, is_top1, mean_logits, log_sum_sq = (out.log_probs, out.entropy, out.is_top1,
                                                            out.mean_logits, out.log_sum_sq)
    if "mean_logits" in outputs and not logit_sum:
        mean_logits = affine_mean_logits(hidden_2d, weight, bias, options, targets_1d != options.ignore_index)
    finish_target_check(target_check)
    per_token = dict(log_probs=log_probs, entropy=entropy, log_sum_sq_probs=log_sum_sq, mean_logits=mean_logits,
                     is_top1=is_top1)
    return TokenOutputs(**{name: per_token[name].reshape(leading_shape) if name in outputs or name == "log_probs"
                           else None for name in TOKEN_OUTPUTS})
