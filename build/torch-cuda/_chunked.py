"""The algorithm: a loop over bounded chunks of rows, independent of the backend.

Rows whose target is ``ignore_index`` carry no loss, gradient or metric: they are left out
(one host sync for their count), unless a CUDA graph is being captured or the per-row lse of
every row is wanted.

Forward, for each chunk of rows: one sweep over the vocabulary reduces every logit tile
to softmax statistics (``row_stats``), merged into lse, loss, argmax and entropy per row.

Training (reduction "mean"/"sum", gradients wanted): the same sweep also keeps the chunk's
logits in a buffer of rows x V (never N x V), and two matrix products finish the chunk once
its lse is known: grad_hidden[chunk] = G @ W and grad_weight += G^T @ hidden[chunk]. The
whole step costs 6 N V H flops. Without bias, softcap, smoothing or z-loss (bf16, fp32) the
buffer keeps exponentials and G = diag(r) E' + diag(c) T is never formed: the row factors r go
on the products' small side, and the target entries of rare targets (``_ForwardStep.take_out``)
stay out of the products, added in fp32 (see ``_row_kernels``); on an unsharded weight a chunk is
its sweep (``factored_sweep``) and one pass over its rows for finalize and row factors
(``factored_rows``). Otherwise it keeps logits relative to
their tile max, turned into G in place by one pass. The gradients are those of d loss with grad_output = 1;
the backward scales them by the real grad_output.

Backward of reduction "none" (a gradient per row, unknown in the forward) or of a returned
lse: the logits are recomputed chunk by chunk, now with lse known, and written directly
as grad logits (8 N V H flops in all).

Which loop a call takes, its chunks and its kernels are its ``_plan.Plan``'s; the rows' order is
``_row_order``'s, the gradients' sums ``_gradients``' and the class weights' algebra ``_row_algebra``'s.
"""

import functools
from dataclasses import dataclass, fields, replace

import torch

from . import _kept, _plan, _sparse_step
from ._distributed import Shard
from ._gradients import Gradients
from ._options import LossOptions, Request, RowResults, RowStats, accumulation_dtype
from ._plan import Plan, backend_for
from ._row_algebra import (
    kernel_row_grads,
    local_class_weight,
    row_weights,
    sweep_loss_grad,
    weight_row_losses,
    z_loss_rows,
)
from ._row_order import RowOrder, chunk_of, copy_to_host, rows_with_gradient

__all__ = ["ForwardResult", "backend_for", "backward", "copy_to_host", "forward", "plan_of", "unit_columns"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_interpretable(plan: Plan, hidden: torch.Tensor) -> None:
    """Refuses bf16 in Triton's interpreter (the Triton backend on CPU tensors), whose tl.dot gets
    bfloat16 wrong (triton issue #11584): the loss would be garbage, silently. Not upcast to fp32
    there: the interpreter is for checking the kernels as they run on the GPU, and the PyTorch
    path runs bf16 on CPU tensors as it is."""
    if hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu" and plan.backend == "triton":
        raise ValueError("hidden is bfloat16, which cannot run in Triton's interpreter (TRITON_INTERPRET=1: its "
                         "tl.dot gets bfloat16 wrong): use float32 or float16 there, or unset TRITON_INTERPRET "
                         "for the PyTorch path on CPU tensors")


@dataclass
class ForwardResult:
    loss: torch.Tensor  # fp32, () or [N] (fp64 for fp64 inputs, as every fp32 here)
    lse: torch.Tensor  # [N] fp32
    num_correct: torch.Tensor  # () int64
    entropy_sum: torch.Tensor  # () fp32
    grad_hidden: torch.Tensor | None  # [N, H]
    grad_weight: torch.Tensor | None  # [V, H]
    grad_bias: torch.Tensor | None  # [V]
    prediction: torch.Tensor | None = None  # [N] int64 argmax (-1 on ignored rows), with metrics
    correct: torch.Tensor | None = None  # [N] int32, with metrics
    entropy: torch.Tensor | None = None  # [N] fp32, with metrics
    mean_logit: torch.Tensor | None = None  # [N] fp32, with ``logit_sum``
    log_sum_sq: torch.Tensor | None = None  # [N] fp32 log sum_j p_j^2, with ``sum_sq``
    kept: "_kept.KeptRows | None" = None  # with ``keep``: what the backward takes for the kept rows
    row_divergence: torch.Tensor | None = None  # [N] with ``sparse``: each row's term of the top-k loss

# Targets of more rows than this keep their entries in the products even where p_t is small: it
# bounds the rows that ``add_target_rows`` sums for one target (an unmasked padding token at a
# model's start would be thousands).
IMPROBABLE_MAX_COUNT = 64


def _concat_stats(chunks: list[RowStats]) -> RowStats:
    """The statistics of consecutive chunks of rows as one block."""
    def joined(name):
        parts = [getattr(c, name) for c in chunks]
        return None if parts[0] is None else torch.cat(parts)

    return RowStats(**{f.name: joined(f.name) for f in fields(RowStats)})

class _ForwardStep:
    """What the chunk loops of one ``forward`` share: its ``plan`` (the rows' order, chunk size,
    first chunk, kernels), the per-row results and gradients being filled, and the target logits
    or row references taken for every row before the chunks."""

    def __init__(self, hidden, weight, targets, bias, request: Request, shard, class_weight, plan: Plan, backend):
        vocab_size = weight.shape[0]
        device = hidden.device
        opts = request.options
        self.plan, self.backend = plan, backend
        _check_interpretable(plan, hidden)
        self.hidden, self.weight, self.bias, self.opts, self.shard = hidden, weight, bias, opts, shard
        self.vocab_size = vocab_size
        self.return_metrics, self.logit_sum, self.sum_sq = request.return_metrics, request.logit_sum, request.sum_sq
        self.f32 = dict(device=device, dtype=accumulation_dtype(hidden.dtype))  # float64 for float64 inputs
        self.training = training = plan.pipeline in ("factored", "stored")
        grad_reduction = "mean" if request.outputs else request.reduction  # (per-token: a trainer's mean)
        self.row_order = row_order = (RowOrder(backend, targets, opts.ignore_index, grad_reduction == "mean")
                                      if plan.row_order == "targets" else None)
        self.row_block, self.chunk, self.first, self.sweep_tiles = (plan.row_block, plan.chunk_rows, plan.first_rows,
                                                                    plan.sweep_tiles)
        self.targets = targets = targets if row_order is None else row_order.targets
        self.row_weight = row_weights(targets, class_weight, opts.ignore_index)
        self.weight_sum = class_weight.sum() if class_weight is not None and opts.has_smoothing else None
        self.local_class_weight = local_class_weight(class_weight, opts, vocab_size, shard)
        # (the caller keeps class-weighted label smoothing and z-loss off this path: the smoothing
        # term and the unweighted z-loss are not in the stored-logits gradient pass)
        assert not (training and self.local_class_weight is not None), "class-weighted smoothing recomputes"
        assert not (training and self.row_weight is not None and opts.has_z_loss), "class-weighted z-loss recomputes"
        self.gradients = Gradients(hidden, vocab_size, plan.grads_in_forward, plan.n_chunks, row_order, shard,
                                   plan.weight_fp32, plan.weight_group)
        self.slice_targets = targets if shard is None else shard.local_targets(targets, vocab_size)
        self.factored = training and plan.target_logit == "reference"
        self.buffer = self.loss_grad = None
        if training:
            self.buffer = backend.new_buffer(self.first, vocab_size, hidden.dtype, device)
            self.loss_grad = sweep_loss_grad(targets, opts, grad_reduction, row_order, self.row_weight,
                                             self.weight_sum, vocab_size)
        self.takes_out = plan.take_out is not None  # (only grad_weight gains: grad_hidden's target term is exact)
        # The chunks' sums are taken against each row's reference where the step is factored, and
        # where a per-token forward without gradients must match such a step.
        self.referenced = plan.target_logit == "reference"
        rows = None if row_order is None else row_order.order
        # Every row's reference and target logit in one launch, the rows read in place (the order's
        # ignored rows at its end too: they are not known yet), where the backend does so.
        self.references = None
        if plan.references_first:
            self.references = backend.row_reference(hidden, weight, self.slice_targets, opts, rows=rows)
        # Otherwise every row's target logit in one launch before the chunks, where the backend's
        # statistics sweeps leave it to a product: a launch a chunk fills as few programs and takes as
        # long (docs/design.md).
        self.target_logits = None
        if plan.target_logit == "product":
            self.target_logits = backend.step_target_logits(hidden, weight, self.slice_targets, opts, bias, rows=rows)
        self.computed = 0

    # The per-row results and the rare targets' flags are made at their first use, for a factored
    # step once its first sweep is queued: the GPU, idle where the caller has just synchronised,
    # starts on it one host's round of allocations and launches sooner.
    @functools.cached_property
    def results(self) -> RowResults:
        return _new_results(self.hidden.shape[0], self.return_metrics, self.f32, self.logit_sum, self.sum_sq)

    @functools.cached_property
    def take_out(self) -> torch.Tensor | None:
        """[N] int8 take_out flags (``_kernel_math``): OUT_ALWAYS on the rows whose target column (of
        this weight) is the target of at most ``plan.take_out`` of the step's rows, OUT_IF_IMPROBABLE
        where of at most IMPROBABLE_MAX_COUNT (the row's entry then leaves if p_t < 2^-10), 0
        elsewhere. A rare target's entry is its column's largest term, best added to grad_weight
        once, in fp32, at the end; a frequent target's entries nearly cancel the column's other
        terms and stay in each chunk's product (docs/design.md). None: every entry stays in."""
        if not self.takes_out:
            return None
        return self.backend.take_out_flags(self.slice_targets, self.vocab_size, self.opts.ignore_index,
                                           self.plan.take_out, IMPROBABLE_MAX_COUNT)

    def chunks(self):
        """The chunks' rows [start, end) of the computed order, each with its hidden rows, targets
        (of this weight's columns), share of the buffer and d loss / d loss_i (None without
        gradients)."""
        row_order = self.row_order
        for start, end in self.plan.spans(self.hidden.shape[0], row_order):
            self.computed = end
            # (no local holds the chunk's hidden rows while the caller uses them: the caller drops
            # the gathered rows before grad_hidden's fp32 block is made, ``_factored_chunks``)
            yield (start, end,
                   chunk_of(self.hidden, row_order, start, end),
                   self.slice_targets[start:end], self.buffer[: end - start] if self.training else None,
                   self.loss_grad[start:end] if self.training else None)

    def results_of(self, start: int, end: int) -> RowResults:
        """The per-row results of rows [start, end)."""
        results = self.results
        return RowResults(*(None if t is None else t[start:end] for t in (
            results.lse, results.loss, results.correct, results.entropy, results.prediction, results.mean_logit,
            results.log_sum_sq)))

    def finish(self, stats: RowStats, start: int, end: int, out: RowResults | None = None) -> RowResults:
        """The results of rows [start, end) from their statistics: finalized by the backend unless
        ``out`` holds them already, then predictions, the mean logit, log sum_j p_j^2 and the class
        weights' share."""
        opts, targets = self.opts, self.targets[start:end]
        if out is None:
            out = self.results_of(start, end)
            self.backend.finalize(stats, targets, opts, self.vocab_size, out, return_metrics=self.return_metrics)
        valid = targets != opts.ignore_index
        if self.return_metrics:
            out.prediction.copy_(torch.where(valid, stats.argmax, -1))
        if self.logit_sum:
            out.mean_logit.copy_(torch.where(valid, stats.logit_sum * opts.inv_vocab_size(self.vocab_size), 0.0))
        if self.sum_sq:  # sum_j p_j^2 = sum_j exp(2 (z_j - m)) / (sum_j exp(z_j - m))^2
            out.log_sum_sq.copy_(torch.where(valid, stats.sum_sq.log() - 2.0 * stats.sum_exp.log(), 0.0))
        if self.row_weight is not None:
            weight_row_losses(out, stats, targets, self.row_weight[start:end], self.weight_sum, opts, self.vocab_size)
        return out

    def reference_of(self, start: int, end: int):
        """(B, target_logit) of rows [start, end) where taken before the chunks, else None."""
        return None if self.references is None else tuple(t[start:end] for t in self.references)

    def take_out_of(self, start: int, end: int):
        return None if self.take_out is None else self.take_out[start:end]

    def row_stats(self, start, end, hidden_c, targets_c, stored, loss_grad_c):
        """A chunk's statistics sweep: (stats, the state its buffer's passes need, row references)."""
        if self.references is not None:
            row_ref, target_logit = self.reference_of(start, end)
        elif self.referenced:  # one launch a chunk
            row_ref, target_logit = self.backend.row_reference(hidden_c, self.weight, targets_c, self.opts)
        else:
            row_ref = None
            target_logit = None if self.target_logits is None else self.target_logits[start:end]
        stats, state = self.backend.row_stats(
            hidden_c, self.weight, self.bias, targets_c, self.opts, stored, row_ref=row_ref,
            loss_grad=loss_grad_c if self.factored else None, class_weight=self.local_class_weight,
            target_logit=target_logit, return_metrics=self.return_metrics, logit_sum=self.logit_sum,
            sum_sq=self.sum_sq)
        return stats, state, row_ref


def _factored_chunks(step: _ForwardStep) -> None:
    """Training with the factored gradient against the whole vocabulary: a chunk is its sweep
    (storing exponentials), one pass over its rows (statistics, results, the gradient's factors)
    and the two products."""
    backend, gradients = step.backend, step.gradients
    for start, end, hidden_c, targets_c, stored, loss_grad_c in step.chunks():
        sweep = backend.factored_sweep(hidden_c, step.weight, targets_c, step.opts, stored, loss_grad_c,
                                       return_metrics=step.return_metrics, reference=step.reference_of(start, end))
        scaled_hidden = (torch.empty_like(hidden_c, memory_format=torch.contiguous_format)
                         if gradients.grad_weight is not None else None)
        out = step.results_of(start, end)
        stats, row_factor, target_grad = backend.factored_rows(
            sweep, hidden_c, targets_c, step.opts, stored, loss_grad_c, out, scaled_hidden,
            return_metrics=step.return_metrics, take_out=step.take_out_of(start, end))
        step.finish(stats, start, end, out)
        # What the products need of the chunk's hidden rows is in scaled_hidden now, and
        # grad_weight's product goes first: the gathered rows, then the scaled ones, are gone
        # before grad_hidden's fp32 block comes (chunk_rows counts H x 4 bytes a row beside
        # the buffer).
        hidden_c = None
        if scaled_hidden is not None:
            gradients.add_weight_grad(stored, scaled_hidden)
            scaled_hidden = None
        gradients.add_hidden_grad(start, end, stored, step.weight, row_factor, backend, (target_grad, targets_c))


def _statistics_chunks(step: _ForwardStep) -> None:
    """A forward without gradients: each chunk's statistics and results; under vocabulary
    parallelism the chunks' statistics are merged across the ranks once, at the end (two
    all-reduces a call)."""
    chunk_stats = []
    for start, end, hidden_c, targets_c, _, _ in step.chunks():
        stats, _, _ = step.row_stats(start, end, hidden_c, targets_c, None, None)
        if step.shard is None:
            step.finish(stats, start, end)
        else:
            chunk_stats.append(stats)
    if chunk_stats:
        step.finish(step.shard.merge(_concat_stats(chunk_stats)), 0, step.computed)


def _stored_chunks(step: _ForwardStep) -> None:
    """Training whose chunk buffer keeps what its gradient is made from (``z - tile max``, or under
    vocabulary parallelism the factored sweep's exponentials): the chunk's statistics, merged
    across the ranks (its gradient needs the global lse before the next chunk takes the buffer),
    its results, then its gradient from the buffer."""
    backend, gradients, opts = step.backend, step.gradients, step.opts
    for start, end, hidden_c, targets_c, stored, loss_grad_c in step.chunks():
        stats, state, row_ref = step.row_stats(start, end, hidden_c, targets_c, stored, loss_grad_c)
        local_row_max = stats.row_max
        if step.shard is not None:
            stats = step.shard.merge(stats)
        out = step.finish(stats, start, end)
        if step.factored:
            row_factor, target_grad = backend.row_factors(stored, state, local_row_max, row_ref, out.lse, loss_grad_c,
                                                          targets_c, opts, step.take_out_of(start, end))
            gradients.add(start, end, hidden_c, stored, step.weight, row_factor, backend, (target_grad, targets_c))
        else:
            grad_logits = backend.grad_from_stored(stored, state, targets_c, out.lse, loss_grad_c, opts,
                                                   gradients.bias_acc)
            gradients.add(start, end, hidden_c, grad_logits, step.weight)


def unit_columns(t: torch.Tensor) -> torch.Tensor:
    """``t`` [rows, C], copied where its columns are not adjacent (a transposed view): the logit
    kernels read rows of unit column stride. Taken once a call, not once a chunk."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def _shape(hidden, weight, bias, class_weight, shard: Shard | None) -> _plan.Shape:
    """The call's tensors as the plan sees them."""
    return _plan.Shape(
        hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.dtype, bias is not None, class_weight is not None,
        shard is not None, 1 if shard is None else shard.world_size,
        None if shard is None else shard.planning_vocab_size,
        hidden.is_cuda and torch.cuda.is_current_stream_capturing())


def plan_of(hidden, weight, bias, request: Request, class_weight=None, *, backward: bool = False,
            keep: bool = False, kept: bool = False, sparse: bool = False) -> Plan:
    """The plan of a ``forward`` (or with ``backward`` a ``backward``) of these tensors and ``request``
    (``sparse``: of a top-k loss's forward, as ``forward(..., sparse=...)`` plans it)."""
    shard = _shard(request.options)
    backend = backend_for(hidden.device)
    return _plan.plan(request, _shape(hidden, weight, bias, class_weight, shard), backend.hardware(hidden.device),
                      backward=backward, keep=keep, kept=kept, sparse=sparse)


def _shard(opts: LossOptions) -> Shard | None:
    return None if opts.group is None else Shard(opts.group, opts.vocab_start, opts.total_vocab_size)


def forward(hidden, weight, targets, bias, request: Request, class_weight: torch.Tensor | None = None,
            keep: bool = False, sparse: "_sparse_step.SparseLoss | None" = None) -> ForwardResult:
    """Loss and metrics of ``hidden @ weight.T + bias`` (hidden [N, H], weight [V, H]) under
    ``request``; with any of its gradients (hidden, weight, bias) also those, for grad_output 1.
    With the options' process group, weight and bias are this rank's slice of the vocabulary.
    ``class_weight`` [V of the whole vocabulary] (fp32, fp64 for fp64 inputs) weights the classes;
    with ``return_metrics`` also per-row argmax, correctness and entropy, with ``logit_sum`` each
    row's mean logit and with ``sum_sq`` its log sum_j p_j^2. Rows with an ignored target are
    skipped (lse 0, prediction -1) unless ``all_rows``.

    A per-token request (``outputs``) is of reduction "none" and makes the gradients of the mean
    in its sweep, as a trainer's loss usually is; without gradients, where a training step takes
    the factored gradient, it takes its statistics against the same row references, so that its
    outputs are the same bit for bit with or without gradients. With ``keep`` (a per-token forward
    whose backward will recompute) the result's ``kept`` holds what the backward takes for the
    rows it keeps (``_kept``). With ``sparse`` (a top-k loss on the (N, K) log-probs whose ids'
    first are ``targets``) it makes that loss's gradients, and the result's ``row_divergence``
    holds its per-row terms (``_sparse_step``).

    The chunks go through the loop of the plan's pipeline: the factored training step
    (``_factored_chunks``), training from a stored buffer (``_stored_chunks``: without the
    factored gradient, or under vocabulary parallelism), the kept rows (``_kept.forward_chunks``),
    the top-k loss's step (``_sparse_step.forward_chunks``) or the forward without gradients
    (``_statistics_chunks``)."""
    hidden, weight = unit_columns(hidden), unit_columns(weight)
    shard = _shard(request.options)
    backend = backend_for(hidden.device)
    plan = _plan.plan(request, _shape(hidden, weight, bias, class_weight, shard), backend.hardware(hidden.device),
                      keep=keep, sparse=sparse is not None)
    step = _ForwardStep(hidden, weight, targets, bias, request, shard, class_weight, plan, backend)
    kept = row_divergence = None
    if plan.pipeline == "factored":
        _factored_chunks(step)
    elif plan.pipeline == "stored":
        _stored_chunks(step)
    elif plan.pipeline == "kept":
        kept = _kept.forward_chunks(step)
    elif plan.pipeline == "sparse":
        row_divergence = _sparse_step.forward_chunks(step, sparse)
    else:
        _statistics_chunks(step)
    grads_out = step.gradients.finish(hidden.dtype, bias, backend, step.slice_targets)
    reduction = "none" if request.outputs else request.reduction
    result = _forward_result(step.results, grads_out, step.targets, request.options, reduction, step.row_order,
                             step.row_weight, request.return_metrics, step.f32)
    result.kept, result.row_divergence = kept, row_divergence
    return result


def _new_results(n_rows: int, return_metrics: bool, f32: dict, logit_sum: bool = False,
                 sum_sq: bool = False) -> RowResults:
    """Per-row results [N] in the computed order; rows never computed (ignored) keep these values."""
    device = f32["device"]
    return RowResults(
        lse=torch.zeros(n_rows, **f32),
        loss=torch.zeros(n_rows, **f32),
        correct=torch.zeros(n_rows, device=device, dtype=torch.int32) if return_metrics else None,
        entropy=torch.zeros(n_rows, **f32) if return_metrics else None,
        prediction=torch.full((n_rows,), -1, device=device, dtype=torch.int64) if return_metrics else None,
        mean_logit=torch.zeros(n_rows, **f32) if logit_sum else None,
        log_sum_sq=torch.zeros(n_rows, **f32) if sum_sq else None,
    )


def _forward_result(results: RowResults, gradients: tuple, targets, opts: LossOptions, reduction: str,
                    row_order: RowOrder | None, row_weight, return_metrics: bool, f32: dict) -> ForwardResult:
    """The reduced loss and metrics, with the per-row results back in the rows' own order."""

    def unordered(t):
        return t if t is None or row_order is None else row_order.unorder(t)

    # With class weights the rows hold their weighted cross-entropy, and the z-loss, unweighted,
    # is added here: a mean divides the one by the sum of the weights, the other by the count.
    z_rows = z_loss_rows(results.lse, targets, opts) if row_weight is not None else None
    if reduction == "none":
        loss = unordered(results.loss if z_rows is None else results.loss + z_rows)
    else:
        loss = results.loss.sum()
        count = (targets != opts.ignore_index).sum() if row_order is None else row_order.count[0]
        if reduction == "mean":
            loss = loss / (count if row_weight is None else row_weight.sum())
        if z_rows is not None:
            loss = loss + (z_rows.sum() / count if reduction == "mean" else z_rows.sum())
    if return_metrics:
        num_correct, entropy_sum = results.correct.sum(dtype=torch.int64), results.entropy.sum()
    else:
        num_correct = torch.zeros((), device=f32["device"], dtype=torch.int64)
        entropy_sum = torch.zeros((), **f32)
    grad_hidden, grad_weight, grad_bias = gradients
    return ForwardResult(
        loss=loss, lse=unordered(results.lse), num_correct=num_correct, entropy_sum=entropy_sum,
        grad_hidden=grad_hidden, grad_weight=grad_weight, grad_bias=grad_bias,
        prediction=unordered(results.prediction), correct=unordered(results.correct),
        entropy=unordered(results.entropy), mean_logit=unordered(results.mean_logit),
        log_sum_sq=unordered(results.log_sum_sq),
    )

def backward(hidden, weight, targets, bias, lse, loss_grad, lse_grad, request: Request,
             class_weight: torch.Tensor | None = None, entropy_grad: torch.Tensor | None = None,
             kept: _kept.KeptRows | None = None, sparse_terms: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Gradients (hidden, weight, bias), those of ``request.grads``, by recomputation, for a
    per-row ``loss_grad`` [N] (d out / d loss_i, 0 on ignored rows), an optional ``lse_grad`` [N]
    and the ``class_weight`` of the forward. With class weights, ``lse_grad`` carries the z-loss's
    gradient (``recomputed_row_grads``), which the kernels then leave out. ``entropy_grad`` [N] is
    d out / d entropy_i, whose -e_i H_i part the caller has added to ``lse_grad``. Only the rows
    with a non-zero upstream gradient are computed (``rows_with_gradient``); with ``kept`` (a
    per-token forward's ``_kept.KeptRows``, no shard) the kept rows from their buffers first, then
    the others by recomputation (every row the forward computed where the plan's row order is
    "forward": ``_plan.kept_rows_whole``). ``sparse_terms`` (ids, coef) [N, K] (no shard) are
    added to the grad logits at those columns (``Gradients.sparse_terms``)."""
    hidden, weight = unit_columns(hidden), unit_columns(weight)
    n_rows = hidden.shape[0]
    vocab_size = weight.shape[0]
    opts, grads, shard = request.options, request.grads, _shard(request.options)
    backend = backend_for(hidden.device)
    plan = _plan.plan(request, _shape(hidden, weight, bias, class_weight, shard), backend.hardware(hidden.device),
                      backward=True, kept=kept is not None, speculation=_kept.SPECULATION)
    row_weight = row_weights(targets, class_weight, opts.ignore_index)
    if row_weight is not None and opts.has_z_loss:
        opts = replace(opts, z_loss_scale=0.0)
    weight_sum = class_weight.sum() if class_weight is not None and opts.has_smoothing else None
    loss_grad, lse_grad, smooth_grad = kernel_row_grads(loss_grad, lse_grad, row_weight, weight_sum, opts, vocab_size)
    local_weight = local_class_weight(class_weight, opts, vocab_size, shard)
    chunk = plan.chunk_rows
    row_grads = [loss_grad, lse_grad, smooth_grad, entropy_grad]
    if sparse_terms is not None:  # (a row with only sparse entries has a gradient too)
        row_grads.append(sparse_terms[1].abs().sum(-1))
    fp32_sum, group = plan.weight_fp32, plan.weight_group
    if kept is not None:
        row_order = _kept.backward_order(kept, n_rows, row_grads, plan.row_order == "forward", request.outputs)
        gradients = Gradients(hidden, vocab_size, grads, row_order.chunks(chunk), row_order, shard, fp32_sum, group)
        gradients.sparse_terms = sparse_terms
        _kept.backward(kept, backend, row_order, gradients, chunk, hidden, weight, bias, opts,
                       (targets, lse, loss_grad, lse_grad, smooth_grad, entropy_grad), local_weight)
        return gradients.finish(hidden.dtype, bias, backend)
    # Under vocabulary parallelism every row is computed: the ranks' chunks must match.
    row_order = rows_with_gradient(backend, row_grads) if plan.row_order == "gradients" else None
    gradients = Gradients(hidden, vocab_size, grads, plan.n_chunks, row_order, shard, fp32_sum, group)
    gradients.sparse_terms = sparse_terms
    if shard is not None:
        targets = shard.local_targets(targets, vocab_size)
    if n_rows > 0:
        buffer = backend.new_buffer(min(chunk, n_rows), vocab_size, hidden.dtype, hidden.device)
        for start, end in plan.spans(n_rows, row_order):
            hidden_c, targets_c, lse_c, loss_grad_c, lse_grad_c, smooth_grad_c, entropy_grad_c = (
                chunk_of(t, row_order, start, end)
                for t in (hidden, targets, lse, loss_grad, lse_grad, smooth_grad, entropy_grad))
            grad_logits = backend.grad_logits(
                hidden_c, weight, bias, targets_c, lse_c, loss_grad_c, lse_grad_c, opts, buffer[: end - start],
                gradients.bias_acc, local_weight, smooth_grad_c, entropy_grad_c,
            )
            gradients.add(start, end, hidden_c, grad_logits, weight)
    return gradients.finish(hidden.dtype, bias, backend)
