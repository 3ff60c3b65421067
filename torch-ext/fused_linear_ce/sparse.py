"""Sparse targets: the log-probs of K given ids per row, and the top-k distillation losses on them.

For row n with ids t_n1..t_nK, over the temperature-scaled logits z_n,

    log_probs[n, k] = z[n, t_nk] - lse_n

One vocabulary sweep (the per-token path of ``fused_linear_log_probs``, against one id of the
row) gives lse_n; the K logits z[n, t_nk] are K dot products hidden_n . weight[t_nk] (then bias,
scale and softcap, as the kernels apply them). For an upstream gradient g [N, K],

    d out / d z_nj = sum_k g_nk [j = t_nk] - (sum_k g_nk) p_nj

The softmax term is the per-token backward's, with d out / d lse_n = -sum_k g_nk; the sparse
term adds g_nk c_nk weight[t_nk] to grad_hidden[n] and g_nk c_nk hidden_n to grad_weight[t_nk]
(c_nk = dz/du at that logit, u the raw logit), K terms a row, never an (N, K, H) tensor. The
row's first id goes through the per-token backward as its target, so K = 1 is that backward.

The losses follow TRL 1.16's ``ServerDistillationTrainer`` (``_compute_server_forward_kl_loss``,
``_add_tail_bucket``, ``_compute_sparse_top_1_divergence_loss``) on these log-probs.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ._chunked import backend_for
from ._dtensor import has_dtensor
from ._ops import _token_backward_grads, _token_forward, _traced, token_backward_op, token_forward_op
from ._options import LossOptions, accumulation_dtype
from .interface import (
    _autocast,
    _check_inputs,
    _checked_ignore_index,
    _finish_target_check,
    _number,
    _start_target_check,
    _targets_checked,
    _under_functorch,
)
from .log_probs import TOKEN_OUTPUTS, TokenOutputs

SPARSE_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")
_GATHER_ELEMENTS = 1 << 24  # the most weight elements gathered at once by the PyTorch picked logits


def _checked_sparse_outputs(outputs) -> tuple[str, ...]:
    if isinstance(outputs, str) or not all(isinstance(name, str) for name in outputs):
        raise TypeError(f"outputs must be a tuple of names among {SPARSE_OUTPUTS}, got {outputs!r}")
    if "is_top1" in outputs:
        raise ValueError("is_top1 is not available for (..., K) targets: the per-token sweep compares one id a row "
                         "with its argmax. Take fused_linear_cross_entropy(..., reduction='none', "
                         "return_metrics=True)[1]['predictions'] and compare it with each id.")
    unknown = sorted(set(outputs) - set(SPARSE_OUTPUTS))
    if unknown:
        raise ValueError(f"unknown outputs {unknown}: choose among {SPARSE_OUTPUTS}")
    return tuple(outputs)


def _picked_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, opts: LossOptions) -> Tensor:
    """The final logits z[n, ids[n, k]] [N, K] fp32 (fp64 for fp64 inputs); ``ids`` all columns of
    ``weight``. The Triton backend sums each as its logit tiles do (``step_target_logits``, the K
    ids of a row reading its hidden row in place); otherwise dot products in the accumulation
    dtype over chunks of rows, as the PyTorch backend's logits."""
    n_rows, k = ids.shape
    acc_dtype = accumulation_dtype(hidden.dtype)
    if n_rows * k == 0:
        return hidden.new_zeros((n_rows, k), dtype=acc_dtype)
    rows = torch.arange(n_rows, device=hidden.device).repeat_interleave(k)
    picked = backend_for(hidden.device).step_target_logits(hidden, weight, ids.reshape(-1), opts, bias, rows=rows)
    if picked is not None:
        return picked.view(n_rows, k)
    logits = hidden.new_empty((n_rows, k), dtype=acc_dtype)
    step = max(1, _GATHER_ELEMENTS // (k * weight.shape[1]))
    for start in range(0, n_rows, step):
        end = min(start + step, n_rows)
        picked_rows = weight[ids[start:end]].to(acc_dtype)  # [rows, K, H]
        torch.bmm(picked_rows, hidden[start:end, :, None].to(acc_dtype), out=logits[start:end, :, None])
    if bias is not None:
        logits += bias.to(acc_dtype)[ids]
    if opts.logit_scale != 1.0:
        logits *= opts.logit_scale
    if opts.has_softcap:
        logits.div_(opts.softcap).tanh_().mul_(opts.softcap)
    return logits


def _logit_chain(logits: Tensor, opts: LossOptions) -> Tensor:
    """dz/du [N, K] at the final logits z = c tanh(s u / c) (z = s u without a softcap)."""
    if not opts.has_softcap:
        return torch.full_like(logits, opts.logit_scale)
    return (logits / opts.softcap).square_().neg_().add_(1.0).mul_(opts.logit_scale)


def _add_sparse_terms(grads: list, hidden: Tensor, weight: Tensor, ids: Tensor, coef: Tensor) -> None:
    """The sparse term of the gradients, in place: grad_hidden[n] += sum_k coef[n, k] weight[ids[n, k]],
    grad_weight[ids[n, k]] += coef[n, k] hidden[n], grad_bias[ids[n, k]] += coef[n, k]; ``coef``
    [N, K] (0: no term), ``ids`` columns of weight; a None gradient is not wanted."""
    grad_hidden, grad_weight, grad_bias = grads
    n_rows, k = ids.shape
    if grad_hidden is not None:
        # a bag of K rows of weight per row, summed in fp32 (one kernel, no [N, K, H] gather)
        grad_hidden += F.embedding_bag(ids, weight, per_sample_weights=coef.to(weight.dtype), mode="sum")
    if grad_bias is not None:
        terms = coef.new_zeros(grad_bias.shape[0]).index_add_(0, ids.reshape(-1), coef.reshape(-1))
        grad_bias.copy_(grad_bias.to(terms.dtype) + terms)
    if grad_weight is None:
        return
    flat_coef, flat_ids = coef.reshape(-1), ids.reshape(-1)
    add_target_rows = getattr(backend_for(hidden.device), "add_target_rows", None)
    if add_target_rows is not None and coef.dtype == torch.float32:
        # each id's terms summed in fp32 in a fixed order, one rounding into grad_weight
        rows = torch.arange(n_rows, device=hidden.device).repeat_interleave(k)
        add_target_rows(grad_weight, flat_coef, flat_ids, hidden, rows)
        return
    touched, slot = torch.unique(flat_ids, return_inverse=True)
    sums = coef.new_zeros((touched.shape[0], hidden.shape[1]))
    sums.index_add_(0, slot, flat_coef[:, None] * hidden.to(coef.dtype).repeat_interleave(k, dim=0))
    grad_weight[touched] = (grad_weight[touched].to(sums.dtype) + sums).to(grad_weight.dtype)


class _SparseTokenOutputs(torch.autograd.Function):
    """(log_probs [N, K], entropy, mean_logits, log_sum_sq_probs [N]) of ``ids`` [N, K]; the two
    sums without gradient. A row takes part if any of its ids is not ``ignore_index``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, opts: LossOptions, key: str, metrics: bool, logit_sum: bool,
                sum_sq: bool):
        valid = ids != opts.ignore_index
        first = valid.to(torch.int8).argmax(-1, keepdim=True)  # the row's first id, its target in the sweep
        row_ids = ids.gather(-1, first).squeeze(-1)  # ignore_index where the row has none
        lse, row_log_probs, entropy, _, mean_logits, log_sum_sq, *_ = _traced(token_forward_op, _token_forward,
                                                                           hidden)(
            hidden, weight, row_ids, bias, *opts.op_args(), key, metrics, logit_sum, sum_sq, False, False, False)
        columns = torch.where(valid, ids, 0)
        logits = _picked_logits(hidden, weight, bias, columns, opts)
        log_probs = torch.where(valid, logits - lse[:, None], 0.0)
        log_probs.scatter_(-1, first, row_log_probs[:, None])  # the sweep's own value at the first id
        ctx.mark_non_differentiable(mean_logits, log_sum_sq)
        ctx.set_materialize_grads(False)
        ctx.opts, ctx.has_bias, ctx.metrics = opts, bias is not None, metrics
        ctx.save_for_backward(hidden, weight, None if bias is None else bias.detach().clone(), ids, row_ids, first,
                              lse, entropy, logits)
        return log_probs, entropy, mean_logits, log_sum_sq

    @staticmethod
    def backward(ctx, log_prob_grad, entropy_grad, *unused):
        hidden, weight, bias, ids, row_ids, first, lse, entropy, logits = ctx.saved_tensors
        needs = ctx.needs_input_grad
        want = (needs[0], needs[1], ctx.has_bias and needs[2])
        if (log_prob_grad is None and entropy_grad is None) or not any(want):
            return (None,) * 9
        opts = ctx.opts
        valid = ids != opts.ignore_index
        g = (torch.zeros_like(logits) if log_prob_grad is None
             else torch.where(valid, log_prob_grad.to(logits.dtype), 0.0))
        first_grad = g.gather(-1, first).squeeze(-1)
        rest = g.scatter(-1, first, 0.0)  # the other ids' terms, added sparsely below
        loss_grad = -first_grad  # the sweep's target: d out / d (lse - z_t) = -d out / d log_probs
        lse_grad = -rest.sum(-1) if ids.shape[1] > 1 else None
        row_entropy_grad = None
        if entropy_grad is not None:
            row_entropy_grad = torch.where(row_ids != opts.ignore_index, entropy_grad.to(lse.dtype), 0.0)
            entropy_lse_grad = -row_entropy_grad * entropy  # d H / d z_j = -p_j (log p_j + H): the H part
            lse_grad = entropy_lse_grad if lse_grad is None else lse_grad + entropy_lse_grad
        grads = _traced(token_backward_op, _token_backward_grads, hidden)(
            hidden, weight, row_ids, bias, lse, loss_grad.contiguous(), lse_grad, row_entropy_grad, *opts.op_args(),
            *want)
        grads = [grad if w else None for grad, w in zip(grads, want, strict=True)]
        if ids.shape[1] > 1:
            _add_sparse_terms(grads, hidden, weight, torch.where(valid, ids, 0), rest * _logit_chain(logits, opts))
        return grads[0], grads[1], grads[2], *([None] * 6)


def sparse_token_outputs(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None = None, *,
                         temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None,
                         ignore_index: int = -100, outputs: tuple[str, ...] = ("log_probs",)) -> TokenOutputs:
    """``fused_linear_log_probs`` for ``ids`` of shape (..., K), hidden (..., H): K ids a row.

    Returns a ``TokenOutputs`` whose ``log_probs`` has the ids' shape (..., K), 0 at ids equal to
    ``ignore_index``; ``entropy``, ``log_sum_sq_probs`` and ``mean_logits`` are per row (...,),
    0 on rows whose ids are all ``ignore_index``. ``log_probs`` and ``entropy`` take gradients,
    recomputed in the backward (one sweep of the vocabulary and K dot products a row, forward and
    backward alike). ``is_top1`` is refused (see the error). The logits and arguments are
    ``fused_linear_log_probs``'s.
    """
    outputs = _checked_sparse_outputs(outputs)
    if has_dtensor(hidden, weight, ids, bias):
        raise TypeError("fused_linear_log_probs takes plain tensors: gather DTensor inputs first (full_tensor())")
    if _under_functorch():
        raise RuntimeError("fused_linear_log_probs does not support torch.func transforms")
    hidden, weight, bias = _autocast(hidden, weight, bias)
    temperature, logit_scale, softcap = (_number(name, value) for name, value in (
        ("temperature", temperature), ("logit_scale", logit_scale), ("softcap", softcap)))
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 (or int32), got {ids.dtype}")
    if ids.shape[:-1] != hidden.shape[:-1] or ids.shape[-1] == 0:
        raise ValueError(f"(..., K) targets must have shape {tuple(hidden.shape[:-1])} + (K,) with K >= 1, "
                         f"got {tuple(ids.shape)}")
    _check_inputs(hidden, weight, ids[..., 0], bias, logit_scale, softcap, "none", 0.0, 0.0)
    if not (isinstance(temperature, float) and temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    ignore_index = _checked_ignore_index(ignore_index)
    vocab_size, hidden_size = weight.shape
    hidden_2d = hidden.reshape(-1, hidden_size)
    ids_2d = ids.reshape(-1, ids.shape[-1]).long().contiguous()
    key = ",".join(sorted(set(outputs) | {"log_probs"}))
    backend_for(hidden.device).precompile("tokens:" + key, hidden.device)
    target_check = (_start_target_check(ids_2d.reshape(-1), vocab_size, ignore_index) if _targets_checked(ids)
                    else None)
    # z / T = (c / T) tanh((s / T) u / (c / T)): the temperature folds into the scale and the softcap.
    opts = LossOptions(ignore_index=ignore_index, logit_scale=logit_scale / temperature,
                       softcap=None if softcap is None else softcap / temperature)
    log_probs, entropy, mean_logits, log_sum_sq = _SparseTokenOutputs.apply(
        hidden_2d, weight, None if bias is None else bias.contiguous(), ids_2d, opts, key, "entropy" in outputs,
        "mean_logits" in outputs, "log_sum_sq_probs" in outputs)
    if target_check is not None:
        _finish_target_check(target_check, ids_2d.reshape(-1), vocab_size, ignore_index)
    per_row = dict(entropy=entropy, log_sum_sq_probs=log_sum_sq, mean_logits=mean_logits)
    values = {name: value.reshape(ids.shape[:-1]) for name, value in per_row.items() if name in outputs}
    values["log_probs"] = log_probs.reshape(ids.shape)
    return TokenOutputs(**{name: values.get(name) for name in TOKEN_OUTPUTS})
