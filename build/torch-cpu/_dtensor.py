"""DTensor inputs: a weight sharded by rows over a 1-D device mesh is vocabulary parallelism.

``weight`` (and ``bias``) placed ``Shard(0)`` on a 1-D mesh hold, on the rank at mesh
coordinate r, the rows [r * ceil(V / P), ...) of the vocabulary (torch.chunk's split: the last
ranks may hold fewer). That is the ``process_group=`` path of ``_distributed`` over the mesh's
group, with ``vocab_start`` from the coordinate, and ``hidden`` and ``targets`` the same on
every rank: plain tensors, or DTensors placed ``Replicate()`` on that mesh. The local tensors
take the plain path; ``DTensor.to_local`` carries the gradients back as DTensors of the inputs'
placements (weight.grad sharded by rows, hidden.grad replicated). The outputs are plain
tensors, or ``Replicate()`` DTensors when ``hidden`` is a DTensor. Whether the ranks hold the
same targets is checked there (``_distributed.check_ranks_agree``) whenever the targets' range is.
"""

import torch
from torch import Tensor

from ._distributed import remember_layout

SUPPORTED = (
    "DTensor inputs are supported as vocabulary parallelism: weight (and bias) placed (Shard(0),) on a "
    "1-D device mesh, hidden and targets the same on every rank (plain tensors, or DTensors placed "
    "(Replicate(),) on that mesh); redistribute other layouts first, or pass local tensors with "
    "process_group="
)


def _dtensor_module():
    # A DTensor exists only once torch.distributed.tensor is imported (which sets it on its
    # package): no import (half a second) for plain tensors. Not sys.modules: torch.compile would
    # trace that as a dict of every module, guard on it, and fail when an import grows it meanwhile.
    return getattr(torch.distributed, "tensor", None)


def has_dtensor(*tensors) -> bool:
    """Whether any of ``tensors`` is a DTensor."""
    module = _dtensor_module()
    return module is not None and any(isinstance(t, module.DTensor) for t in tensors)


def _rows_layout(weight) -> tuple[int, int]:
    """(vocab_start, local V) of this rank under torch.chunk's split of weight's V rows."""
    mesh = weight.device_mesh
    vocab_size, ranks = weight.shape[0], mesh.size()
    rows_per_rank = -(-vocab_size // ranks)
    if rows_per_rank * (ranks - 1) >= vocab_size:
        raise ValueError(f"weight's {vocab_size} rows over {ranks} ranks leave a rank without rows; "
                         "vocabulary parallelism needs at least one row on every rank")
    start = mesh.get_local_rank() * rows_per_rank
    return start, min(rows_per_rank, vocab_size - start)


def _local(name: str, value, mesh, placement):
    """The local tensor of ``value`` (a DTensor on ``mesh`` placed ``(placement,)``, or a plain
    tensor when ``placement`` is Replicate)."""
    module = _dtensor_module()
    if not isinstance(value, module.DTensor):
        if isinstance(placement, module.Replicate) or value is None:
            return value
        raise TypeError(f"{name} must be a DTensor placed {(placement,)} on weight's mesh, got a "
                        f"{type(value).__name__}. {SUPPORTED}")
    if value.device_mesh != mesh or tuple(value.placements) != (placement,):
        raise ValueError(f"{name} is a DTensor placed {tuple(value.placements)} on {value.device_mesh}; "
                         f"expected {(placement,)} on weight's mesh. {SUPPORTED}")
    return value.to_local()


def dtensor_loss(loss_fn, hidden, weight, targets, bias, *args, process_group=None,
                 vocab_start=None, **kwargs):
    """``loss_fn(hidden, weight, targets, bias, *args, **kwargs)`` (the public function) on the
    local tensors of DTensor inputs, as vocabulary parallelism over weight's mesh."""
    module = _dtensor_module()
    if process_group is not None or vocab_start is not None:
        raise ValueError("process_group and vocab_start come from the DTensor weight's mesh and placement; "
                         "pass neither with DTensor inputs")
    if not isinstance(weight, module.DTensor):
        raise TypeError(f"weight must be a DTensor when hidden, targets or bias is one. {SUPPORTED}")
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (module.Shard(0),):
        raise ValueError(f"weight is a DTensor placed {tuple(weight.placements)} on a {mesh.ndim}-D mesh. "
                         f"{SUPPORTED}")
    start, local_rows = _rows_layout(weight)
    local_weight = weight.to_local()
    assert local_weight.shape[0] == local_rows, "a Shard(0) DTensor's local rows follow torch.chunk's split"
    local_bias = _local("bias", bias, mesh, module.Shard(0))
    local_hidden = _local("hidden", hidden, mesh, module.Replicate())
    local_targets = _local("targets", targets, mesh, module.Replicate())
    group = mesh.get_group()
    remember_layout(group, local_rows, start, weight.shape[0])
    out = loss_fn(local_hidden, local_weight, local_targets, local_bias, *args, process_group=group,
                  vocab_start=start, **kwargs)
    if not isinstance(hidden, module.DTensor):
        return out

    def replicated(t):
        return module.DTensor.from_local(t, mesh, (module.Replicate(),), run_check=False)

    if isinstance(out, Tensor):
        return replicated(out)
    return tuple({k: replicated(v) for k, v in o.items()} if isinstance(o, dict) else replicated(o) for o in out)
