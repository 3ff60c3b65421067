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
on the products' small side, and the target entries of rare targets (``_rare_target_rows``)
stay out of the products, added in fp32 (see ``_kernels``); on an unsharded weight a chunk is
its sweep (``factored_sweep``) and one pass over its rows for finalize and row factors
(``factored_rows``). Otherwise it keeps logits relative to
their tile max, turned into G in place by one pass. The gradients are those of d loss with grad_output = 1;
the backward scales them by the real grad_output.

Backward of reduction "none" (a gradient per row, unknown in the forward) or of a returned
lse: the logits are recomputed chunk by chunk, now with lse known, and written directly
as grad logits (8 N V H flops in all).
Class weights w (PyTorch's ``weight=``) stay outside the chunk loop's kernels but for label
smoothing: a row's cross-entropy and its gradient are those of the unweighted row times w_t (see
``weight_row_losses`` and ``kernel_row_grads``), and a mean divides them by the sum of w_t. The
z-loss is not weighted, as in Liger-Kernel (whose fused linear cross-entropy takes both options):
k lse_i^2 summed over the non-ignored rows, a mean divides it by their count (``z_loss_rows``,
``recomputed_row_grads``).
"""

import functools
import math
import os
from dataclasses import dataclass, fields, replace

import torch

from . import _kept, _torch_backend
from ._backend import Backend
from ._distributed import Shard
from ._options import LossOptions, RowResults, RowStats, accumulation_dtype
from ._settings import current as settings

# The Triton backend (it imports triton), imported on first use: CPU tensors outside the
# interpreter take the PyTorch backend, and triton may be absent (macOS, Windows, CPU-only Linux).
_triton_backend: Backend | None = None


def _import_triton_backend(why: str) -> Backend:
    """The Triton backend, imported once; without triton, an ImportError that starts with ``why``."""
    global _triton_backend
    try:
        from . import _triton_backend as module
    except ModuleNotFoundError as error:
        if error.name != "triton":
            raise
        raise ImportError(f"{why}, and triton is not installed: pip install triton") from error
    _triton_backend = module
    return module


def backend_for(device: torch.device) -> Backend:
    """Triton on CUDA (and on CPU tensors under ``TRITON_INTERPRET=1``, when the kernels were
    decorated for the interpreter, i.e. the variable was set when the Triton backend was first
    imported), else PyTorch; PyTorch for every tensor under FLCE_TRITON=0. Raises ImportError
    where Triton is wanted and triton is not installed."""
    if not settings().triton:
        return _torch_backend
    if device.type == "cuda":
        return _triton_backend or _import_triton_backend("fused_linear_ce runs Triton kernels on CUDA tensors")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1":
        backend = _triton_backend or _import_triton_backend(
            "TRITON_INTERPRET=1 runs the Triton kernels in Triton's CPU interpreter (unset it for the "
            "PyTorch path on CPU tensors)")
        if backend.KERNELS_INTERPRETED:
            return backend
    return _torch_backend


def _check_interpretable(backend: Backend, hidden: torch.Tensor) -> None:
    """Refuses bf16 in Triton's interpreter (the Triton backend on CPU tensors), whose tl.dot gets
    bfloat16 wrong (triton issue #11584): the loss would be garbage, silently. Not upcast to fp32
    there: the interpreter is for checking the kernels as they run on the GPU, and the PyTorch
    path runs bf16 on CPU tensors as it is."""
    if hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu" and backend is not _torch_backend:
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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# torch.mm(..., out_dtype=) on CUDA: PyTorch >= 2.8 (the aten::mm.dtype overload).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b [M, N] in fp32: 16-bit products accumulate in fp32, and the result stays so
    (rounded to 16 bits only after the row factors), where PyTorch allows it."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32) if _MM_OUT_DTYPE else torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())


_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for an fp32 ``acc``: 16-bit products accumulate into it in fp32 (on CUDA
    inside the product, with no 16-bit rounding of a @ b; elsewhere through an fp32 product)."""
    if a.is_cuda and a.dtype != torch.float32 and _ADDMM_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += _mm_f32(a, b)


def copy_to_host(t: torch.Tensor):
    """(host, ready): ``t`` copied to pinned host memory behind the work queued so far on the
    current stream, and the event that marks it done (None on the CPU, where ``host`` is ``t``):
    the host reads it after ``ready.synchronize()``, which waits for those kernels only."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(t.device))
    return host, ready


class _RowOrder:
    """The rows with a loss first (``order`` int64 [N], a stable partition), so that the
    chunks stop at their count instead of computing and masking ignored rows, which add no
    loss, gradient or metric. The host reads the count only once the first chunk's work is
    queued (``rows_to_compute``): the GPU never waits for the read. Also holds the ordered
    targets, the count on the device and each ordered row's d loss / d loss_i."""

    def __init__(self, backend, targets: torch.Tensor, ignore_index: int, mean: bool):
        self.order, self.targets, self.count, self.loss_grad = backend.order_rows(targets, ignore_index, mean)
        self.n_rows = targets.shape[0]
        self.in_place = 0  # rows [0, in_place) of the order are known to be the identity
        self._count, self._ready = copy_to_host(self.count)

    def rows_to_compute(self) -> int:
        """How many rows of the order have a loss (waits for the count)."""
        if self._ready is not None:
            self._ready.synchronize()
        total = int(self._count)
        if total == self.n_rows:  # no ignored row: the order is the identity
            self.in_place = total
        return total

    def take(self, t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the order, of ``t`` [N, ...]."""
        return t[start:end] if end <= self.in_place else t.index_select(0, self.order[start:end])

    def unorder(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row values [N] in the order, back in the rows' own order."""
        if self.in_place == self.n_rows:
            return values
        return torch.empty_like(values).index_copy_(0, self.order, values)


def _chunk_of(t: torch.Tensor | None, row_order: _RowOrder | None, start: int, end: int) -> torch.Tensor | None:
    """Rows [start, end) of the computed rows of ``t`` [N, ...] (None for None): in place, or in
    ``row_order``'s order."""
    if t is None:
        return None
    return t[start:end] if row_order is None else row_order.take(t, start, end)


def _row_order(backend, targets: torch.Tensor, opts: LossOptions, reduction: str, all_rows: bool):
    """A ``_RowOrder``, or None (compute every row in place) when every row's lse is wanted,
    while a CUDA graph is captured (the host cannot read the count then), or without
    ``skip_ignored`` (``_settings``)."""
    if all_rows or targets.numel() == 0 or not settings().skip_ignored:
        return None
    if targets.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return _RowOrder(backend, targets, opts.ignore_index, reduction == "mean")


def _rows_with_gradient(backend, row_grads: list[torch.Tensor | None]) -> _RowOrder | None:
    """For a recomputing backward: a ``_RowOrder`` of the rows where any of ``row_grads`` (per-row
    upstream gradients [N], or None) is not 0, or None where ``_row_order`` gives none. A row whose
    upstream gradients are all 0 has grad logits exactly 0 (ignored targets; in RL, tokens of a
    group whose rewards are all equal, hence advantages 0), so it is left out of the 8 N V H
    flops and gets a zero grad_hidden."""
    row_grads = [g for g in row_grads if g is not None]
    has_gradient = row_grads[0] != 0
    for g in row_grads[1:]:
        has_gradient |= g != 0
    # The order kernel puts the rows whose "target" is not ignore_index (here 0) first; "mean" as
    # the forwards' (its d loss / d loss_i go unused): the specialisation their first call compiles.
    return _row_order(backend, has_gradient.long(), LossOptions(ignore_index=0), "mean", False)


def _first_chunk_rows(n_rows: int, chunk: int, row_order: _RowOrder | None, training: bool,
                      row_block: int = 128, sweep_tiles: tuple[int, int] | None = None) -> int:
    """Rows of the first chunk, computed before the count of rows with a loss is known. When
    rows are skipped, a forward without gradients (which has no per-chunk accumulation to pay
    for) computes at most half of them first (in whole ``row_block``s), so that the ignored rows,
    last in the order, are left out unless they are more than half: 4096 rows in chunks of 4032
    (21 tiles of 192) take 2112, then the rest with a loss, not 4032 and the rest. With
    ``sweep_tiles`` a first chunk that more rows follow is sized to fill its sweep's rounds
    (``_fullest_first``)."""
    first = min(chunk, n_rows)
    if row_order is not None and not training and n_rows >= 2048:
        first = min(first, _cdiv(_cdiv(n_rows, 2), row_block) * row_block)
    if sweep_tiles is not None and first < n_rows:
        first = _fullest_first(n_rows, first, chunk, row_block, *sweep_tiles)
    return first


def _fullest_first(n_rows: int, first: int, chunk: int, row_block: int, tiles_per_block: int,
                   programs: int) -> int:
    """The first chunk's rows (the others are planned once the count is known: ``_spans``): of
    85% to 100% of ``first``, in whole blocks, the one whose sweep leaves the smallest share of
    its last round idle, among those that leave the ``n_rows`` (if all had a loss) as many more
    chunks of at most ``chunk`` as ``first`` does. Llama-2's 125 tiles a block on 132 programs:
    21 blocks (4032 rows) take 20 rounds for 19.89 of work, 19 blocks (3648) 18 rounds for 17.99;
    Llama-3's 501: 11 blocks (2112) take 42 for 41.75, 10 (1920) 38 for 37.95."""
    most = first // row_block
    if most == 0 or first % row_block:  # not whole blocks (exploration's chunk sizes): as it is
        return first

    def idle_share(blocks):
        rounds = _cdiv(blocks * tiles_per_block, programs)
        return (rounds * programs - blocks * tiles_per_block) / (rounds * programs)

    chunks_after = _cdiv(n_rows - first, chunk)
    candidates = [b for b in range(most, max(1, math.ceil(0.85 * most)) - 1, -1)  # largest first: ties keep it
                  if _cdiv(n_rows - b * row_block, chunk) == chunks_after]
    return min(candidates, key=idle_share) * row_block


def _spans(n_rows: int, chunk: int, row_order: _RowOrder | None, first: int, row_block: int = 128,
           sweep_tiles: tuple[int, int] | None = None):
    """[start, end) of each chunk: a first chunk of ``first`` rows, then the rows that
    ``row_order`` computes (asked once the first chunk's work is queued), spread evenly over
    chunks of at most ``chunk`` rows, in multiples of ``row_block`` (whole row blocks) but the
    last; with ``sweep_tiles``, in as many chunks, sized to fill the sweep's rounds
    (``_fullest_chunk``)."""
    if first == 0:
        return
    yield 0, first
    total = n_rows if row_order is None else max(first, row_order.rows_to_compute())
    rest = total - first
    if rest > 0:
        per_chunk = _cdiv(rest, _cdiv(rest, chunk))
        per_chunk = min(chunk, _cdiv(per_chunk, row_block) * row_block)
        n_chunks = _cdiv(rest, per_chunk)
        if sweep_tiles is not None:
            per_chunk = _fullest_chunk(rest, chunk, row_block, per_chunk, n_chunks, *sweep_tiles)
        starts = [first + i * per_chunk for i in range(n_chunks)]
        yield from zip(starts, [*starts[1:], total], strict=True)


def _fullest_chunk(rest: int, chunk: int, row_block: int, even: int, n_chunks: int, tiles_per_block: int,
                   programs: int) -> int:
    """Rows of each but the last of ``n_chunks`` chunks of ``rest`` rows (the last takes what is
    left, at most ``chunk``) such that their sweeps take the fewest rounds; the even spread
    ``even`` where no size takes fewer. A persistent sweep of B row blocks x T tiles on P programs
    takes ceil(B T / P) rounds, so where T < P (Llama-2's 125 tiles of 256 on 132 multiprocessors)
    a chunk of B <= 18 blocks takes B rounds and one of 19 takes 18: 28 blocks as 19 + 9 take 27
    rounds, as 14 + 14 take 28."""
    if even % row_block or n_chunks == 1:  # chunks smaller than a block (exploration), or one
        return even

    def rounds(rows):
        return _cdiv(_cdiv(rows, row_block) * tiles_per_block, programs)

    def cost(per_chunk):
        return (n_chunks - 1) * rounds(per_chunk) + rounds(rest - (n_chunks - 1) * per_chunk)

    fitting = [b * row_block for b in range(1, chunk // row_block + 1)
               if 0 < rest - (n_chunks - 1) * b * row_block <= chunk]
    return min([even, *fitting], key=cost)  # the even spread first: it wins ties


class _Gradients:
    """grad_hidden [N, H], grad_weight [V, H] and the bias' fp32 column sums, filled chunk by
    chunk of the computed rows (in ``row_order``'s order, or in place when it is None)."""

    def __init__(self, hidden, vocab_size, grads, chunk, n_chunks, row_order, shard):
        want_h, want_w, want_b = grads
        self.row_order, self.shard = row_order, shard
        self.hidden = hidden
        # The factored gradient's target entries c of the computed rows (in the order's order),
        # added to grad_weight at its one last rounding (``finish``).
        self.target_grads = []
        self.pending = []  # grad_hidden all-reduces in flight: (work, block, rows it goes to or None)
        self.grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if want_h else None
        self.grad_weight = _new_weight_grad(vocab_size, hidden.shape[1], hidden, chunk, n_chunks) if want_w else None
        self.bias_acc = torch.zeros(vocab_size, device=hidden.device,
                                    dtype=accumulation_dtype(hidden.dtype)) if want_b else None
        self.computed = 0
        # Chunks summed in the 16-bit grad_weight since it last restarted; past group_size of
        # them, they go to the fp32 weight_sum (see _add_weight_chunk). None: no groups (fp32, fp64).
        self.group_chunks = 0
        self.group_size = weight_group(hidden.dtype)
        self.weight_sum = None
        # (ids, coef) [N, K]: entries that the grad logits of each row take beside the softmax's, at
        # those columns (the (N, K) log-probs' other ids, sparse.py), or None.
        self.sparse_terms = None

    def add(self, start, end, hidden_c, grad_logits, weight, row_factor=None, backend=None, target_terms=None):
        """Adds the chunk [start, end) of the computed rows: grad logits G [rows, V], or with
        ``row_factor`` r [rows] and ``target_terms`` (c, targets) [rows] the factored
        G = diag(r) E' + diag(c) T (E' in ``grad_logits``), whose row factors
        ``backend.scale_rows`` applies on the products' small side."""
        if self.sparse_terms is not None:
            # Into G before its products: the sparse entries then cost no gather of weight's or
            # hidden's rows, at the 16-bit rounding G already has.
            ids, coef = (_chunk_of(t, self.row_order, start, end) for t in self.sparse_terms)
            grad_logits.scatter_add_(1, ids, coef.to(grad_logits.dtype))
        self.add_hidden_grad(start, end, grad_logits, weight, row_factor, backend, target_terms)
        if self.grad_weight is not None:
            # G^T H = E'^T (diag(r) H) + T^T diag(c) H: the row factors ride on the chunk's
            # hidden rows, the target terms wait for ``finish``.
            rhs = hidden_c
            if row_factor is not None:
                rhs = torch.empty_like(hidden_c, memory_format=torch.contiguous_format)
                backend.scale_rows(hidden_c, row_factor, rhs)
            self.add_weight_grad(grad_logits, rhs)

    def add_hidden_grad(self, start, end, grad_logits, weight, row_factor=None, backend=None, target_terms=None):
        """grad_hidden of the chunk [start, end) of the computed rows (see ``add``)."""
        self.computed = end
        if target_terms is not None:
            self.target_grads.append(target_terms[0])
        if self.grad_hidden is None:
            return
        in_place = self.row_order is None or end <= self.row_order.in_place
        rows = None if in_place else self.row_order.order[start:end]
        # Gathered rows go straight to their places, unless they are all-reduced first.
        block = self.grad_hidden[start:end] if in_place else None
        if block is None and self.shard is not None:
            block = self.grad_hidden.new_empty((end - start, self.grad_hidden.shape[1]))
        if row_factor is not None:
            terms = None if target_terms is None else (*target_terms, weight)
            backend.scale_rows(_mm_f32(grad_logits, weight), row_factor,
                               self.grad_hidden if block is None else block, None if block is not None else rows, terms)
        elif block is not None:
            torch.mm(grad_logits.to(weight.dtype), weight, out=block)
        else:
            self.grad_hidden.index_copy_(0, rows, torch.mm(grad_logits.to(weight.dtype), weight))
        if self.shard is not None:
            self.pending.append((self.shard.start_all_reduce(block), block, rows))

    def add_weight_grad(self, grad_logits, rhs):
        """grad_weight += grad_logits^T @ rhs for a chunk: its G (or E') [rows, V] and hidden rows
        (or diag(r) hidden) [rows, H]."""
        self._add_weight_chunk(grad_logits.to(rhs.dtype).t(), rhs)

    def _add_weight_chunk(self, lhs, rhs):
        """grad_weight += lhs @ rhs. A 16-bit running sum is rounded every chunk (on the H200,
        cuBLAS's beta = 1 result is off by up to a whole 16-bit step, as if it rounded lhs @ rhs
        before adding the sum, with or without torch's reduced-precision reductions: docs/design.md),
        so that its error grows with the number of
        chunks; past ``group_size`` chunks the sum of each group of chunks is added to an fp32 sum
        instead (``weight_sum``, V x H x 4 bytes whatever N), and the 16-bit tensor restarts from
        the next chunk's product. The error is then that of at most ``group_size`` chunks, for any
        number of rows."""
        if self.grad_weight.dtype != lhs.dtype:  # an fp32 accumulator from the start (small heads)
            _addmm_f32_(self.grad_weight, lhs, rhs)
            return
        if self.group_size is not None and self.group_chunks == self.group_size:
            if self.weight_sum is None:
                self.weight_sum = self.grad_weight.float()
            else:
                self.weight_sum += self.grad_weight
            self.group_chunks = 0
        if self.group_chunks == 0:
            torch.mm(lhs, rhs, out=self.grad_weight)
        else:
            self.grad_weight.addmm_(lhs, rhs)
        self.group_chunks += 1

    def finish(self, dtype, bias, backend=None, targets=None):
        """(grad_hidden, grad_weight, grad_bias) in the inputs' dtype, all-reduces done; rows
        never computed get an exactly zero grad_hidden; the factored chunks' target terms go
        into grad_weight's fp32 sum (or its last rounding) through ``backend``, with ``targets``
        [N] the rows' columns of this weight (in the order's order)."""
        for work, block, rows in self.pending:
            work.wait()
            if rows is not None:
                self.grad_hidden.index_copy_(0, rows, block)
        if self.grad_hidden is not None and self.row_order is not None and self.computed < self.row_order.n_rows:
            backend.zero_rows(self.grad_hidden, self.row_order.order[self.computed:])
        grad_weight = self.grad_weight
        if grad_weight is not None and self.target_grads:
            rows = None if self.row_order is None or self.computed <= self.row_order.in_place \
                else self.row_order.order[:self.computed]
            backend.add_target_rows(grad_weight if self.weight_sum is None else self.weight_sum,
                                    torch.cat(self.target_grads), targets[:self.computed], self.hidden, rows)
        self.target_grads = []
        if self.weight_sum is not None:  # one rounding of the fp32 sum of the groups and the last one
            grad_weight = torch.add(self.weight_sum, grad_weight, out=grad_weight)
            self.weight_sum = None
        grad_weight = None if grad_weight is None else grad_weight.to(dtype)
        grad_bias = None if self.bias_acc is None else self.bias_acc.to(bias.dtype)
        return self.grad_hidden, grad_weight, grad_bias


# Targets of more rows than this keep their entries in the products even where p_t is small: it
# bounds the rows that ``add_target_rows`` sums for one target (an unmasked padding token at a
# model's start would be thousands).
IMPROBABLE_MAX_COUNT = 64


def _rare_target_rows(backend, targets: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor | None:
    """[N] int8 take_out flags (``_kernels``): OUT_ALWAYS on the rows whose target column (of this
    weight) is the target of at most ``rare_target`` (``_settings``, 2) of the step's rows, OUT_IF_IMPROBABLE
    where it is of at most IMPROBABLE_MAX_COUNT (the row's entry then leaves if p_t < 2^-10), 0
    elsewhere. A rare target's entry is its column's largest term, best added to grad_weight
    once, in fp32, at the end; a frequent target's entries nearly cancel the column's other terms
    and stay in each chunk's product (docs/design.md). ``rare_target`` -1: None, every
    entry stays in (no counts, no target terms: the rule's cost, measured)."""
    rare = settings().rare_target
    if rare < 0:
        return None
    return backend.take_out_flags(targets, vocab_size, ignore_index, rare, IMPROBABLE_MAX_COUNT)


def _concat_stats(chunks: list[RowStats]) -> RowStats:
    """The statistics of consecutive chunks of rows as one block."""
    def joined(name):
        parts = [getattr(c, name) for c in chunks]
        return None if parts[0] is None else torch.cat(parts)

    return RowStats(**{f.name: joined(f.name) for f in fields(RowStats)})


def _plan_chunk(backend, n_rows: int, vocab_size: int, hidden_size: int, dtype: torch.dtype, training: bool,
                shard: Shard | None, spread: bool = True, row_block: int = 128, weight_grad: bool = False) -> int:
    """Rows per chunk; under vocabulary parallelism the same on every rank (see _distributed).
    Without ``spread`` the largest chunk: when ignored rows are skipped, ``n_rows`` overstates
    the rows to compute, and spreading it evenly would plan more chunks than they need. A
    training step that sums ``weight_grad`` may take fewer, larger chunks (``_grown_chunk``)."""
    shards = 1 if shard is None else shard.world_size
    if shard is not None:
        vocab_size = shard.planning_vocab_size
    chunk = backend.chunk_rows(max(n_rows, 1), vocab_size, dtype, training, shards, spread=spread,
                               hidden_size=hidden_size, row_block=row_block)
    if training and weight_grad:
        chunk = _grown_chunk(backend, n_rows, chunk, vocab_size, hidden_size, dtype, shards, row_block)
    return chunk


def _grown_chunk(backend, n_rows: int, chunk: int, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 shards: int, row_block: int) -> int:
    """The rows of a training step's chunks, grown to ``weight_group`` chunks where its planned
    ``chunk`` would take more: those steps keep an fp32 sum of grad_weight (V x H x 4 bytes,
    ``_Gradients._add_weight_chunk``), and chunks of n_rows / 8 rows fit in the memory that sum
    and the planned chunk take (``backend.chunk_bytes``) while their buffer is smaller than the
    sum. Their 16-bit running sum is then that of at most 8 chunks, as the groups' is, with no
    fp32 sum, and each chunk less re-reads W twice and grad_weight once: on the Llama-3 head
    32768 rows take 8 chunks of 4224 (about 1.1 GB) instead of 20 of 1536 beside the 2 GiB sum
    (2.4 GB). Elsewhere, with ``chunk_rows`` set (a cap) or without ``grow_chunks``, ``chunk``;
    under vocabulary parallelism every rank plans the same (``vocab_size`` is the planning
    slice)."""
    group = weight_group(dtype)
    if group is None or not settings().grow_chunks or settings().chunk_rows is not None:
        return chunk
    most = backend.chunk_rows(max(n_rows, 1), vocab_size, dtype, True, shards, spread=False,
                              hidden_size=hidden_size, row_block=row_block)
    fp32_sum = vocab_size * hidden_size * 4
    if _cdiv(n_rows, most) <= group or _fp32_from_start(vocab_size, hidden_size, dtype.itemsize, most):
        return chunk  # no fp32 sum past the group to take the place of
    grown = _cdiv(_cdiv(n_rows, group), row_block) * row_block
    grown_bytes = backend.chunk_bytes(grown, vocab_size, dtype, hidden_size, shards)
    # (a buffer of fewer than 2^31 elements, as the planned ones: at most 768 MiB of them)
    if grown_bytes is None or grown * vocab_size * dtype.itemsize >= fp32_sum or grown * vocab_size >= 2**31:
        return chunk
    if grown_bytes > backend.chunk_bytes(most, vocab_size, dtype, hidden_size, shards) + fp32_sum:
        return chunk
    return grown


def weight_group(dtype: torch.dtype) -> int | None:
    """Chunks summed into a 16-bit grad_weight before that sum goes to an fp32 sum
    (``weight_group``, 8: ``_Gradients._add_weight_chunk``); None for 32- and 64-bit inputs,
    whose grad_weight is its own sum."""
    return max(1, settings().weight_group) if dtype.itemsize < 4 else None


def _fp32_from_start(vocab_size: int, hidden_size: int, element_size: int, chunk: int) -> bool:
    """Whether a 16-bit grad_weight of many chunks is summed in fp32 from the start: where
    that costs no more than the chunk buffer itself or ``weight_fp32_mib`` (64 MiB)."""
    allowance = max(chunk * vocab_size * element_size, settings().weight_fp32_mib * 2**20)
    return element_size < 4 and vocab_size * hidden_size * 4 <= allowance


def _new_weight_grad(vocab_size, hidden_size, hidden, chunk, n_chunks):
    """grad_weight [V, H], accumulated over the chunks in the inputs' dtype; in fp32 from the
    start where ``_fp32_from_start``, so that 16-bit rounding of the running sum does not build
    up over many chunks of a small head (larger heads bound it by groups of chunks:
    ``_Gradients._add_weight_chunk``)."""
    fp32 = n_chunks > 1 and _fp32_from_start(vocab_size, hidden_size, hidden.element_size(), chunk)
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


def z_loss_rows(lse: torch.Tensor, targets: torch.Tensor, opts: LossOptions) -> torch.Tensor | None:
    """The z-loss k lse_i^2 [N] of each row, 0 on ignored rows; None without a z-loss."""
    if not opts.has_z_loss:
        return None
    return torch.where(targets != opts.ignore_index, opts.z_loss_scale * lse * lse, 0.0)


def recomputed_row_grads(targets, opts: LossOptions, reduction: str, grad_output: torch.Tensor, lse_grad, lse,
                         row_weight: torch.Tensor | None):
    """(loss_grad, lse_grad) [N] for ``backward``: d out / d loss_i (``row_loss_grad``) and
    d out / d lse_i (``lse_grad`` [N] of the returned lse, or None). With class weights and a
    z-loss, the z-loss's gradient 2 k lse_i g_i joins lse_grad, with g_i = d out / d (k lse_i^2)
    unweighted (grad_output, over the non-ignored rows' count for a mean); the rows' loss_grad
    then stands for their weighted cross-entropy alone."""
    loss_grad = row_loss_grad(targets, opts, reduction, grad_output, row_weight)
    if row_weight is None or not opts.has_z_loss:
        return loss_grad, lse_grad
    z_grad = row_loss_grad(targets, opts, reduction, grad_output)
    extra = (2.0 * opts.z_loss_scale) * lse * z_grad.to(lse.dtype)
    return loss_grad, extra if lse_grad is None else lse_grad + extra


def kernel_row_grads(loss_grad, lse_grad, row_weight, weight_sum, opts: LossOptions, vocab_size: int):
    """The kernels' per-row (loss_grad, lse_grad, smooth_grad) for d out / d loss_i = ``loss_grad``
    when rows carry class weights ``row_weight`` (w_t; ``weight_sum`` = sum_j w_j).

    Row i's cross-entropy is w_t (lse - z_t), so the kernels take loss_grad w_t (and no z-loss:
    its gradient is in lse_grad, ``recomputed_row_grads``). With label smoothing,
    (1 - eps) w_t (lse - z_t) + (eps / V) sum_j w_j (lse - z_j) has the gradient
    p_j ((1 - eps) w_t + eps W / V) - (1 - eps) w_t [j = t] - (eps / V) w_j: the kernels'
    coefficient of p gets loss_grad eps (W / V - w_t) through lse_grad, and their smoothing term
    the column weights w_j, for smooth_grad = loss_grad."""
    if row_weight is None:
        return loss_grad, lse_grad, None
    weighted = loss_grad * row_weight
    if not opts.has_smoothing:
        return weighted, lse_grad, None
    extra = loss_grad * opts.label_smoothing * (weight_sum * opts.inv_vocab_size(vocab_size) - row_weight)
    return weighted, extra if lse_grad is None else lse_grad + extra, loss_grad


def weight_row_losses(out: RowResults, stats: RowStats, targets, row_weight, weight_sum, opts: LossOptions,
                      vocab_size: int) -> None:
    """Rewrites ``out.loss`` with class weights as F.cross_entropy(weight=...) gives it per row:
    w_t (lse - z_t), and with label smoothing (1 - eps) w_t (lse - z_t) + (eps / V) (W lse - sum_j w_j z_j)
    (W = sum_j w_j; ``stats.logit_sum`` holds sum_j w_j z_j then); 0 on ignored rows. The z-loss,
    unweighted, is left out: ``_forward_result`` adds it (``z_loss_rows``)."""
    if not opts.has_smoothing and not opts.has_z_loss:
        out.loss.mul_(row_weight)  # 0 on ignored rows already
        return
    lse = out.lse
    if opts.has_smoothing:
        eps = opts.label_smoothing
        loss = ((1.0 - eps) * row_weight * (lse - stats.target_logit)
                + eps * opts.inv_vocab_size(vocab_size) * (weight_sum * lse - stats.logit_sum))
    else:
        loss = row_weight * (lse - stats.target_logit)
    out.loss.copy_(torch.where(targets != opts.ignore_index, loss, torch.zeros_like(loss)))


def _local_class_weight(class_weight, opts: LossOptions, vocab_size: int, shard: Shard | None):
    """The class weights of this vocabulary slice [V], for the kernels: only label smoothing
    needs them there (None otherwise)."""
    if class_weight is None or not opts.has_smoothing:
        return None
    if shard is None:
        return class_weight
    return class_weight[shard.vocab_start: shard.vocab_start + vocab_size].contiguous()


class _ForwardStep:
    """What the chunk loops of one ``forward`` share: the plan (the rows' order, chunk size, first
    chunk), the per-row results and gradients being filled, and the target logits or row
    references taken for every row before the chunks."""

    def __init__(self, hidden, weight, targets, bias, opts: LossOptions, reduction: str, grads, shard, class_weight,
                 all_rows: bool, return_metrics: bool, logit_sum: bool, sum_sq: bool, match_training: bool,
                 grad_reduction: str):
        n_rows, hidden_size = hidden.shape
        vocab_size = weight.shape[0]
        device = hidden.device
        self.backend = backend = backend_for(device)
        _check_interpretable(backend, hidden)
        self.hidden, self.weight, self.bias, self.opts, self.shard = hidden, weight, bias, opts, shard
        self.vocab_size = vocab_size
        self.return_metrics, self.logit_sum, self.sum_sq = return_metrics, logit_sum, sum_sq
        self.f32 = dict(device=device, dtype=accumulation_dtype(hidden.dtype))  # float64 for float64 inputs
        self.training = training = any(grads) and n_rows > 0
        self.row_order = row_order = _row_order(backend, targets, opts, grad_reduction, all_rows)
        # Under vocabulary parallelism every rank plans the same chunks: the 128-row blocks of all.
        self.row_block = 128 if shard is not None else backend.row_block(hidden.dtype, opts, bias is not None,
                                                                         training, return_metrics, device)
        self.chunk = _plan_chunk(backend, n_rows, vocab_size, hidden_size, hidden.dtype, training, shard,
                                 spread=row_order is None, row_block=self.row_block, weight_grad=grads[1])
        # A forward's chunks sized to fill its sweep's rounds (training's take the memory's cap; the
        # ranks of a vocabulary split plan the same chunks, whatever their slice's tiles)
        self.sweep_tiles = (None if training or shard is not None
                            else backend.sweep_tiles(vocab_size, hidden.dtype, device))
        self.first = _first_chunk_rows(n_rows, self.chunk, row_order, training, self.row_block, self.sweep_tiles)
        self.targets = targets = targets if row_order is None else row_order.targets
        self.row_weight = row_weights(targets, class_weight, opts.ignore_index)
        self.weight_sum = class_weight.sum() if class_weight is not None and opts.has_smoothing else None
        self.local_class_weight = _local_class_weight(class_weight, opts, vocab_size, shard)
        # (the caller keeps class-weighted label smoothing and z-loss off this path: the smoothing
        # term and the unweighted z-loss are not in the stored-logits gradient pass)
        assert not (training and self.local_class_weight is not None), "class-weighted smoothing recomputes"
        assert not (training and self.row_weight is not None and opts.has_z_loss), "class-weighted z-loss recomputes"
        n_chunks = _cdiv(n_rows, self.chunk) if training else 0
        self.gradients = _Gradients(hidden, vocab_size, grads, self.chunk, n_chunks, row_order, shard)
        self.slice_targets = targets if shard is None else shard.local_targets(targets, vocab_size)
        self.factored = training and backend.factored_gradient(hidden.dtype, opts, bias is not None)
        self.buffer = self.loss_grad = None
        if training:
            self.buffer = backend.new_buffer(self.first, vocab_size, hidden.dtype, device)
            self.loss_grad = _sweep_loss_grad(targets, opts, grad_reduction, row_order, self.row_weight,
                                              self.weight_sum, vocab_size)
        self.takes_out = self.factored and grads[1]  # (only grad_weight gains: grad_hidden's target term is exact)
        # The chunks' sums are taken against each row's reference where the step is factored, and
        # where a forward without gradients must match such a step (``match_training``).
        self.referenced = self.factored or (match_training and not training and n_rows > 0
                                            and backend.factored_gradient(hidden.dtype, opts, bias is not None))
        rows = None if row_order is None else row_order.order
        # Every row's reference and target logit in one launch, the rows read in place (the order's
        # ignored rows at its end too: they are not known yet), where the backend does so.
        self.references = None
        if self.referenced and shard is None:
            self.references = backend.row_reference(hidden, weight, self.slice_targets, opts, rows=rows)
        # Otherwise every row's target logit in one launch before the chunks, where the backend's
        # statistics sweeps leave it to a product: a launch a chunk fills as few programs and takes as
        # long (docs/design.md).
        self.target_logits = None
        if not self.referenced and n_rows > 0:
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
        if not self.takes_out:
            return None
        return _rare_target_rows(self.backend, self.slice_targets, self.vocab_size, self.opts.ignore_index)

    def chunks(self):
        """The chunks' rows [start, end) of the computed order, each with its hidden rows, targets
        (of this weight's columns), share of the buffer and d loss / d loss_i (None without
        gradients)."""
        row_order = self.row_order
        for start, end in _spans(self.hidden.shape[0], self.chunk, row_order, self.first, self.row_block,
                                 self.sweep_tiles):
            self.computed = end
            # (no local holds the chunk's hidden rows while the caller uses them: the caller drops
            # the gathered rows before grad_hidden's fp32 block is made, ``_factored_chunks``)
            yield (start, end,
                   _chunk_of(self.hidden, row_order, start, end),
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


def forward(hidden, weight, targets, bias, opts: LossOptions, reduction: str,
            grads: tuple[bool, bool, bool] = (False, False, False), shard: Shard | None = None,
            class_weight: torch.Tensor | None = None, all_rows: bool = False,
            return_metrics: bool = False, logit_sum: bool = False, sum_sq: bool = False,
            match_training: bool = False, grad_reduction: str | None = None, keep: bool = False) -> ForwardResult:
    """Loss and metrics of ``hidden @ weight.T + bias`` (hidden [N, H], weight [V, H]);
    with any of ``grads`` (hidden, weight, bias) also those gradients, for grad_output 1.
    With a ``shard``, weight and bias are this rank's slice of the vocabulary. ``class_weight``
    [V of the whole vocabulary] (fp32, fp64 for fp64 inputs) weights the classes; with
    ``return_metrics`` also per-row argmax, correctness and entropy, with ``logit_sum`` each
    row's mean logit and with ``sum_sq`` its log sum_j p_j^2 (the per-token outputs). Rows with
    an ignored target are skipped (lse 0, prediction -1) unless ``all_rows``.

    With ``match_training``, where a training step takes the factored gradient, a forward
    without gradients takes its statistics against the same row references, so that metrics and
    per-row results are the same bit for bit with or without gradients. ``grad_reduction``
    (default: ``reduction``) is the reduction whose gradients the sweep computes: the per-token
    outputs take those of the mean, as a trainer's loss usually is. With ``keep`` (a per-token
    forward whose backward will recompute, no gradients here, no ``shard``) the result's ``kept``
    holds what the backward takes for the rows it keeps (``_kept_chunks``).

    The chunks go through one of three loops: the factored training step (``_factored_chunks``),
    the forward without gradients (``_statistics_chunks``), and training from a stored buffer
    (``_stored_chunks``: without the factored gradient, or under vocabulary parallelism)."""
    hidden, weight = unit_columns(hidden), unit_columns(weight)
    step = _ForwardStep(hidden, weight, targets, bias, opts, reduction, grads, shard, class_weight, all_rows,
                        return_metrics, logit_sum, sum_sq, match_training, grad_reduction or reduction)
    kept = None
    if step.factored and shard is None:
        _factored_chunks(step)
    elif step.training:
        _stored_chunks(step)
    elif keep and shard is None and hidden.shape[0] > 0 and settings().keep_mib != 0:  # (0: as without keep)
        kept = _kept.forward_chunks(step)
    else:
        _statistics_chunks(step)
    grads_out = step.gradients.finish(hidden.dtype, bias, step.backend, step.slice_targets)
    result = _forward_result(step.results, grads_out, step.targets, opts, reduction, step.row_order, step.row_weight,
                             return_metrics, step.f32)
    result.kept = kept
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


def _sweep_loss_grad(targets, opts: LossOptions, reduction: str, row_order: _RowOrder | None, row_weight,
                     weight_sum, vocab_size: int) -> torch.Tensor:
    """d loss / d loss_i [N] of the rows in the computed order, for the gradients made in the
    sweep (grad_output 1): the row order's own, or with class weights (or every row computed)
    from the targets."""
    if row_order is not None and row_weight is None:
        return row_order.loss_grad
    loss_grad = row_loss_grad(targets, opts, reduction, torch.ones((), device=targets.device), row_weight)
    return kernel_row_grads(loss_grad, None, row_weight, weight_sum, opts, vocab_size)[0]


def _forward_result(results: RowResults, gradients: tuple, targets, opts: LossOptions, reduction: str,
                    row_order: _RowOrder | None, row_weight, return_metrics: bool, f32: dict) -> ForwardResult:
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


def backward(hidden, weight, targets, bias, lse, loss_grad, lse_grad, opts: LossOptions,
             grads: tuple[bool, bool, bool], shard: Shard | None = None, class_weight: torch.Tensor | None = None,
             entropy_grad: torch.Tensor | None = None, kept: _kept.KeptRows | None = None,
             sparse_terms: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Gradients (hidden, weight, bias) by recomputation, for a per-row ``loss_grad`` [N]
    (d out / d loss_i, 0 on ignored rows), an optional ``lse_grad`` [N] and the ``class_weight``
    of the forward. With class weights, ``lse_grad`` carries the z-loss's gradient
    (``recomputed_row_grads``), which the kernels then leave out. ``entropy_grad`` [N] is
    d out / d entropy_i, whose -e_i H_i part the caller has added to ``lse_grad``. Only the rows
    with a non-zero upstream gradient are computed (``_rows_with_gradient``); with ``kept`` (a
    per-token forward's ``_kept.KeptRows``, no shard) the kept rows from their buffers first, then
    the others by recomputation. ``sparse_terms`` (ids, coef) [N, K] (no shard) are added to the
    grad logits at those columns (``_Gradients.sparse_terms``)."""
    hidden, weight = unit_columns(hidden), unit_columns(weight)
    n_rows = hidden.shape[0]
    vocab_size = weight.shape[0]
    backend = backend_for(hidden.device)
    row_weight = row_weights(targets, class_weight, opts.ignore_index)
    if row_weight is not None and opts.has_z_loss:
        opts = replace(opts, z_loss_scale=0.0)
    weight_sum = class_weight.sum() if class_weight is not None and opts.has_smoothing else None
    loss_grad, lse_grad, smooth_grad = kernel_row_grads(loss_grad, lse_grad, row_weight, weight_sum, opts, vocab_size)
    local_class_weight = _local_class_weight(class_weight, opts, vocab_size, shard)
    chunk = _plan_chunk(backend, n_rows, vocab_size, hidden.shape[1], hidden.dtype, True, shard, weight_grad=grads[1])
    row_grads = [loss_grad, lse_grad, smooth_grad, entropy_grad]
    if sparse_terms is not None:  # (a row with only sparse entries has a gradient too)
        row_grads.append(sparse_terms[1].abs().sum(-1))
    if kept is not None:
        row_order = _kept.KeptFirstOrder(kept, n_rows, row_grads)
        gradients = _Gradients(hidden, vocab_size, grads, chunk, row_order.chunks(chunk), row_order, shard)
        gradients.sparse_terms = sparse_terms
        _kept.backward(kept, backend, row_order, gradients, chunk, hidden, weight, bias, opts,
                       (targets, lse, loss_grad, lse_grad, smooth_grad, entropy_grad), local_class_weight)
        return gradients.finish(hidden.dtype, bias, backend)
    # Under vocabulary parallelism every row is computed: the ranks' chunks must match.
    row_order = None if shard is not None or n_rows == 0 else _rows_with_gradient(backend, row_grads)
    gradients = _Gradients(hidden, vocab_size, grads, chunk, _cdiv(n_rows, chunk), row_order, shard)
    gradients.sparse_terms = sparse_terms
    if shard is not None:
        targets = shard.local_targets(targets, vocab_size)
    if n_rows > 0:
        buffer = backend.new_buffer(min(chunk, n_rows), vocab_size, hidden.dtype, hidden.device)
        for start, end in _spans(n_rows, chunk, row_order, _first_chunk_rows(n_rows, chunk, row_order, True)):
            hidden_c, targets_c, lse_c, loss_grad_c, lse_grad_c, smooth_grad_c, entropy_grad_c = (
                _chunk_of(t, row_order, start, end)
                for t in (hidden, targets, lse, loss_grad, lse_grad, smooth_grad, entropy_grad))
            grad_logits = backend.grad_logits(
                hidden_c, weight, bias, targets_c, lse_c, loss_grad_c, lse_grad_c, opts, buffer[: end - start],
                gradients.bias_acc, local_class_weight, smooth_grad_c, entropy_grad_c,
            )
            gradients.add(start, end, hidden_c, grad_logits, weight)
    return gradients.finish(hidden.dtype, bias, backend)
