"""Kept rows: a per-token forward keeps, for as many rows as a memory budget allows, what its
backward makes their grad logits from, so that those rows skip the recomputed logit product.

The per-token outputs (``fused_linear_log_probs``) take any upstream gradient, known only in the
backward. A row recomputed there costs 2 N V H flops in the forward's sweep, 2 more to recompute
its logits and 4 for the two products: 8 in all. A kept row skips the recompute: 6, as the loss's
training step. Its forward sweep also stores the row's logits in the buffer's form of the
training step (``row_stats`` with a buffer): on the Triton backend ``z - tile_max`` in the
inputs' dtype, or, where the training step factors its gradient (bf16 and fp32 without bias or
softcap), the factored sweep's exponentials exp(z - r) against the rows' references, which leave
the statistics (and so every output) as they are without a buffer; on the PyTorch backend the
fp32 exponentials. The backward turns them into grad logits in place (``grad_from_kept``, one pass
over the kept rows) and adds the two products; where the upstream reaches the log-probs alone (no
entropy gradient) the factored exponentials go to the products as they are, diag(r) E' as the
training step's (``row_factors`` sets each row's target entry), with no pass. The other rows with a
gradient are recomputed. A
kept row whose upstream gradients are all 0 (GRPO's tokens of advantage 0 without an entropy
bonus) gives grad logits exactly 0, so the backward may take it or leave it out; which it does is
the plan's (``_plan.kept_rows_whole``), from what the last kept backward of the same outputs found
(``SPECULATION``). Where every row the forward computed had a gradient (GRPO with an entropy bonus,
DPO, KTO, RLOO, DFT), it takes every part whole and recomputes the computed rows past them: the
forward knows their count, so the backward queues its work with no host read. Otherwise it counts
the rows with a gradient first (one host read, ``first_order``) and moves each part's rows with one
up in place, as the recompute leaves the others out.
A sparse top-k loss's forward (``_sparse_step``) sweeps its chunks as kept parts (``sweep_part``) and
turns each into grad logits at once, its upstream being known there.

The bound. With u the unit roundoff of the stored dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32: the
16-bit ones as the training step's buffer), g_i = d out / d log_probs_i, e_i = d out / d H_i,
p = softmax(z_i), s_ij = (row max) - z_ij >= 0, and the kept grad logits G~ against the exact G
(the recompute's, before its own rounding to the inputs' dtype) of d out / d z:

    |G~_ij - G_ij| <= u |G_ij| + 2 u p_ij (1 + s_ij) (|g_i| + |e_i| (2 + |log p_ij + H_i|)),

times d z / d u (logit scale, softcap derivative) for the raw logits, plus, with a softcap c,
2 u s_ij |G_ij| / c for the derivative taken at the stored logit. The first term is the 16-bit
rounding of G that the recompute and the training step pay too; the second is the stored value's
own rounding, relative u in p for the exponentials (s_ij counts only for ``z - tile_max``, whose
rounding is u s_ij absolute in log p). Summed over a row it is at most 2 u (|g_i| + |e_i| (2 + 2
log V)) (1 + H_i + lse_i - max_j z_ij), so grad_hidden's and grad_weight's error is that of the
training step's 16-bit buffer (tests/api/test_log_probs.py checks it against float64). fp32
inputs keep fp32 (u = 2^-24); fp64 inputs (gradcheck) keep nothing, always recomputed.

The budget (``budget``): by default a call keeps no more than lets its peak stay at or under
the peak of TRL's own head (``trl.kernels.ChunkedLogProbFunction``, as ``add_fused_lm_head``
calls it) at the same shape. That head accumulates its gradient products in fp32 (its
documentation), then returns them in the inputs' dtype, and its projection runs on tiles of
4096 rows x 32768 columns (the glue's ``chunk_size``; the rows as observed through PyTorch's
dispatch on a CPU) in the inputs' dtype:

    trl_peak = (V + N) H (4 + e) + min(N, 4096) min(V, 32768) e      (e: element size, 0 for fp32)

which stays just under TRL's measured peaks (docs/design.md, "Kept rows"). Ours is the
gradients, (V + N) H e, plus the larger of the kept rows (per row its ``kept_row_bytes`` and the
products' gathered rows, 2 H e) and a recomputed chunk (``_plan.chunk_bytes``), never both: the
backward releases each kept part's buffer once its products are queued, and recomputes the other
rows after the last part (``backward``). MARGIN_BYTES stay free for the rest.
``keep_mib`` (FLCE_KEEP_MIB) sets the budget instead, 0 turns it off.

Not under vocabulary parallelism: the per-token outputs have no vocabulary-parallel form (their
function takes no process group), so there are no sharded rows to keep. Not while traced
(torch.compile: the operator's outputs are fixed tensors, and kept rows are a per-call variable
set of them) or while a CUDA graph is captured: those calls recompute, as without a budget.
"""

from dataclasses import dataclass, field

import torch

from . import _plan
from ._row_order import chunk_of, copy_to_host, gradient_mask

# TRL's head's projection tile (see the module docstring): rows, and the glue's chunk_size columns.
TRL_TILE_ROWS = 4096
TRL_TILE_COLUMNS = 32768
# Left free of kept rows under TRL's peak: the step's tensors that the budget does not count one by
# one (per-row vectors, the backward's row order, the products' fp32 blocks), a few MiB each.
MARGIN_BYTES = 64 * 2**20
# What the last kept backward of each outputs key found: whether every row its forward computed had a
# gradient (``_plan.kept_rows_whole`` reads it).
SPECULATION = _plan.Speculation()


def trl_peak_bytes(n_rows: int, vocab_size: int, hidden_size: int, element_size: int) -> int:
    """Bytes of TRL's own head's peak over its inputs for a step of ``n_rows`` rows (module docstring)."""
    result_bytes = element_size if element_size < 4 else 0  # fp32 accumulators are fp32 inputs' results
    tile = min(n_rows, TRL_TILE_ROWS) * min(vocab_size, TRL_TILE_COLUMNS) * element_size
    return (vocab_size + n_rows) * hidden_size * (4 + result_bytes) + tile


def budget(n_rows: int, vocab_size: int, hidden_size: int, dtype: torch.dtype, keep_mib: int | None = None) -> int:
    """Bytes the kept rows may take: ``keep_mib`` where set (the plan's), else what keeps the call's
    peak at or under TRL's head's (module docstring); a recomputed chunk never lives beside them."""
    if keep_mib is not None:
        return keep_mib * 2**20
    element_size = torch.finfo(dtype).bits // 8
    our_grads = (vocab_size + n_rows) * hidden_size * element_size
    return max(0, trl_peak_bytes(n_rows, vocab_size, hidden_size, element_size) - our_grads - MARGIN_BYTES)


@dataclass
class KeptPart:
    """Rows [start, end) of the forward's computed order, kept: the buffer [rows, V] that the
    sweep stored into, its state, and the rows' references where the buffer holds exponentials."""

    start: int
    end: int
    buffer: torch.Tensor
    state: object
    row_ref: torch.Tensor | None
    row_max: torch.Tensor | None = None  # [rows] the logits' max, beside the references


@dataclass
class KeptRows:
    """What a per-token forward kept: its first ``count`` computed rows, in parts. ``rows`` [count]
    int64 are their indices (None: rows [0, count) in place); ``order`` [N] int64 is the forward's
    order, whose first ``computed`` rows it computed (None: rows [0, computed) in place). Used once:
    ``grad_from_kept`` turns the buffers into grad logits in place."""

    row_bytes: int  # a kept row's bytes, as the budget counts them
    room: int  # ``budget``
    cap: int | None = None  # rows kept at most (the plan's ``keep_rows``)
    parts: list[KeptPart] = field(default_factory=list)
    count: int = 0
    rows: torch.Tensor | None = None
    computed: int = 0
    order: torch.Tensor | None = None

    @classmethod
    def for_call(cls, backend, n_rows: int, vocab_size: int, hidden_size: int, dtype: torch.dtype, has_softcap: bool,
                 keep_mib: int | None = None, keep_rows: int | None = None) -> "KeptRows":
        """None kept yet of a call's rows: its ``budget`` (the plan's ``keep_mib``), its cap and the bytes
        of a kept row (the backend's buffer row and state, and the hidden and grad_hidden rows that its
        products gather: 2 H e)."""
        element_size = torch.finfo(dtype).bits // 8
        row_bytes = backend.kept_row_bytes(vocab_size, dtype, has_softcap) + 2 * hidden_size * element_size
        return cls(row_bytes, budget(n_rows, vocab_size, hidden_size, dtype, keep_mib), keep_rows)

    def rows_to_keep(self, rows_with_target: int) -> int:
        """Rows kept among ``rows_with_target`` (the count, or before it is known the rows of the
        call): as many as the budget holds, at most the cap."""
        kept = min(rows_with_target, self.room // self.row_bytes)
        return kept if self.cap is None else min(kept, self.cap)

    def trim(self, count: int) -> None:
        """Keeps only the first ``count`` rows (those with a target): their products are not paid for
        the others (the buffers' memory stays until the backward)."""
        self.parts = [_first_rows(part, count) for part in self.parts if part.start < count]
        self.count = min(self.count, count)


def _first_rows(part: KeptPart, count: int) -> KeptPart:
    """``part`` cut at position ``count`` of the order: its buffer, state and references' first rows."""
    if part.end <= count:
        return part
    rows = count - part.start
    cut = [x[:rows] if isinstance(x, torch.Tensor) else x for x in part.state]
    state = type(part.state)(*cut) if hasattr(part.state, "_fields") else tuple(cut)
    return KeptPart(part.start, count, part.buffer[:rows], state, None if part.row_ref is None else part.row_ref[:rows],
                    None if part.row_max is None else part.row_max[:rows])


def first_order(kept: KeptRows, has_gradient: torch.Tensor):
    """(order int64 [N], counts) for a backward with kept rows, ``has_gradient`` bool [N] the rows
    with a gradient: each kept part's rows with a gradient (in the forward's order, ascending as the
    rows with a target are), then the other rows with a gradient (recomputed), then the rest
    (grad_hidden 0); ``counts`` (one host read) the rows of each part's group, then the recomputed
    rows'."""
    n_parts = len(kept.parts)
    group = torch.where(has_gradient, n_parts, n_parts + 1).to(torch.int32)
    for p, part in enumerate(kept.parts):
        rows = part_rows(kept, part)
        if isinstance(rows, slice):
            group[rows] = torch.where(has_gradient[rows], p, n_parts + 1).to(torch.int32)
        else:
            group.index_copy_(0, rows, torch.where(has_gradient[rows], p, n_parts + 1).to(torch.int32))
    order = torch.argsort(group, stable=True)
    counts = torch.bincount(group, minlength=n_parts + 2)[: n_parts + 1].tolist()
    return order, counts


def part_rows(kept: KeptRows, part: KeptPart):
    """The rows of ``part`` (their indices, or a slice where the kept rows are in place)."""
    return slice(part.start, part.end) if kept.rows is None else kept.rows[part.start: part.end]


def _compact_rows_(t: torch.Tensor, rows: torch.Tensor, block: int = 256) -> torch.Tensor:
    """t[:k] = t[rows] in place (rows [k] ascending), a block of ``block`` rows at a time: row i's
    source rows[i] >= i, so a block reads no row that an earlier block wrote, and its gathered copy
    is the only temporary. Returns t[:k]."""
    for start in range(0, rows.shape[0], block):
        picked = rows[start: start + block]
        t[start: start + picked.shape[0]] = t.index_select(0, picked)
    return t[: rows.shape[0]]


def _rows_with_gradient(part: KeptPart, local: torch.Tensor) -> KeptPart:
    """``part`` with only its rows ``local`` (ascending indices into it), moved to its first rows in
    place: the buffer, the state's per-row tensors and the references."""
    n_rows = part.end - part.start

    def compacted(t):
        return _compact_rows_(t, local) if isinstance(t, torch.Tensor) and t.shape[0] == n_rows else t

    state = [compacted(x) for x in part.state]
    state = type(part.state)(*state) if hasattr(part.state, "_fields") else tuple(state)
    return KeptPart(part.start, part.start + local.shape[0], compacted(part.buffer), state, compacted(part.row_ref),
                    compacted(part.row_max))


def sweep_part(step, start: int, end: int, hidden_c, targets_c, buffer) -> KeptPart:
    """Rows [start, end) of a forward's computed order (``_chunked._ForwardStep``), their hidden rows
    ``hidden_c`` and targets ``targets_c``, swept into ``buffer`` [rows, V] in the training step's
    buffer form, and their results finished: the factored sweep's exponentials where the step takes
    row references (as its statistics without a buffer then are: the same outputs; that sweep has
    no room for the logit sum or the squares), else ``z - tile_max`` (the PyTorch backend's
    exponentials against the row max). Returns the part, for ``grad_from_kept``."""
    backend, opts = step.backend, step.opts
    exponentials = step.referenced and not (step.logit_sum or step.sum_sq)
    reference = step.reference_of(start, end)
    if reference is None and step.referenced:
        reference = backend.row_reference(hidden_c, step.weight, targets_c, opts)
    row_ref = reference[0] if exponentials else None
    target_logit = (reference[1] if reference is not None
                    else None if step.target_logits is None else step.target_logits[start:end])
    has_target = (targets_c != opts.ignore_index).float()  # (the exponentials' rows kept at all)
    stats, state = backend.row_stats(
        hidden_c, step.weight, step.bias, targets_c, opts, buffer, row_ref=row_ref, loss_grad=has_target,
        class_weight=step.local_class_weight, target_logit=target_logit, return_metrics=step.return_metrics,
        logit_sum=step.logit_sum, sum_sq=step.sum_sq)
    step.finish(stats, start, end)
    return KeptPart(start, end, buffer, state, row_ref, None if row_ref is None else stats.row_max)


def forward_chunks(step) -> "KeptRows":
    """The chunks of a per-token forward (``_chunked._ForwardStep``) whose backward will want
    gradients: as ``_chunked._statistics_chunks``, but its first rows, as many as ``budget``
    allows, are swept into buffers (``sweep_part``) that the backward makes their grad logits from;
    a chunk that the budget cuts is swept in two."""
    backend, opts, hidden = step.backend, step.opts, step.hidden
    n_rows, hidden_size = hidden.shape
    kept = KeptRows.for_call(backend, n_rows, step.vocab_size, hidden_size, hidden.dtype, opts.has_softcap,
                             step.plan.keep_mib, step.plan.keep_rows)
    keep = kept.rows_to_keep(n_rows)  # before the count is known: as many as if every row had a target
    for start, end, hidden_c, targets_c, _, _ in step.chunks():
        if start > 0 and step.row_order is not None:
            keep = max(keep, kept.rows_to_keep(step.row_order.rows_to_compute()))
        cut = min(max(keep, start), end)
        if cut > start:
            rows = slice(0, cut - start)
            buffer = backend.new_buffer(cut - start, step.vocab_size, hidden.dtype, hidden.device)
            kept.parts.append(sweep_part(step, start, cut, hidden_c[rows], targets_c[rows], buffer))
            kept.count = cut
        if cut < end:
            rest = slice(cut - start, end - start)
            stats, _, _ = step.row_stats(cut, end, hidden_c[rest], targets_c[rest], None, None)
            step.finish(stats, cut, end)
    row_order = step.row_order
    kept.computed = n_rows
    if row_order is not None:
        kept.computed = row_order.rows_to_compute()
        # A first chunk planned before the count was known may end in rows without a target: not kept.
        kept.trim(kept.computed)
        if kept.computed > row_order.in_place:  # (some rows without a target: the order is no identity)
            kept.order = row_order.order
            kept.rows = row_order.order[: kept.count]
    return kept


class KeptOrder:
    """A kept backward's row order, as ``_row_order.RowOrder`` serves the chunk loop: positions
    [0, kept) are the kept rows it takes, part after part (``part_rows`` of each), [kept, total)
    the rows it recomputes, the rest none (grad_hidden 0). ``order`` int64 [N] (None: the
    identity, ``in_place`` = N); ``has_gradient`` bool [N] where a part's rows without a gradient
    are left out (None: every part whole). Made by ``with_gradient`` or ``whole``."""

    def __init__(self, order, part_rows: list[int], total: int, n_rows: int, in_place: int, has_gradient=None):
        self.order, self.part_rows, self.has_gradient = order, part_rows, has_gradient
        self.kept, self.total, self.n_rows, self.in_place = sum(part_rows), total, n_rows, in_place

    @classmethod
    def with_gradient(cls, kept: "KeptRows", n_rows: int, has_gradient: torch.Tensor) -> "KeptOrder":
        """The rows with a gradient (``has_gradient`` bool [N]), the kept ones first (``first_order``:
        one host read)."""
        order, counts = first_order(kept, has_gradient)
        total = sum(counts)
        # rows [0, kept.count) in place, each with a gradient: the order begins as the identity
        identity = kept.rows is None and sum(counts[:-1]) == kept.count
        in_place = 0 if not identity else n_rows if total == n_rows else kept.count
        return cls(order, counts[:-1], total, n_rows, in_place, has_gradient)

    @classmethod
    def whole(cls, kept: "KeptRows", n_rows: int) -> "KeptOrder":
        """Every row the forward computed, in its order: the kept parts whole, then the rows past
        them; nothing read on the host."""
        return cls(kept.order, [part.end - part.start for part in kept.parts], kept.computed, n_rows,
                   n_rows if kept.order is None else 0)

    def take(self, t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the order, of ``t`` [N, ...]."""
        return t[start:end] if end <= self.in_place else t.index_select(0, self.order[start:end])

    def rows_to_compute(self) -> int:
        """Positions of the order computed, kept or recomputed."""
        return self.total

    def chunks(self, chunk: int) -> int:
        """The chunks of the backward: the kept parts taken, and chunks of at most ``chunk``
        recomputed rows."""
        return sum(1 for rows in self.part_rows if rows) + -(-(self.total - self.kept) // chunk)


def backward_order(kept: "KeptRows", n_rows: int, row_grads: list, whole: bool, key: str) -> KeptOrder:
    """The row order of a kept backward whose per-row upstream gradients are ``row_grads`` [N] (or
    None): with ``whole`` (``_plan.kept_rows_whole``) every row the forward computed, and its
    verdict for the next kept backward of ``key`` (did each of those rows have a gradient?)
    queued on the device; else the rows with a gradient, counted on the host, whose counts give
    the verdict (``SPECULATION``)."""
    has_gradient = gradient_mask(row_grads)
    if whole:
        SPECULATION.recheck(key, copy_to_host(_every_computed_row(kept, has_gradient)))
        return KeptOrder.whole(kept, n_rows)
    row_order = KeptOrder.with_gradient(kept, n_rows, has_gradient)
    # (rows without a target have no gradient: every computed row has one where their counts agree)
    SPECULATION.found(key, row_order.total == kept.computed)
    return row_order


def _every_computed_row(kept: "KeptRows", has_gradient: torch.Tensor) -> torch.Tensor:
    """[1] fp32: 1 where every row the forward computed has a gradient (``has_gradient`` bool [N]), else 0."""
    computed = (has_gradient[: kept.computed] if kept.order is None
                else has_gradient.index_select(0, kept.order[: kept.computed]))
    return computed.all().float().reshape(1)


def _kept_grads(kept: "KeptRows", backend, row_order: KeptOrder, gradients, hidden, weight, per_row: tuple,
                opts) -> None:
    """The kept rows' share of a backward: each kept part's rows that ``row_order`` takes (moved to
    its first rows where it leaves others out), their grad logits from the buffer (in place,
    ``grad_from_kept``) and the two products; the parts' buffers are released as they are used."""
    position = 0
    for rows_with_gradient in row_order.part_rows:
        part = kept.parts.pop(0)
        if 0 < rows_with_gradient < part.end - part.start:
            local = torch.nonzero(row_order.has_gradient[part_rows(kept, part)])[:, 0]
            part = _rows_with_gradient(part, local)
        if rows_with_gradient:
            end = position + rows_with_gradient
            hidden_c, targets_c, lse_c, loss_grad_c, lse_grad_c, entropy_grad_c = (
                chunk_of(t, row_order, position, end) for t in (hidden, *per_row))
            if part.row_max is not None and lse_grad_c is None and entropy_grad_c is None:
                # log-probs alone: G = diag(r) E' with the target entries set in E' (one a row), as
                # the training step's, so the products take the buffer as it is (no pass over it)
                row_factor, _ = backend.row_factors(part.buffer, part.state, part.row_max, part.row_ref, lse_c,
                                                    loss_grad_c, targets_c, opts)
                gradients.add(position, end, hidden_c, part.buffer, weight, row_factor, backend)
            else:
                grad_logits = backend.grad_from_kept(part.buffer, part.state, part.row_ref, targets_c, lse_c,
                                                     loss_grad_c, lse_grad_c, entropy_grad_c, opts, gradients.bias_acc)
                gradients.add(position, end, hidden_c, grad_logits, weight)
            part = grad_logits = None
            position = end


def _recomputed_rows(backend, row_order: KeptOrder, start: int, gradients, chunk: int, hidden, weight, bias,
                     opts, per_row: tuple, class_weight) -> None:
    """The rows after the kept ones, positions [start, count) of ``row_order``, by recomputation, in
    chunks of at most ``chunk`` rows."""
    rest = row_order.rows_to_compute() - start
    if rest <= 0:
        return
    buffer = backend.new_buffer(min(chunk, rest), weight.shape[0], hidden.dtype, hidden.device)
    for first, last in _plan.spans(rest, chunk, None, min(chunk, rest)):
        hidden_c, targets_c, lse_c, loss_grad_c, lse_grad_c, smooth_grad_c, entropy_grad_c = (
            chunk_of(t, row_order, start + first, start + last) for t in (hidden, *per_row))
        grad_logits = backend.grad_logits(
            hidden_c, weight, bias, targets_c, lse_c, loss_grad_c, lse_grad_c, opts, buffer[: last - first],
            gradients.bias_acc, class_weight, smooth_grad_c, entropy_grad_c,
        )
        gradients.add(start + first, start + last, hidden_c, grad_logits, weight)


def backward(kept: KeptRows, backend, row_order: KeptOrder, gradients, chunk: int, hidden, weight, bias, opts,
             per_row: tuple, class_weight) -> None:
    """A per-token backward with kept rows (``_chunked.backward``): the kept rows from their buffers,
    then the other rows with a gradient by recomputation, into ``gradients`` (``_gradients.Gradients``);
    ``per_row``: (targets, lse, loss_grad, lse_grad, smooth_grad, entropy_grad) [N], None where absent."""
    targets, lse, loss_grad, lse_grad, _, entropy_grad = per_row
    _kept_grads(kept, backend, row_order, gradients, hidden, weight, (targets, lse, loss_grad, lse_grad, entropy_grad),
                opts)
    _recomputed_rows(backend, row_order, row_order.kept, gradients, chunk, hidden, weight, bias, opts, per_row,
                     class_weight)
