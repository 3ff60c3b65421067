"""The order in which the chunk loops take the rows: those with a loss (or a gradient) first.

Rows whose target is ``ignore_index`` carry no loss, gradient or metric: a stable partition puts
the others first, so that the chunks stop at their count instead of computing and masking the
ignored rows (one host read of the count, after the first chunk's work is queued). Whether a call
orders its rows at all is the plan's (``_plan``); this module carries the order out.
"""

import torch


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

class RowOrder:
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

def chunk_of(t: torch.Tensor | None, row_order: RowOrder | None, start: int, end: int) -> torch.Tensor | None:
    """Rows [start, end) of the computed rows of ``t`` [N, ...] (None for None): in place, or in
    ``row_order``'s order."""
    if t is None:
        return None
    return t[start:end] if row_order is None else row_order.take(t, start, end)


def gradient_mask(row_grads: list[torch.Tensor | None]) -> torch.Tensor:
    """bool [N]: the rows where any of ``row_grads`` (per-row upstream gradients [N], or None) is
    not 0, those whose grad logits are not all exactly 0."""
    row_grads = [g for g in row_grads if g is not None]
    has_gradient = row_grads[0] != 0
    for g in row_grads[1:]:
        has_gradient |= g != 0
    return has_gradient


def rows_with_gradient(backend, row_grads: list[torch.Tensor | None]) -> RowOrder:
    """For a recomputing backward: a ``RowOrder`` of the rows where any of ``row_grads`` (per-row
    upstream gradients [N], or None) is not 0. A row whose upstream gradients are all 0 has grad
    logits exactly 0 (ignored targets; in RL, tokens of a group whose rewards are all equal, hence
    advantages 0), so it is left out of the 8 N V H flops and gets a zero grad_hidden."""
    has_gradient = gradient_mask(row_grads)
    # The order kernel puts the rows whose "target" is not ignore_index (here 0) first; "mean" as
    # the forwards' (its d loss / d loss_i go unused): the specialisation their first call compiles.
    return RowOrder(backend, has_gradient.long(), 0, True)
