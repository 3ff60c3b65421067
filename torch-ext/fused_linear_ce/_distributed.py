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

Ranks whose arguments disagree would pair up collectives of other sizes, or of the same sizes
for other rows, and get a wrong loss, NaN, an abort or a hang. ``check_ranks_agree`` compares
them first, with one all-reduce of a few int64 per rank, and raises the same error on every
rank.
"""

import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

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


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_REDUCTIONS = ("mean", "sum", "none")
_SAME_ON_EVERY_RANK = ("Vocabulary parallelism (process_group=, or a weight DTensor placed Shard(0)) needs the same "
                       "hidden, targets and options on every rank, and weight slices that tile the vocabulary.")
_DATA_PARALLEL_HINT = (" Under data parallelism (each rank its own batch) pass the whole weight and no "
                       "process_group; with FSDP2, compute the loss where the module's forward gathers the weight "
                       "(patch_forward does).")


def _float_bits(value: float) -> int:
    """The float64 bits of ``value`` as an int: equal for bitwise equal floats only."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class _Field:
    """A quantity of one call: its name, its int64 values on this rank (host ints, or a tensor
    on the device), how to show a rank's values in an error, and whether all ranks must agree."""

    name: str
    values: list[int] | Tensor
    show: Callable[[list[int]], str] = lambda v: str(v[0])
    same_on_every_rank: bool = True

    @property
    def width(self) -> int:
        return len(self.values) if isinstance(self.values, list) else self.values.numel()


def _weighted_sums(values: Tensor) -> Tensor:
    """[2] int64: the sum and the position-weighted sum (weights 1, 2, ...) of ``values`` [n]
    int64, exact (wrapping) in int64: a changed value changes the first, a shift or a swap the second."""
    positions = torch.arange(1, values.numel() + 1, device=values.device)
    return torch.stack([values.sum(), (values * positions).sum()])


def _target_range(targets: Tensor, ignore_index: int) -> Tensor:
    """[2] int64: the smallest and the largest of the targets, ``ignore_index`` counted as 0 (a
    class of any vocabulary): both in [0, V) if and only if every target is."""
    if targets.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=targets.device)
    return torch.stack(torch.aminmax(torch.where(targets != ignore_index, targets, 0)))


def _class_weight_fields(class_weight, device: torch.device) -> list[_Field]:
    """Whether class_weight is None (0), a float tensor on ``device`` (1), one that requires grad
    (2) or anything else (3) (both refused after the check, on every rank), its size, and a
    fingerprint of its float64 bits."""
    usable = isinstance(class_weight, Tensor) and class_weight.is_floating_point() and class_weight.device == device
    if class_weight is None or not usable:
        state = 0 if class_weight is None else 3
        size, values = 0, torch.zeros(2, dtype=torch.int64, device=device)
    else:
        state = 2 if class_weight.requires_grad and torch.is_grad_enabled() else 1
        size = class_weight.numel()
        values = _weighted_sums(class_weight.detach().reshape(-1).to(torch.float64).view(torch.int64))
    kinds = ("None", "a float tensor of {} values", "a float tensor of {} values that requires grad",
             "no float tensor on hidden's device")
    return [_Field("class_weight", [state, size], lambda v: kinds[v[0]].format(v[1])),
            _Field("class_weight's values", values, lambda v: f"fingerprint (sum, weighted sum of bits) {tuple(v)}")]


def _to_device(values: list[int], device: torch.device) -> Tensor:
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":  # from pinned memory: the host does not wait for the GPU here
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _show_float(v: list[int]) -> str:
    return str(_bits_float(v[0]))


def _show_grad(v: list[int]) -> str:
    enabled, *needs = v
    wanted = [name for name, need in zip(("hidden", "weight", "bias"), needs, strict=True) if need]
    return f"grad {'enabled' if enabled else 'disabled'} with gradients for {', '.join(wanted) or 'no input'}"


def check_ranks_agree(group: dist.ProcessGroup, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                      class_weight, vocab_start: int | None, options: dict) -> tuple[int, int]:
    """Raises the same ValueError on every rank of ``group`` unless all agree on N, H, hidden's
    dtype, ``options`` (ignore_index, logit_scale, softcap, reduction, return_metrics,
    return_lse, label_smoothing, z_loss_scale, shift), the targets, class_weight, the bias's
    presence and which inputs take gradients, and their slices [vocab_start, + local V) tile
    the vocabulary; or when a target is out of range. Returns (this rank's vocab_start, total V);
    ``vocab_start`` None takes the slices in rank order. ``targets`` [N] are the loss's (shifted).

    One all-reduce of a few int64 per rank, before any other collective of the call (ranks that
    disagree must not reach those), and one host sync to read it."""
    device = weight.device
    flat_targets = targets.reshape(-1).to(torch.int64)
    grad = torch.is_grad_enabled()
    ignore_index, softcap = options["ignore_index"], options["softcap"]
    host_fields = [
        _Field("the number of rows N", [flat_targets.numel()]),
        _Field("the hidden size H", [hidden.shape[-1]]),
        _Field("hidden's dtype", [_DTYPES.index(hidden.dtype)], lambda v: str(_DTYPES[v[0]])),
        _Field("ignore_index", [ignore_index]),
        _Field("logit_scale", [_float_bits(options["logit_scale"])], _show_float),
        _Field("softcap", [softcap is not None, _float_bits(softcap or 0.0)],
               lambda v: str(_bits_float(v[1])) if v[0] else "None"),
        _Field("reduction", [_REDUCTIONS.index(options["reduction"])], lambda v: repr(_REDUCTIONS[v[0]])),
        _Field("return_metrics", [options["return_metrics"]], lambda v: str(bool(v[0]))),
        _Field("return_lse", [options["return_lse"]], lambda v: str(bool(v[0]))),
        _Field("label_smoothing", [_float_bits(options["label_smoothing"])], _show_float),
        _Field("z_loss_scale", [_float_bits(options["z_loss_scale"])], _show_float),
        _Field("shift", [options["shift"]]),
        _Field("bias", [bias is not None], lambda v: "a bias" if v[0] else "no bias"),
        _Field("gradients", [grad, *(grad and t is not None and t.requires_grad for t in (hidden, weight, bias))],
               _show_grad),
        _Field("slice", [vocab_start is not None, int(vocab_start or 0), weight.shape[0]], same_on_every_rank=False),
    ]
    cw_host, cw_values = _class_weight_fields(class_weight, device)
    host_fields.append(cw_host)
    device_fields = [
        _Field("targets", _weighted_sums(flat_targets),
               lambda v: f"fingerprint (sum, position-weighted sum) {tuple(v)}"),
        cw_values,
        _Field("targets' range", _target_range(flat_targets, ignore_index), same_on_every_rank=False),
    ]
    mine = torch.cat([_to_device([int(x) for f in host_fields for x in f.values], device),
                      *(f.values for f in device_fields)])
    # an all-gather as one all-reduce (exact in int64): each rank fills its row of zeros
    table = torch.zeros(dist.get_world_size(group), mine.numel(), dtype=torch.int64, device=device)
    table[dist.get_rank(group)] = mine
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    table = table.tolist()  # [ranks, values]: the one host sync

    fields = host_fields + device_fields  # in the order of the gathered values
    ranks = []
    for row in table:
        ranks.append({})
        for f in fields:
            ranks[-1][f.name], row = row[:f.width], row[f.width:]
    problems = []
    for f in fields:
        if f.same_on_every_rank and any(r[f.name] != ranks[0][f.name] for r in ranks):
            shown = ", ".join(f"rank {i} has {f.show(r[f.name])}" for i, r in enumerate(ranks))
            problems.append(f"ranks disagree on {f.name}: {shown}")
    starts, total = _tiling([r["slice"] for r in ranks], problems)
    if problems:
        hint = _DATA_PARALLEL_HINT if any(r["targets"] != ranks[0]["targets"] for r in ranks) else ""
        raise ValueError("; ".join(problems) + ". " + _SAME_ON_EVERY_RANK + hint)
    lowest = min(r["targets' range"][0] for r in ranks)
    highest = max(r["targets' range"][1] for r in ranks)
    if lowest < 0 or highest >= total:
        raise ValueError(f"targets must be in [0, {total}) or ignore_index={ignore_index}, "
                         f"found {lowest if lowest < 0 else highest}")
    return starts[dist.get_rank(group)], total


def _tiling(slices: list[list[int]], problems: list[str]) -> tuple[list[int], int]:
    """Every rank's vocab_start (given, else in rank order) and the total V, from each rank's
    (vocab_start given, vocab_start, local V); adds a problem unless the slices tile
    [0, total V) without gap or overlap."""
    sizes = [size for _, _, size in slices]
    starts = [start if given else sum(sizes[:i]) for i, (given, start, _) in enumerate(slices)]
    total, end = sum(sizes), 0
    for start, size in sorted(zip(starts, sizes, strict=True)):
        if start != end:
            break
        end = start + size
    if end != total:
        held = ", ".join(f"rank {i} holds [{s}, {s + n})" for i, (s, n) in enumerate(zip(starts, sizes, strict=True)))
        problems.append(f"vocabulary slices overlap or leave a gap: {held}; they must tile [0, {total}) "
                        "(each rank's weight rows from its vocab_start)")
    return starts, total
