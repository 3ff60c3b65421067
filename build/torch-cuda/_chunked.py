"""The algorithm: a loop over bounded chunks of rows, independent of the backend.

Forward, for each chunk of rows: one sweep over the vocabulary reduces every logit tile
to softmax statistics (``row_stats``), merged into lse, loss, argmax and entropy per row.

Training (reduction "mean"/"sum", gradients wanted): the same sweep also keeps the chunk's
logits, relative to their tile max, in a buffer of rows x V (never N x V). Once the
chunk's lse is known they become grad logits G in place, and two matrix products finish
the chunk: grad_hidden[chunk] = G @ W and grad_weight += G^T @ hidden[chunk]. The whole
step costs 6 N V H flops. The gradients are those of d loss with grad_output = 1; the
backward scales them by the real grad_output.

Backward of reduction "none" (a gradient per row, unknown in the forward) or of a returned
lse: the logits are recomputed chunk by chunk, now with lse known, and written directly
as grad logits (8 N V H flops in all).

Class weights w (PyTorch's ``weight=``) stay outside the chunk loop's kernels but for label
smoothing: a row's loss and gradient are those of the unweighted row times w_t (see
``weight_row_losses`` and ``kernel_row_grads``), and a mean divides by the sum of w_t.
"""

from dataclasses import dataclass, fields

import torch

from . import _torch_backend, _triton_backend
from ._distributed import Shard
from ._options import LossOptions, RowResults, RowStats, accumulation_dtype


def backend_for(device: torch.device):
    """Triton on CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``, when the kernels were
    decorated for the interpreter, i.e. the variable was set at import), else PyTorch."""
    if device.type == "cuda":
        return _triton_backend
    if device.type == "cpu" and _triton_backend.interpreting() and _triton_backend.KERNELS_INTERPRETED:
        return _triton_backend
    return _torch_backend


@dataclass
class ForwardResult:
    loss: torch.Tensor  # fp32, () or [N] (fp64 for fp64 inputs, as every fp32 here)
    lse: torch.Tensor  # [N] fp32
    num_correct: torch.Tensor  # () int64
    entropy_sum: torch.Tensor  # () fp32
    grad_hidden: torch.Tensor | None  # [N, H]
    grad_weight: torch.Tensor | None  # [V, H]
    grad_bias: torch.Tensor | None  # [V]
    prediction: torch.Tensor | None = None  # [N] int64 argmax, with metrics
    correct: torch.Tensor | None = None  # [N] int32, with metrics
    entropy: torch.Tensor | None = None  # [N] fp32, with metrics


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _chunks(n_rows: int, rows: int):
    for start in range(0, n_rows, rows):
        yield start, min(n_rows, start + rows)


def _matmuls(grad_logits, hidden, weight, grad_hidden, grad_weight, start, end):
    """grad_hidden[start:end] = G @ W and grad_weight (+)= G^T @ hidden[start:end]."""
    grad_logits = grad_logits.to(hidden.dtype)
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[start:end])
    if grad_weight is not None:
        if grad_weight.dtype != hidden.dtype:  # an fp32 accumulator: one rounding per chunk's part
            grad_weight += torch.mm(grad_logits.t(), hidden[start:end])
        elif start == 0:
            torch.mm(grad_logits.t(), hidden[start:end], out=grad_weight)
        else:
            grad_weight.addmm_(grad_logits.t(), hidden[start:end])


def _concat_stats(chunks: list[RowStats]) -> RowStats:
    """The statistics of consecutive chunks of rows as one block."""
    def joined(name):
        parts = [getattr(c, name) for c in chunks]
        return None if parts[0] is None else torch.cat(parts)

    return RowStats(**{f.name: joined(f.name) for f in fields(RowStats)})


def _plan_chunk(backend, n_rows: int, vocab_size: int, dtype: torch.dtype, training: bool,
                shard: Shard | None) -> int:
    """Rows per chunk; under vocabulary parallelism the same on every rank (see _distributed)."""
    if shard is None:
        return backend.chunk_rows(max(n_rows, 1), vocab_size, dtype, training)
    return backend.chunk_rows(max(n_rows, 1), shard.planning_vocab_size, dtype, training, shard.world_size)


def _new_weight_grad(vocab_size, hidden_size, hidden, chunk, n_chunks):
    """grad_weight [V, H], accumulated over the chunks in the inputs' dtype; in fp32 when that
    costs no more than the chunk buffer itself or 64 MiB, so that 16-bit rounding of the running
    sum does not build up over many chunks of a small head."""
    element_size = hidden.element_size()
    allowance = max(chunk * vocab_size * element_size, 64 * 2**20)
    fp32 = n_chunks > 1 and element_size < 4 and vocab_size * hidden_size * 4 <= allowance
    if fp32:
        return torch.zeros((vocab_size, hidden_size), device=hidden.device, dtype=torch.float32)
    new = torch.empty if n_chunks > 0 else torch.zeros  # the first chunk overwrites it
    return new((vocab_size, hidden_size), device=hidden.device, dtype=hidden.dtype)


def row_weights(targets, class_weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor | None:
    """w_t [N]: the class weight of each row's target (global index), 0 on ignored rows;
    None without class weights."""
    if class_weight is None:
        return None
    valid = targets != ignore_index
    picked = class_weight[torch.where(valid, targets, 0).clamp(0, class_weight.shape[0] - 1)]
    return torch.where(valid, picked, torch.zeros((), device=targets.device, dtype=class_weight.dtype))


def row_loss_grad(targets, opts: LossOptions, reduction: str, grad_output: torch.Tensor,
                  row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """d out / d loss_i [N] fp32 (fp64 for an fp64 loss): grad_output spread over the rows, 0 on
    ignored rows. A mean divides by the number of non-ignored rows, or with class weights by
    the sum of their ``row_weight`` (as F.cross_entropy)."""
    valid = targets != opts.ignore_index
    grad_output = grad_output.to(torch.promote_types(grad_output.dtype, torch.float32))
    if reduction == "mean":
        grad_output = grad_output / (valid.sum() if row_weight is None else row_weight.sum())
    return torch.where(valid, grad_output, torch.zeros((), device=targets.device, dtype=grad_output.dtype))


def kernel_row_grads(loss_grad, lse_grad, row_weight, weight_sum, opts: LossOptions, vocab_size: int):
    """The kernels' per-row (loss_grad, lse_grad, smooth_grad) for d out / d loss_i = ``loss_grad``
    when rows carry class weights ``row_weight`` (w_t; ``weight_sum`` = sum_j w_j).

    Row i's loss is w_t (lse - z_t) + k w_t lse^2, so the kernels take loss_grad w_t. With label
    smoothing, (1 - eps) w_t (lse - z_t) + (eps / V) sum_j w_j (lse - z_j) + k w_t lse^2 has the
    gradient p_j ((1 - eps) w_t + eps W / V + 2 k w_t lse) - (1 - eps) w_t [j = t] - (eps / V) w_j:
    the kernels' coefficient of p gets loss_grad eps (W / V - w_t) through lse_grad, and their
    smoothing term the column weights w_j, for smooth_grad = loss_grad."""
    if row_weight is None:
        return loss_grad, lse_grad, None
    weighted = loss_grad * row_weight
    if not opts.has_smoothing:
        return weighted, lse_grad, None
    extra = loss_grad * opts.label_smoothing * (weight_sum * opts.inv_vocab_size(vocab_size) - row_weight)
    return weighted, extra if lse_grad is None else lse_grad + extra, loss_grad


def weight_row_losses(out: RowResults, stats: RowStats, targets, row_weight, weight_sum, opts: LossOptions,
                      vocab_size: int) -> None:
    """Rewrites ``out.loss`` with class weights, as F.cross_entropy(weight=...) gives it per row:
    w_t (lse - z_t) + k w_t lse^2, and with label smoothing
    (1 - eps) w_t (lse - z_t) + (eps / V) (W lse - sum_j w_j z_j) + k w_t lse^2 (W = sum_j w_j;
    ``stats.logit_sum`` holds sum_j w_j z_j then)."""
    if not opts.has_smoothing:
        out.loss.mul_(row_weight)  # 0 on ignored rows already
        return
    eps, lse = opts.label_smoothing, out.lse
    loss = ((1.0 - eps) * row_weight * (lse - stats.target_logit)
            + eps * opts.inv_vocab_size(vocab_size) * (weight_sum * lse - stats.logit_sum))
    if opts.has_z_loss:
        loss = loss + opts.z_loss_scale * row_weight * lse * lse
    out.loss.copy_(torch.where(targets != opts.ignore_index, loss, torch.zeros_like(loss)))


def _local_class_weight(class_weight, opts: LossOptions, vocab_size: int, shard: Shard | None):
    """The class weights of this vocabulary slice [V], for the kernels: only label smoothing
    needs them there (None otherwise)."""
    if class_weight is None or not opts.has_smoothing:
        return None
    if shard is None:
        return class_weight
    return class_weight[shard.vocab_start: shard.vocab_start + vocab_size].contiguous()


def forward(hidden, weight, targets, bias, opts: LossOptions, reduction: str,
            grads: tuple[bool, bool, bool] = (False, False, False), shard: Shard | None = None,
            class_weight: torch.Tensor | None = None) -> ForwardResult:
    """Loss and metrics of ``hidden @ weight.T + bias`` (hidden [N, H], weight [V, H]);
    with any of ``grads`` (hidden, weight, bias) also those gradients, for grad_output 1.
    With a ``shard``, weight and bias are this rank's slice of the vocabulary. ``class_weight``
    [V of the whole vocabulary] (fp32, fp64 for fp64 inputs) weights the classes."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    backend = backend_for(device)
    f32 = dict(device=device, dtype=accumulation_dtype(hidden.dtype))  # float64 for float64 inputs
    rows = RowResults(
        lse=torch.empty(n_rows, **f32),
        loss=torch.empty(n_rows, **f32),
        correct=torch.zeros(n_rows, device=device, dtype=torch.int32) if opts.return_metrics else None,
        entropy=torch.zeros(n_rows, **f32) if opts.return_metrics else None,
        prediction=torch.empty(n_rows, device=device, dtype=torch.int64) if opts.return_metrics else None,
    )
    row_weight = row_weights(targets, class_weight, opts.ignore_index)
    weight_sum = class_weight.sum() if class_weight is not None and opts.has_smoothing else None
    local_class_weight = _local_class_weight(class_weight, opts, vocab_size, shard)
    want_h, want_w, want_b = grads
    training = any(grads) and n_rows > 0
    # (the caller keeps class-weighted label smoothing off this path: its smoothing term is not
    # in the stored-logits gradient pass)
    assert not (training and local_class_weight is not None), "class-weighted smoothing recomputes"
    chunk = _plan_chunk(backend, n_rows, vocab_size, hidden.dtype, training, shard)
    if training:
        buffer = backend.new_buffer(min(chunk, n_rows), vocab_size, hidden.dtype, device)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if want_h else None
    n_chunks = _cdiv(n_rows, chunk) if training else 0
    grad_weight = _new_weight_grad(vocab_size, hidden_size, hidden, chunk, n_chunks) if want_w else None
    bias_grad_acc = torch.zeros(vocab_size, **f32) if want_b else None
    slice_targets = targets if shard is None else shard.local_targets(targets, vocab_size)
    pending = []  # grad_hidden all-reduces in flight (vocabulary parallelism)
    # Vocabulary parallelism without gradients in the sweep: one merge of every row's
    # statistics (two all-reduces a call). Training merges per chunk: a chunk's gradient needs
    # its global lse before the next chunk takes the buffer.
    merge_once = shard is not None and not training
    chunk_stats = []

    def finish(stats, out, start, end):  # the per-row results of rows [start, end)
        backend.finalize(stats, targets[start:end], opts, vocab_size, out)
        if opts.return_metrics:
            out.prediction.copy_(stats.argmax)
        if row_weight is not None:
            weight_row_losses(out, stats, targets[start:end], row_weight[start:end], weight_sum, opts, vocab_size)

    for start, end in _chunks(n_rows, chunk):
        hidden_c, slice_targets_c = hidden[start:end], slice_targets[start:end]
        shifted = buffer[: end - start] if training else None
        stats, state = backend.row_stats(hidden_c, weight, bias, slice_targets_c, opts, shifted, local_class_weight)
        if merge_once:
            chunk_stats.append(stats)
            continue
        if shard is not None:
            stats = shard.merge(stats)
        out = RowResults(*(None if t is None else t[start:end]
                           for t in (rows.lse, rows.loss, rows.correct, rows.entropy, rows.prediction)))
        finish(stats, out, start, end)
        if training:
            if start == 0:  # queued after the first sweep, so that the GPU starts at once
                loss_grad = row_loss_grad(targets, opts, reduction, torch.ones((), device=device), row_weight)
                loss_grad = kernel_row_grads(loss_grad, None, row_weight, weight_sum, opts, vocab_size)[0]
            grad_logits = backend.grad_from_stored(
                shifted, state, slice_targets_c, out.lse, loss_grad[start:end], opts, bias_grad_acc
            )
            _matmuls(grad_logits, hidden, weight, grad_hidden, grad_weight, start, end)
            if shard is not None and grad_hidden is not None:
                pending.append(shard.start_all_reduce(grad_hidden[start:end]))
    for work in pending:
        work.wait()
    if merge_once and chunk_stats:
        finish(shard.merge(_concat_stats(chunk_stats)), rows, 0, n_rows)

    if reduction == "none":
        loss = rows.loss
    else:
        loss = rows.loss.sum()
        if reduction == "mean":
            loss = loss / ((targets != opts.ignore_index).sum() if row_weight is None else row_weight.sum())
    if opts.return_metrics:
        num_correct, entropy_sum = rows.correct.sum(dtype=torch.int64), rows.entropy.sum()
    else:
        num_correct = torch.zeros((), device=device, dtype=torch.int64)
        entropy_sum = torch.zeros((), **f32)
    return ForwardResult(
        loss=loss, lse=rows.lse, num_correct=num_correct, entropy_sum=entropy_sum,
        grad_hidden=grad_hidden, grad_weight=None if grad_weight is None else grad_weight.to(hidden.dtype),
        grad_bias=bias_grad_acc.to(bias.dtype) if want_b else None,
        prediction=rows.prediction, correct=rows.correct, entropy=rows.entropy,
    )


def backward(hidden, weight, targets, bias, lse, loss_grad, lse_grad, opts: LossOptions,
             grads: tuple[bool, bool, bool], shard: Shard | None = None, class_weight: torch.Tensor | None = None):
    """Gradients (hidden, weight, bias) by recomputation, for a per-row ``loss_grad`` [N]
    (d out / d loss_i, 0 on ignored rows), an optional ``lse_grad`` [N] and the ``class_weight``
    of the forward."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    backend = backend_for(device)
    row_weight = row_weights(targets, class_weight, opts.ignore_index)
    weight_sum = class_weight.sum() if class_weight is not None and opts.has_smoothing else None
    loss_grad, lse_grad, smooth_grad = kernel_row_grads(loss_grad, lse_grad, row_weight, weight_sum, opts, vocab_size)
    local_class_weight = _local_class_weight(class_weight, opts, vocab_size, shard)
    want_h, want_w, want_b = grads
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if want_h else None
    chunk = _plan_chunk(backend, n_rows, vocab_size, hidden.dtype, True, shard)
    n_chunks = _cdiv(n_rows, chunk)
    grad_weight = _new_weight_grad(vocab_size, hidden_size, hidden, chunk, n_chunks) if want_w else None
    bias_grad_acc = torch.zeros(vocab_size, device=device, dtype=accumulation_dtype(hidden.dtype)) if want_b else None
    if shard is not None:
        targets = shard.local_targets(targets, vocab_size)
    if n_rows > 0:
        buffer = backend.new_buffer(min(chunk, n_rows), vocab_size, hidden.dtype, device)
        pending = []
        for start, end in _chunks(n_rows, chunk):
            hidden_c = hidden[start:end]
            grad_logits = backend.grad_logits(
                hidden_c, weight, bias, targets[start:end], lse[start:end],
                loss_grad[start:end], None if lse_grad is None else lse_grad[start:end], opts,
                buffer[: end - start], bias_grad_acc,
                local_class_weight, None if smooth_grad is None else smooth_grad[start:end],
            )
            _matmuls(grad_logits, hidden, weight, grad_hidden, grad_weight, start, end)
            if shard is not None and grad_hidden is not None:
                pending.append(shard.start_all_reduce(grad_hidden[start:end]))
        for work in pending:
            work.wait()
    if grad_weight is not None:
        grad_weight = grad_weight.to(hidden.dtype)
    return grad_hidden, grad_weight, None if bias_grad_acc is None else bias_grad_acc.to(bias.dtype)
