"""The gradients' accumulation over the chunks: grad_hidden row blocks, grad_weight's sum (in
the inputs' dtype, in fp32 from the start, or in groups of 16-bit chunks summed in fp32, as the
plan says) and the bias' column sums."""

import torch

from ._options import accumulation_dtype
from ._row_order import chunk_of

# torch.mm(..., out_dtype=) on CUDA: PyTorch >= 2.8 (the aten::mm.dtype overload).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b [M, N] in fp32: 16-bit products accumulate in fp32, and the result stays so
    (rounded to 16 bits only after the row factors), where PyTorch allows it."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32) if _MM_OUT_DTYPE else torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())


_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b for an fp32 ``acc``: 16-bit products accumulate into it in fp32 (on CUDA
    inside the product, with no 16-bit rounding of a @ b; elsewhere through an fp32 product)."""
    if a.is_cuda and a.dtype != torch.float32 and _ADDMM_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += mm_f32(a, b)

class Gradients:
    """grad_hidden [N, H], grad_weight [V, H] and the bias' fp32 column sums, filled chunk by
    chunk of the computed rows (in ``row_order``'s order, or in place when it is None), over
    ``n_chunks`` chunks. A 16-bit grad_weight of several chunks is summed in fp32 from the start
    where ``fp32_from_start`` (the plan's), else in groups of ``group_size`` chunks (None: no
    groups, fp32 and fp64 inputs)."""

    def __init__(self, hidden, vocab_size, grads, n_chunks, row_order, shard, fp32_from_start: bool = False,
                 group_size: int | None = None):
        want_h, want_w, want_b = grads
        self.row_order, self.shard = row_order, shard
        self.hidden = hidden
        # The factored gradient's target entries c of the computed rows (in the order's order),
        # added to grad_weight at its one last rounding (``finish``).
        self.target_grads = []
        self.pending = []  # grad_hidden all-reduces in flight: (work, block, rows it goes to or None)
        self.grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if want_h else None
        self.grad_weight = (_new_weight_grad(vocab_size, hidden.shape[1], hidden, n_chunks > 1 and fp32_from_start,
                                             n_chunks) if want_w else None)
        self.bias_acc = torch.zeros(vocab_size, device=hidden.device,
                                    dtype=accumulation_dtype(hidden.dtype)) if want_b else None
        self.computed = 0
        # Chunks summed in the 16-bit grad_weight since it last restarted; past group_size of
        # them, they go to the fp32 weight_sum (see _add_weight_chunk). None: no groups (fp32, fp64).
        self.group_chunks = 0
        self.group_size = group_size
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
            ids, coef = (chunk_of(t, self.row_order, start, end) for t in self.sparse_terms)
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
            backend.scale_rows(mm_f32(grad_logits, weight), row_factor,
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
            addmm_f32_(self.grad_weight, lhs, rhs)
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


def _new_weight_grad(vocab_size, hidden_size, hidden, fp32: bool, n_chunks):
    """grad_weight [V, H], accumulated over the chunks in the inputs' dtype; in fp32 from the
    start with ``fp32``, so that 16-bit rounding of the running sum does not build up over many
    chunks of a small head (larger heads bound it by groups of chunks: ``Gradients._add_weight_chunk``)."""
    if fp32:
        return torch.zeros((vocab_size, hidden_size), device=hidden.device, dtype=torch.float32)
    new = torch.empty if n_chunks > 0 else torch.zeros  # the first chunk overwrites it
    return new((vocab_size, hidden_size), device=hidden.device, dtype=hidden.dtype)
