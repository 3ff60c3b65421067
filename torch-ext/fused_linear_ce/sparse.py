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
``_add_tail_bucket``, ``_compute_sparse_top_1_divergence_loss``) on these log-probs. Without the
tail bucket they renormalise the log-probs over the ids, s_k - logsumexp_j s_j, in which lse_n
cancels: they then take the K logits alone (``picked_forward_op``), with no vocabulary sweep.
With it and reduction "mean" or "sum" the loss is a scalar whose rows' terms are separable: its
forward makes the gradients chunk by chunk, as the loss's training step (``_sparse_step``), and
the backward scales them by the upstream scalar (``_LossInForward``); elsewhere ("none", float64,
traced or captured calls) they go through the (N, K) log-probs' backward above.
"""

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from . import _chunked
from ._chunked import backend_for
from ._ops import (
    DOUBLE_BACKWARD_ERROR,
    NAMESPACE,
    _check_versions,
    _fake_grads,
    _forward_versions,
    _input_grads,
    _is_traced,
    _keeps_rows,
    _no_autocast,
    _scale_in_place,
    _token_outputs,
    affine_mean_logits,
)
from ._options import Gradients, LossOptions, Request, accumulation_dtype, returns
from ._plan import mean_logits_in_sweep, sparse_grads_in_forward
from ._sparse_step import SparseLoss, add_sparse_terms, first_ids, log_probs_at, logit_chain, picked_logits
from ._validation import (
    check_reduction,
    check_teacher_log_probs,
    checked_ignore_index,
    checked_token_arguments,
    finish_target_check,
    start_target_check,
)
from .log_probs import TOKEN_OUTPUTS, TokenOutputs

SPARSE_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")


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


# ---- the operators: opaque to torch.compile, as the package's others (_ops.py) -------------
class SparseOutputs(NamedTuple):
    """The sparse per-token operator's outputs: [N, K] and per row [N]; those not asked for empty."""

    log_probs: Tensor
    lse: Tensor
    entropy: Tensor
    mean_logits: Tensor
    log_sum_sq: Tensor
    logits: Tensor


_FORWARD_SCHEMA = (f"(Tensor hidden, Tensor weight, Tensor ids, Tensor? bias, {Request.schema()}) "
                   f"-> {returns(SparseOutputs)}")
_BACKWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor ids, Tensor? bias, Tensor lse, Tensor entropy, "
                    f"Tensor logits, Tensor log_prob_grad, Tensor? entropy_grad, {Request.schema()}) "
                    f"-> {returns(Gradients)}")


def _request(args) -> Request:
    """The request of an implementation's arguments after its tensors: the ``Request`` itself
    where called eagerly, else its encoded form (an operator's)."""
    return args[0] if len(args) == 1 and isinstance(args[0], Request) else Request.decode(args)


def _sparse_outputs(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None, request: Request,
                    keep: bool = False) -> tuple[SparseOutputs, "_chunked._kept.KeptRows | None"]:
    """(the ``SparseOutputs`` of ``ids`` [N, K] under ``request`` (its outputs' names and which
    statistics the sweep keeps, as ``_ops._token_outputs``), what the sweep kept for the backward:
    with ``keep``, the rows that ``_kept`` keeps, as the per-token forward does; else None). One
    sweep against each row's first id gives lse (and the row's statistics); the K final logits
    come from dot products (``picked_logits``)."""
    opts = request.options
    first, row_ids = first_ids(ids, opts.ignore_index)
    (lse, row_log_probs, entropy, _, mean_logits, log_sum_sq, *_), kept = _token_outputs(
        hidden, weight, row_ids, bias, request.with_grads((False,) * 3), keep=keep)
    valid = ids != opts.ignore_index
    with _no_autocast(hidden):  # the inputs are cast already; the products keep their dtype
        logits = picked_logits(hidden, weight, bias, torch.where(valid, ids, 0), opts)
    log_probs = log_probs_at(logits, lse, row_log_probs, valid, first)  # (the sweep's own at the first id)
    return SparseOutputs(log_probs, lse, entropy, mean_logits, log_sum_sq, logits), kept


def _sparse_forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None, *args) -> tuple[Tensor, ...]:
    """``_sparse_outputs`` of the request encoded in ``args``."""
    return tuple(_sparse_outputs(hidden, weight, ids, bias, Request.decode(args))[0])


sparse_forward_op = torch.library.custom_op(f"{NAMESPACE}::sparse_token_forward", _sparse_forward, mutates_args=(),
                                            schema=_FORWARD_SCHEMA)


@sparse_forward_op.register_fake
def _(hidden, weight, ids, bias, *args):
    request = Request.decode(args)
    metrics, logit_sum, sum_sq = request.return_metrics, request.logit_sum, request.sum_sq
    acc = dict(device=hidden.device, dtype=accumulation_dtype(hidden.dtype))
    n_rows = hidden.shape[0]

    def per_row(wanted):
        return torch.empty((n_rows,) if wanted else (0,), **acc)

    return (torch.empty(ids.shape, **acc), per_row(True), per_row(metrics), per_row(logit_sum), per_row(sum_sq),
            torch.empty(ids.shape, **acc))


def _sparse_backward_grads(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None, lse: Tensor,
                           entropy: Tensor, logits: Tensor, log_prob_grad: Tensor, entropy_grad: Tensor | None,
                           *args, kept=None) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias), empty where not asked for, for d out / d log_probs
    [N, K] and d out / d entropy [N] (or None): the row's first id through the per-token
    backward as its target, with d out / d lse = -(the other ids' sum), then the other ids'
    sparse terms (``add_sparse_terms``). Rows the forward ``kept`` take their softmax from it
    instead of a recompute of their logits."""
    request = _request(args)
    opts, want = request.options, request.grads
    first, row_ids = first_ids(ids, opts.ignore_index)
    valid = ids != opts.ignore_index
    g = torch.where(valid, log_prob_grad.to(logits.dtype), 0.0)
    rest = g.scatter(-1, first, 0.0)
    loss_grad = -g.gather(-1, first).squeeze(-1)  # of the sweep's loss lse - z_t: -d out / d log_probs
    lse_grad = -rest.sum(-1) if ids.shape[1] > 1 else None
    row_entropy_grad = None
    if entropy_grad is not None:
        row_entropy_grad = torch.where(row_ids != opts.ignore_index, entropy_grad.to(lse.dtype), 0.0)
        entropy_lse_grad = -row_entropy_grad * entropy  # d H / d z_j = -p_j (log p_j + H): the H part
        lse_grad = entropy_lse_grad if lse_grad is None else lse_grad + entropy_lse_grad
    terms = None
    if ids.shape[1] > 1:  # the other ids' entries of the grad logits (0 at ignored ones)
        terms = (torch.where(valid, ids, 0), (rest * logit_chain(logits, opts)).contiguous())
    with _no_autocast(hidden):
        grads = _chunked.backward(hidden, weight, row_ids, bias, lse, loss_grad.contiguous(), lse_grad, request,
                                  entropy_grad=row_entropy_grad, kept=kept, sparse_terms=terms)
    grads = [grad if w else None for grad, w in zip(grads, want, strict=True)]
    if terms is not None and grads[2] is not None:  # (the kernels' column sums came before the entries)
        with _no_autocast(hidden):
            add_sparse_terms([None, None, grads[2]], hidden, weight, *terms)
    return tuple(hidden.new_empty(0) if grad is None else grad for grad in grads)


sparse_backward_op = torch.library.custom_op(f"{NAMESPACE}::sparse_token_backward", _sparse_backward_grads,
                                             mutates_args=(), schema=_BACKWARD_SCHEMA)


@sparse_backward_op.register_fake
def _(hidden, weight, ids, bias, lse, entropy, logits, log_prob_grad, entropy_grad, *args):
    return tuple(_fake_grads(hidden, weight, bias, Request.decode(args)))


def _setup(ctx, tensors: tuple, request: Request, output: SparseOutputs, num_inputs: int) -> None:
    hidden, weight, ids, bias = tensors
    log_probs, lse, entropy, mean_logits, log_sum_sq, logits = output
    ctx.mark_non_differentiable(lse, mean_logits, log_sum_sq, logits)
    ctx.set_materialize_grads(False)
    ctx.request, ctx.has_bias, ctx.num_inputs = request, bias is not None, num_inputs
    ctx.kept = None  # what the eager forward kept (``_EagerSparseForward``)
    # the bias as the forward saw it (F.linear does not save its bias; see _ops._setup_context)
    ctx.save_for_backward(hidden, weight, ids, None if bias is None else bias.detach().clone(), lse, entropy, logits)


def _setup_context(ctx, inputs, output):
    hidden, weight, ids, bias, *encoded = inputs
    _setup(ctx, (hidden, weight, ids, bias), Request.decode(encoded), SparseOutputs(*output), len(inputs))


def _backward(ctx, log_prob_grad, lse_grad, entropy_grad, *unused):
    num_inputs = ctx.num_inputs
    needs = ctx.needs_input_grad
    want = (needs[0], needs[1], ctx.has_bias and needs[3])
    if (log_prob_grad is None and entropy_grad is None) or not any(want):
        return (None,) * num_inputs
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)
    hidden, weight, ids, bias, lse, entropy, logits = ctx.saved_tensors
    if log_prob_grad is None:
        log_prob_grad = torch.zeros_like(logits)
    kept, ctx.kept = ctx.kept, None  # used once: the backward turns its buffers into grad logits
    request = ctx.request.with_grads(want)
    tensors = (hidden, weight, ids, bias, lse, entropy, logits, log_prob_grad.contiguous(), entropy_grad)
    if kept is None and _is_traced(hidden):
        grads = sparse_backward_op(*tensors, *request.encode())
    else:
        grads = _sparse_backward_grads(*tensors, request, kept=kept)
    grads = [grad if w else None for grad, w in zip(grads, want, strict=True)]
    return _input_grads(num_inputs, grads)


sparse_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerSparseForward(torch.autograd.Function):
    """``sparse_forward_op`` in eager mode, without the operator's dispatch (as ``_ops._EagerTokenForward``)."""

    @staticmethod
    def forward(ctx, *inputs):
        *tensors, request = inputs
        output, kept = _sparse_outputs(*tensors, request, keep=_keeps_rows(ctx, tensors[0], ()))
        _setup(ctx, tensors, request, output, len(inputs))
        ctx.kept = kept if kept is not None and kept.count > 0 else None
        return tuple(output)

    backward = staticmethod(_backward)


# ---- the K logits alone: what the losses renormalised over the ids need (no lse) ----------
_PICKED_SCHEMA = f"(Tensor hidden, Tensor weight, Tensor ids, Tensor? bias, {Request.schema()}) -> Tensor"
_PICKED_BACKWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor ids, Tensor? bias, Tensor logits, Tensor logit_grad, "
                           f"{Request.schema()}) -> {returns(Gradients)}")


def _picked_forward(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None, *args) -> Tensor:
    """The final logits z[n, ids[n, k]] [N, K] fp32 (fp64 for fp64 inputs), 0 where ignored, of the
    request in ``args`` (the ``Request`` itself in eager mode, else encoded)."""
    opts = _request(args).options
    valid = ids != opts.ignore_index
    with _no_autocast(hidden):
        logits = picked_logits(hidden, weight, bias, torch.where(valid, ids, 0), opts)
    return torch.where(valid, logits, 0.0)


picked_forward_op = torch.library.custom_op(f"{NAMESPACE}::picked_logits", _picked_forward, mutates_args=(),
                                            schema=_PICKED_SCHEMA)


@picked_forward_op.register_fake
def _(hidden, weight, ids, bias, *args):
    return torch.empty(ids.shape, device=hidden.device, dtype=accumulation_dtype(hidden.dtype))


def _picked_backward_grads(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Tensor | None, logits: Tensor,
                           logit_grad: Tensor, *args) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of the picked logits for d out / d logits [N, K]:
    the sparse terms alone (``add_sparse_terms``), empty where not asked for."""
    request = _request(args)
    opts, want = request.options, request.grads
    valid = ids != opts.ignore_index
    coef = torch.where(valid, logit_grad.to(logits.dtype), 0.0) * logit_chain(logits, opts)
    grads = [torch.zeros_like(t) if w else None for t, w in zip((hidden, weight, bias), want, strict=True)]
    with _no_autocast(hidden):
        add_sparse_terms(grads, hidden, weight, torch.where(valid, ids, 0), coef)
    return tuple(hidden.new_empty(0) if grad is None else grad for grad in grads)


picked_backward_op = torch.library.custom_op(f"{NAMESPACE}::picked_logits_backward", _picked_backward_grads,
                                             mutates_args=(), schema=_PICKED_BACKWARD_SCHEMA)


@picked_backward_op.register_fake
def _(hidden, weight, ids, bias, logits, logit_grad, *args):
    return tuple(_fake_grads(hidden, weight, bias, Request.decode(args)))


def _picked_setup_context(ctx, inputs, output):
    hidden, weight, ids, bias, *args = inputs
    request = _request(args)
    ctx.request, ctx.has_bias, ctx.num_inputs = request, bias is not None, len(inputs)
    ctx.save_for_backward(hidden, weight, ids, None if bias is None else bias.detach().clone(), output)


def _picked_backward(ctx, logit_grad):
    num_inputs = ctx.num_inputs
    needs = ctx.needs_input_grad
    want = (needs[0], needs[1], ctx.has_bias and needs[3])
    if logit_grad is None or not any(want):
        return (None,) * num_inputs
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)
    hidden, weight, ids, bias, logits = ctx.saved_tensors
    request = ctx.request.with_grads(want)
    if _is_traced(hidden):
        grads = picked_backward_op(hidden, weight, ids, bias, logits, logit_grad.contiguous(), *request.encode())
    else:
        grads = _picked_backward_grads(hidden, weight, ids, bias, logits, logit_grad.contiguous(), request)
    grads = [grad if w else None for grad, w in zip(grads, want, strict=True)]
    return _input_grads(num_inputs, grads)


picked_forward_op.register_autograd(_picked_backward, setup_context=_picked_setup_context)


class _EagerPickedLogits(torch.autograd.Function):
    """``picked_forward_op`` in eager mode, without the operator's dispatch."""

    @staticmethod
    def forward(ctx, *args):
        output = _picked_forward(*args)
        _picked_setup_context(ctx, args, output)
        return output

    backward = staticmethod(_picked_backward)


# ---- the public entry points ----------------------------------------------------------------
def _checked_sparse_inputs(hidden, weight, ids, bias, temperature, logit_scale, softcap, ignore_index):
    """The checks and casts of ``fused_linear_log_probs`` for (..., K) ids: (hidden [N, H], weight,
    ids [N, K] int64, bias or None, LossOptions with the temperature folded in)."""
    hidden, weight, bias, opts = checked_token_arguments(hidden, weight, ids, bias, temperature, logit_scale, softcap,
                                                         ignore_index, ids_per_row=True)
    ids_2d = ids.reshape(-1, ids.shape[-1]).long().contiguous()
    return hidden.reshape(-1, weight.shape[1]), weight, ids_2d, None if bias is None else bias.contiguous(), opts


def _checked_ids(ids: Tensor, vocab_size: int, opts: LossOptions, run):
    """``run()``, with the ids' range check queued before it and read after it (as the loss's)."""
    check = start_target_check(ids.reshape(-1), vocab_size, opts.ignore_index)
    result = run()
    finish_target_check(check)
    return result


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
    hidden_2d, weight, ids_2d, bias, opts = _checked_sparse_inputs(hidden, weight, ids, bias, temperature,
                                                                   logit_scale, softcap, ignore_index)
    key = ",".join(sorted(set(outputs) | {"log_probs"}))
    backend_for(hidden_2d.device).precompile("tokens:" + key, hidden_2d.device)
    logit_sum = "mean_logits" in outputs and mean_logits_in_sweep(opts)
    request = Request(opts, "none", "entropy" in outputs, outputs=key, logit_sum=logit_sum,
                      sum_sq="log_sum_sq_probs" in outputs)
    log_probs, _, entropy, mean_logits, log_sum_sq, _ = _checked_ids(ids_2d, weight.shape[0], opts, lambda: (
        sparse_forward_op(hidden_2d, weight, ids_2d, bias, *request.encode()) if _is_traced(hidden_2d)
        else _EagerSparseForward.apply(hidden_2d, weight, ids_2d, bias, request)))
    if "mean_logits" in outputs and not logit_sum:  # 0 on rows whose ids are all ignore_index
        valid = (ids_2d != opts.ignore_index).any(-1)
        mean_logits = affine_mean_logits(hidden_2d, weight, bias, opts, valid)
    per_row = dict(entropy=entropy, log_sum_sq_probs=log_sum_sq, mean_logits=mean_logits)
    values = {name: value.reshape(ids.shape[:-1]) for name, value in per_row.items() if name in outputs}
    values["log_probs"] = log_probs.reshape(ids.shape)
    return TokenOutputs(**{name: values.get(name) for name in TOKEN_OUTPUTS})


def _support_scores(hidden, weight, ids, bias, add_tail: bool, **options) -> Tensor:
    """The student's scores of ``ids`` (..., K) for a loss on them: its log-probs where the tail
    bucket needs them, else its logits alone, which renormalise to the same log-probs over the
    ids (the lse cancels): no vocabulary sweep then, K dot products a row."""
    if add_tail:
        return sparse_token_outputs(hidden, weight, ids, bias, **options).log_probs
    hidden_2d, weight, ids_2d, bias, opts = _checked_sparse_inputs(
        hidden, weight, ids, bias, options["temperature"], options["logit_scale"], options["softcap"],
        options["ignore_index"])
    request = Request(opts)
    logits = _checked_ids(ids_2d, weight.shape[0], opts, lambda: (
        picked_forward_op(hidden_2d, weight, ids_2d, bias, *request.encode()) if _is_traced(hidden_2d)
        else _EagerPickedLogits.apply(hidden_2d, weight, ids_2d, bias, request)))
    return logits.reshape(ids.shape)


# ---- the top-k distillation losses (TRL 1.16's ServerDistillationTrainer) -------------------
def _tail_bucket(log_probs: Tensor, support: Tensor) -> tuple[Tensor, Tensor]:
    """TRL's ``_add_tail_bucket``: one more element, log(1 - sum_k exp(log_probs_k)), the sum
    held below 1 (its log at most -1e-7), which is always in the support."""
    log_sum = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=-1e-7)
    tail = torch.log(-torch.expm1(log_sum))
    return torch.cat([log_probs, tail], dim=-1), torch.cat([support, torch.ones_like(support[..., :1])], dim=-1)


def _sparse_distributions(student: Tensor, teacher: Tensor, support: Tensor, add_tail: bool):
    """The student's and the teacher's log-probs on the support (-inf off it), with the tail
    bucket, or renormalised over the support without it; and the support with the tail."""
    neg_inf = torch.full((), float("-inf"), dtype=student.dtype, device=student.device)
    student, teacher = torch.where(support, student, neg_inf), torch.where(support, teacher, neg_inf)
    if add_tail:
        (student, full_support), (teacher, _) = _tail_bucket(student, support), _tail_bucket(teacher, support)
        return student, teacher, full_support
    student = student - torch.logsumexp(student, dim=-1, keepdim=True)
    teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    return student, teacher, support


def _divergence_on_support(student: Tensor, teacher: Tensor, beta: float, support: Tensor) -> Tensor:
    """TRL's ``_jsd_divergence`` with a support mask, per element: beta = 0 the forward KL
    terms p_t (log p_t - log p_s), beta = 1 the reverse p_s (log p_s - log p_t), in between the
    generalised JSD against the mixture m = beta p_t + (1 - beta) p_s; 0 off the support."""
    zero = torch.zeros((), dtype=student.dtype, device=student.device)
    safe_student, safe_teacher = torch.where(support, student, zero), torch.where(support, teacher, zero)
    student_probs = torch.where(support, student.exp(), zero)
    teacher_probs = torch.where(support, teacher.exp(), zero)
    if beta == 0:
        return torch.nan_to_num(teacher_probs * (safe_teacher - safe_student), nan=0.0)
    if beta == 1:
        return torch.nan_to_num(student_probs * (safe_student - safe_teacher), nan=0.0)
    mixture = (1 - beta) * student_probs + beta * teacher_probs
    safe_mixture = torch.where(support, torch.log(mixture.clamp_min(torch.finfo(mixture.dtype).tiny)), zero)
    kl_teacher = torch.nan_to_num(teacher_probs * (safe_teacher - safe_mixture), nan=0.0)
    kl_student = torch.nan_to_num(student_probs * (safe_student - safe_mixture), nan=0.0)
    return beta * kl_teacher + (1 - beta) * kl_student


def _reduced(per_row: Tensor, rows: Tensor, reduction: str) -> Tensor:
    """TRL's ``_reduce_divergence_loss`` over the rows that take part (``rows``): "mean" is its
    batchmean, the sum over them divided by their count (at least 1)."""
    per_row = torch.where(rows, per_row, 0.0)
    if reduction == "none":
        return per_row
    total = per_row.sum()
    return total / rows.sum().clamp_min(1) if reduction == "mean" else total


def _divergence_rows(student: Tensor, teacher: Tensor, support: Tensor, beta: float, add_tail: bool) -> Tensor:
    """Each row's divergence [...] of the student's log-probs (or logits, without the tail) and the
    teacher's [..., K] on ``support``: ``_divergence_on_support`` of ``_sparse_distributions``."""
    student, teacher, support = _sparse_distributions(student, teacher, support, add_tail)
    return _divergence_on_support(student, teacher, beta, support).sum(-1)


class _LossInForward(torch.autograd.Function):
    """A top-k loss whose forward makes its gradients for an upstream of 1, chunk by chunk
    (pipeline "sparse", ``_sparse_step``); its backward scales them by the upstream scalar, once."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, row_ids, loss: SparseLoss, request: Request, reduction: str):
        with _no_autocast(hidden):  # the inputs are cast already; the products keep their dtype
            result = _chunked.forward(hidden, weight, row_ids, bias, request, sparse=loss)
        ctx.set_materialize_grads(False)
        ctx.grads = (result.grad_hidden, result.grad_weight, result.grad_bias)
        ctx.watched = _forward_versions(hidden, weight)  # (what PyTorch's head would save: see _ops._setup)
        return _reduced(result.row_divergence, loss.rows, reduction)

    @staticmethod
    def backward(ctx, loss_grad):
        if loss_grad is None:
            return (None,) * 7
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD_ERROR)
        if ctx.grads is None:
            raise RuntimeError("this top-k loss computed its gradients in the forward and they were already used: "
                               "backward through it twice (retain_graph=True) is not supported.")
        _check_versions(ctx.watched)
        grads, ctx.grads = ctx.grads, None
        for g in grads:
            if g is not None:
                _scale_in_place(g, loss_grad)
        return (*grads, None, None, None, None)


def _grads_in_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, reduction: str,
                      add_tail: bool) -> tuple[bool, bool, bool]:
    """The plan's ``sparse_grads_in_forward`` for these checked inputs of an untraced call: which
    gradients the forward makes (none while a CUDA graph is captured)."""
    needs = [torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    eager = not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())
    return sparse_grads_in_forward(needs, reduction, add_tail, hidden.dtype, hidden.shape[0], eager)


def _top_k_loss(hidden, weight, ids, teacher, support, rows, bias, beta: float, add_tail: bool, reduction: str,
                options: dict) -> Tensor:
    """The loss of both public functions: the divergence ``beta`` of the student's scores of ``ids``
    (..., K) and the ``teacher``'s log-probs on ``support``, reduced over ``rows`` (...,): with its
    gradients made in the forward where the plan says so, else on the scores through torch ops
    (traced calls take the latter at once: dynamo then sees the code it compiled before this path)."""
    if add_tail and not _is_traced(hidden):
        hidden_2d, weight, ids_2d, bias_c, opts = _checked_sparse_inputs(hidden, weight, ids, bias, **options)
        in_forward = _grads_in_forward(hidden_2d, weight, bias_c, reduction, add_tail)
        if any(in_forward):
            acc, k = accumulation_dtype(hidden_2d.dtype), ids_2d.shape[1]
            first, row_ids = first_ids(ids_2d, opts.ignore_index)
            rows = rows.reshape(-1)
            row_weight = rows.to(acc) / rows.sum().clamp_min(1) if reduction == "mean" else rows.to(acc)
            loss = SparseLoss(ids_2d, first, teacher.detach().reshape(-1, k).to(acc), support.reshape(-1, k), rows,
                              row_weight, functools.partial(_divergence_rows, beta=beta, add_tail=add_tail))
            request = Request(opts, "none", False, *in_forward, outputs="log_probs")
            return _checked_ids(ids_2d, weight.shape[0], opts, lambda: _LossInForward.apply(
                hidden_2d, weight, bias_c, row_ids, loss, request, reduction))
    student = _support_scores(hidden, weight, ids, bias, add_tail, **options)
    per_row = _divergence_rows(student, teacher.detach().to(student.dtype), support, beta, add_tail)
    return _reduced(per_row, rows, reduction)


def fused_linear_sparse_kl(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_log_probs: Tensor,
    bias: Tensor | None = None,
    *,
    add_tail: bool = True,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Forward KL(teacher || student) on the teacher's top-k ids, without the student's logits.

    TRL 1.16's ``ServerDistillationTrainer._compute_server_forward_kl_loss`` (beta = 0). On row
    n the support is its ids k with ``teacher_ids[n, k] != ignore_index`` and a teacher log-prob
    above -inf; s_k = log_softmax(z_n)[t_nk] (z the student's logits, as in
    ``fused_linear_log_probs``) and t_k the teacher's. With ``add_tail`` both get one more element,
    the mass outside the support, log(1 - sum_k exp(.)) (the sum held at most exp(-1e-7)); without
    it both are renormalised over the support, s_k - logsumexp(s) (then a top-1 support gives 0),
    which depends on the K logits alone: no sweep of the vocabulary then, forward or backward.
    The row's divergence is sum_k exp(t_k) (t_k - s_k) over those elements. With the tail and
    reduction "mean" or "sum" the forward makes the gradients in its one sweep (6 N V H flops, the
    memory of ``fused_linear_cross_entropy``'s step), which the backward only scales: one backward
    through a call, as the loss's.

    Normalisation: a row takes part when any of its ids is not ``ignore_index``; "mean" is the sum
    of the rows' divergences divided by the number of rows that take part (at least 1: 0, not
    NaN, without any), TRL's batchmean over the completion tokens; "sum" the sum; "none" per row
    (the ids' leading shape, 0 on rows that do not take part).

    Args:
        hidden: (..., H); weight (V, H) and bias (V,) or None in its dtype (as the loss).
        teacher_ids: (..., K) int64 (or int32) token ids, ``ignore_index`` where absent.
        teacher_log_probs: (..., K) float, the teacher's log-probs of those ids (at the same
            temperature); -inf where absent.
        add_tail, temperature, logit_scale, softcap, ignore_index, reduction: as above and as in
            ``fused_linear_log_probs``.

    Returns:
        The loss, float32 (float64 for float64 inputs), with gradients to hidden, weight and bias
        (none to the teacher's log-probs, which are data).
    """
    check_reduction(reduction)
    if not isinstance(teacher_ids, Tensor) or not isinstance(hidden, Tensor) or teacher_ids.dim() != hidden.dim():
        raise ValueError("teacher_ids must be a tensor of shape (..., K), hidden (..., H)")
    check_teacher_log_probs("teacher_log_probs", teacher_log_probs, teacher_ids)
    ignore_index = checked_ignore_index(ignore_index)
    present = teacher_ids != ignore_index
    teacher = teacher_log_probs.detach().to(accumulation_dtype(hidden.dtype))
    support = present & (teacher > float("-inf"))
    return _top_k_loss(hidden, weight, teacher_ids, teacher, support, present.any(-1), bias, 0.0, add_tail, reduction,
                       dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                            ignore_index=ignore_index))


def fused_linear_top1_divergence(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    teacher_token_log_probs: Tensor,
    bias: Tensor | None = None,
    *,
    beta: float = 1.0,
    teacher_top1_ids: Tensor | None = None,
    teacher_top1_log_probs: Tensor | None = None,
    add_tail: bool = True,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """The top-1 divergence of TRL 1.16's ``ServerDistillationTrainer`` (beta > 0), without the
    student's logits: the reverse KL(student || teacher) at beta = 1 (TRL's default).

    ``_compute_sparse_top_1_divergence_loss`` in "sampled" mode: at beta = 1 row n's support is
    its sampled token x_n, with the student's log-prob s = log_softmax(z_n)[x_n] and the
    teacher's ``teacher_token_log_probs[n]``; otherwise it is the teacher's top-1 id and x_n (x_n
    left out where it is the top-1), with their teacher log-probs. With ``add_tail`` (TRL's
    default) both distributions get the tail bucket log(1 - sum exp(.)) (at beta = 1: the
    Bernoulli of x_n against the rest); without it both are renormalised over the support (then a
    one-element support gives 0; no sweep of the vocabulary is needed). The row's divergence is
    TRL's ``_jsd_divergence`` summed over those elements: sum p_s (log p_s - log p_t) at beta = 1,
    the generalised JSD with the mixture beta p_t + (1 - beta) p_s otherwise.

    Normalisation: a row takes part when ``token_ids[n] != ignore_index``; "mean" divides the sum
    of their divergences by their count (at least 1), TRL's batchmean; "sum"; "none" per row.

    Args:
        hidden: (..., H); weight (V, H) and bias (V,) or None in its dtype (as the loss).
        token_ids: hidden's leading shape (...,), int64 (or int32), the sampled tokens.
        teacher_token_log_probs: (...,) float, the teacher's log-probs of those tokens, finite on
            the rows that take part.
        beta: in (0, 1]; below 1 ``teacher_top1_ids`` and ``teacher_top1_log_probs`` (...,) are
            needed.
        add_tail, temperature, logit_scale, softcap, ignore_index, reduction: as above and as in
            ``fused_linear_log_probs``.

    Returns:
        The loss, float32 (float64 for float64 inputs), with gradients to hidden, weight and bias.
    """
    check_reduction(reduction)
    if not (isinstance(beta, (int, float)) and 0 < beta <= 1):
        raise ValueError(f"beta must be in (0, 1], got {beta!r}")
    if not isinstance(token_ids, Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}")
    check_teacher_log_probs("teacher_token_log_probs", teacher_token_log_probs, token_ids)
    ignore_index = checked_ignore_index(ignore_index)
    rows = token_ids != ignore_index
    if beta == 1:
        ids, support = token_ids[..., None], rows[..., None]
        teacher = teacher_token_log_probs[..., None]
    else:
        if teacher_top1_ids is None or teacher_top1_log_probs is None:
            raise ValueError("beta < 1 needs teacher_top1_ids and teacher_top1_log_probs")
        check_teacher_log_probs("teacher_top1_log_probs", teacher_top1_log_probs, token_ids)
        top1_ids = torch.where(rows, teacher_top1_ids, ignore_index)
        support = torch.stack([rows, rows & (token_ids != top1_ids)], dim=-1)
        ids = torch.where(support, torch.stack([top1_ids, token_ids], dim=-1), ignore_index)
        teacher = torch.stack([teacher_top1_log_probs, teacher_token_log_probs], dim=-1)
    # (TRL sets the teacher's log-probs of the rows without a token to 0, so that no inf reaches the backward)
    teacher = torch.where(rows[..., None], teacher, 0.0)
    return _top_k_loss(hidden, weight, ids, teacher, support, rows, bias, float(beta), add_tail, reduction,
                       dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                            ignore_index=ignore_index))
