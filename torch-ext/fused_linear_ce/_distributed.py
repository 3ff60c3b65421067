"""Vocabulary parallelism: ``weight`` (and ``bias``) hold one contiguous slice of the
vocabulary's rows on each rank of a torch.distributed group; ``hidden`` and ``targets``
are the same on every rank.

Each rank reduces its slice to per-row statistics (max, sum of exponentials, entropy term,
argmax, target logit, logit sum); two all-reduces per chunk of rows merge them, so every
rank then holds the statistics of the whole vocabulary, hence the same loss and metrics:

    1. MAX over int64 keys packing (row max, argmax) [rows]: the order-preserving integer
       image of the fp32 max in the high 32 bits, 2^32 - 1 - argmax in the low 32 bits, so
       the largest key carries the global max and, among equal maxima, the smallest index
       (PyTorch's tie-break);
    2. SUM of fp32 [rows, 5]: the sum of exponentials and entropy term rescaled to the
       global max, the target logit (from the rank that holds it), the logit sum, and a
       count of ranks that held the target.

(float64 inputs, whose row max has no room for an index in 64 bits, take a MAX of the row
max and a MIN of the indices that reach it instead of step 1: three all-reduces.)

The gradient path also sums grad_hidden [N, H], every rank's ``G_local @ W_local``: one
asynchronous all-reduce per chunk of rows, started as soon as the chunk's product is queued,
so that it runs under the next chunk's work.

Every rank plans its chunks as if it held ceil(V / P) vocabulary rows, with P times the rows
of an unsharded chunk: the same chunks on every rank (the all-reduces pair up), and a buffer
of about the bytes of an unsharded one.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._options import RowStats


@dataclass(frozen=True)
class Shard:
    """This rank's slice [vocab_start, vocab_start + local V) of a vocabulary of ``total_vocab_size``."""

    group: dist.ProcessGroup
    vocab_start: int
    total_vocab_size: int

    def local_targets(self, targets: torch.Tensor, local_vocab_size: int) -> torch.Tensor:
        """Targets as column indices of this slice; -1 (never a column) where elsewhere."""
        inside = (targets >= self.vocab_start) & (targets < self.vocab_start + local_vocab_size)
        return torch.where(inside, targets - self.vocab_start, torch.full_like(targets, -1))

    def merge(self, stats: RowStats) -> RowStats:
        """The statistics of the whole vocabulary from every rank's (two all-reduces)."""
        argmax = stats.argmax if stats.argmax is not None else torch.zeros_like(stats.row_max, dtype=torch.int64)
        if stats.row_max.dtype == torch.float64:
            row_max, global_argmax = self._max_and_first_index(stats.row_max, argmax + self.vocab_start)
        else:
            key = _order_key(stats.row_max, argmax + self.vocab_start)
            dist.all_reduce(key, op=dist.ReduceOp.MAX, group=self.group)
            row_max, global_argmax = _order_key_inverse(key)

        live = stats.row_max > float("-inf")  # a fully masked slice contributes nothing
        weight = torch.where(live, torch.exp(stats.row_max - row_max), torch.zeros_like(row_max))
        gap = torch.where(live, row_max - stats.row_max, torch.zeros_like(row_max))
        entropy = stats.entropy_term if stats.entropy_term is not None else torch.zeros_like(row_max)
        found = ~torch.isnan(stats.target_logit)
        packed = torch.stack([
            weight * stats.sum_exp,
            weight * (entropy + stats.sum_exp * gap),
            torch.where(found, stats.target_logit, torch.zeros_like(row_max)),
            stats.logit_sum if stats.logit_sum is not None else torch.zeros_like(row_max),
            found.to(row_max.dtype),
        ], dim=1)  # [rows, 5]
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self.group)
        target_logit = torch.where(packed[:, 4] > 0, packed[:, 2], torch.full_like(row_max, float("nan")))
        return RowStats(
            row_max=row_max,
            sum_exp=packed[:, 0].contiguous(),
            target_logit=target_logit,
            entropy_term=packed[:, 1].contiguous() if stats.entropy_term is not None else None,
            argmax=global_argmax if stats.argmax is not None else None,
            logit_sum=packed[:, 3].contiguous() if stats.logit_sum is not None else None,
        )

    def _max_and_first_index(self, row_max: torch.Tensor, index: torch.Tensor):
        """The global row max and the smallest global index that reaches it (two all-reduces)."""
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=self.group)
        first = torch.where(row_max == global_max, index, torch.full_like(index, torch.iinfo(torch.int64).max))
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.group)
        return global_max, first

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def planning_vocab_size(self) -> int:
        """The slice size that every rank plans its chunks of rows with: the same on every rank,
        so that all ranks take part in the same per-chunk all-reduces."""
        return -(-self.total_vocab_size // self.world_size)

    def start_all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        """Sum ``tensor`` over the ranks, in place, asynchronously: wait on the returned work
        before reading it. Over NCCL it runs beside the next chunk's kernels."""
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)


_LOW = 2**32


def _order_key(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (fp32 value, then smaller index first)."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the float's value
    return ordered * _LOW + (_LOW - 1 - index)


def _order_key_inverse(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ordered = torch.div(key, _LOW, rounding_mode="floor")
    index = _LOW - 1 - (key - ordered * _LOW)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(torch.int32)
    return bits.view(torch.float32), index


_layouts: dict[tuple, tuple[int, int]] = {}


def vocabulary_layout(group: dist.ProcessGroup, local_vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(this rank's vocab_start, total V) from every rank's slice size, in rank order.

    One all-gather and a host sync the first time for a (group, size); cached after."""
    key = (id(group), dist.get_rank(group), local_vocab_size)
    if key not in _layouts:
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, torch.tensor([local_vocab_size], dtype=torch.int64, device=device), group=group)
        sizes = [int(s) for s in sizes]
        rank = dist.get_rank(group)
        _layouts[key] = (sum(sizes[:rank]), sum(sizes))
    return _layouts[key]


def remember_layout(group: dist.ProcessGroup, local_vocab_size: int, vocab_start: int, total_vocab_size: int) -> None:
    """Records this rank's layout when it is known without communicating (a DTensor's
    placement): ``vocabulary_layout`` then skips its all-gather on every rank alike, where a
    cached size on some ranks only would leave the others waiting in it."""
    _layouts[(id(group), dist.get_rank(group), local_vocab_size)] = (vocab_start, total_vocab_size)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (operators take names, not groups)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)
