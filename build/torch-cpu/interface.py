"""The public function: argument checks, shapes, and the choice of the gradient path."""

import math
import numbers
import operator

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _torch_backend
from ._chunked import backend_for, copy_to_host
from ._distributed import check_ranks_agree, vocabulary_layout
from ._dtensor import dtensor_loss, has_dtensor
from ._ops import FORWARD_AD_ERROR, FunctorchLoss, loss_forward
from ._options import LossOptions, Request, accumulation_dtype
from ._plan import loss_grads_in_forward
from ._settings import current as settings

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_REDUCTIONS = ("mean", "sum", "none")
_INT32 = torch.iinfo(torch.int32)
_INT64 = torch.iinfo(torch.int64)


def _check_inputs(hidden, weight, targets, bias, logit_scale, softcap, reduction, label_smoothing, z_loss_scale):
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape (..., H), got a 0-d tensor")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape (V, H) with H = {hidden.shape[-1]}, got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 (or int32), got {targets.dtype}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])} (hidden's leading dims), "
                         f"got {tuple(targets.shape)}")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)):
        if value is not None and value.is_meta:  # a model built under torch.device("meta"), not yet loaded
            raise ValueError(f"{name} is a meta tensor, which holds no data: materialise it (load the weights, or "
                             f"to_empty() and initialise) before computing a loss")
    for name, value in (("weight", weight), ("targets", targets), ("bias", bias)):
        if value is not None and value.device != hidden.device:
            raise ValueError(f"{name} is on {value.device} but hidden is on {hidden.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not (isinstance(logit_scale, (int, float)) and math.isfinite(logit_scale)):
        raise ValueError(f"logit_scale must be a finite number, got {logit_scale!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not (isinstance(z_loss_scale, (int, float)) and math.isfinite(z_loss_scale) and z_loss_scale >= 0):
        raise ValueError(f"z_loss_scale must be a finite number >= 0, got {z_loss_scale!r}")


def _checked_ignore_index(ignore_index) -> int:
    try:
        value = None if isinstance(ignore_index, bool) else operator.index(ignore_index)
    except TypeError:
        value = None
    if value is None or not _INT64.min <= value <= _INT64.max:
        raise ValueError(f"ignore_index must be an integer in the int64 range, got {ignore_index!r}")
    return value


def _check_class_weight(class_weight, vocab_size: int, hidden: Tensor) -> None:
    if not isinstance(class_weight, Tensor):
        raise TypeError(f"class_weight must be a torch.Tensor or None, got {type(class_weight).__name__}")
    if class_weight.shape != (vocab_size,):
        raise ValueError(f"class_weight must have shape ({vocab_size},) (the whole vocabulary), "
                         f"got {tuple(class_weight.shape)}")
    if not class_weight.is_floating_point():
        raise TypeError(f"class_weight must be a floating-point tensor, got {class_weight.dtype}")
    if class_weight.device != hidden.device:
        raise ValueError(f"class_weight is on {class_weight.device} but hidden is on {hidden.device}")
    if class_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("class_weight takes no gradient (as in F.cross_entropy): pass class_weight.detach()")


def _number(name: str, value):
    """A float option given as a Python number or a 0-d tensor (read once on the host), as a
    float; None stays None. A tensor that requires grad is refused: the loss has no gradient
    with respect to these options."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got a bool")
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.is_complex():
            raise ValueError(f"{name} must be a number or a 0-d real tensor, got a tensor of shape "
                             f"{tuple(value.shape)}")
        if value.requires_grad:
            raise ValueError(f"{name} is a tensor that requires grad, but the loss has no gradient with respect to "
                             f"{name}: pass a number, or detach it")
        return float(value.item())
    return float(value) if isinstance(value, numbers.Real) else value


def _type_name(value) -> str:
    """A value's type as an error message names it: ``int``, ``numpy.int64``, ``torch.Tensor``."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _is_bool(value) -> bool:
    """A Python bool or a numpy one, told by its type's name (no numpy import, and no look-up of
    sys.modules, which torch.compile would trace and guard on whole)."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def _check_options(targets: Tensor, return_metrics, return_lse, shift) -> None:
    for name, value in (("return_metrics", return_metrics), ("return_lse", return_lse)):
        if not _is_bool(value):
            raise TypeError(f"{name} must be a bool, got {_type_name(value)} {value!r}")
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise TypeError(f"shift must be an int, got {_type_name(shift)} {shift!r}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if shift and targets.dim() == 0:
        raise ValueError("shift needs a sequence dimension: targets is 0-d")


def _check_process_group(process_group) -> None:
    """A ProcessGroup, not anything else that the collectives would misread (a group's name, a rank)."""
    dist = torch.distributed
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got "
                        f"{_type_name(process_group)} {process_group!r}")


def _shift_targets(targets: Tensor, shift: int, ignore_index: int) -> Tensor:
    """Position i's target becomes ``targets[..., i + shift]``; the last ``shift`` positions get
    ``ignore_index``, which is the same loss as dropping them from hidden (without a copy of it)."""
    return F.pad(targets[..., shift:], (0, min(shift, targets.shape[-1])), value=ignore_index)


def _drop_shifted(per_row: Tensor, shift: int) -> Tensor:
    """The positions that have a shifted target: all but the last ``shift``."""
    return per_row[..., : max(per_row.shape[-1] - shift, 0)] if shift else per_row


def _autocast(hidden, weight, bias):
    """Under torch.autocast, the inputs take the autocast dtype, as F.linear's would (the
    loss itself is accumulated in fp32 regardless); float64 ones stay, as autocast leaves them."""
    device_type = hidden.device.type if isinstance(hidden, Tensor) else "cpu"
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        eligible = isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible else t

    return cast(hidden), cast(weight), cast(bias)


def _under_functorch() -> bool:
    """True inside a torch.func transform (grad, vjp, jacrev, vmap, ...)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def _check_no_dual(*tensors) -> None:
    """Forward-mode AD (torch.autograd.forward_ad) is not supported: refused rather than the
    tangents silently dropped."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise RuntimeError(FORWARD_AD_ERROR)


def _targets_checked(targets: Tensor) -> bool:
    # The range check waits on the host for a flag: skipped while tracing or capturing a CUDA
    # graph, when vmap batches the targets (a data-dependent branch per sample), and when
    # FLCE_CHECK_TARGETS=0. Unchecked, an out-of-range target gives a NaN loss.
    if torch.compiler.is_compiling() or not settings().check_targets:
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(targets):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _start_target_check(targets: Tensor, vocab_size: int, ignore_index: int):
    """Queues the range check of the targets [N] ahead of the loss's own work: the backend's
    flag (on CUDA one kernel and its zero fill) copied to pinned host memory, and an event that
    marks it ready."""
    # (inside a torch.func transform a new tensor is wrapped, which a Triton kernel cannot take)
    backend = _torch_backend if _under_functorch() else backend_for(targets.device)
    return copy_to_host(backend.targets_out_of_range(targets, vocab_size, ignore_index))


def _finish_target_check(check, targets: Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raises on an out-of-range target. Called once the loss's work is queued: the host waits
    for the flag only (the kernels queued before it), while the GPU goes on with the loss."""
    flag, ready = check
    if ready is not None:
        ready.synchronize()
    if bool(flag):
        value = int(targets[_torch_backend.out_of_range(targets, vocab_size, ignore_index)][0])
        raise ValueError(f"targets must be in [0, {vocab_size}) or ignore_index={ignore_index}, found {value}")


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    reduction: str = "mean",
    return_metrics: bool = False,
    *,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    return_lse: bool = False,
    class_weight: Tensor | None = None,
    process_group: "torch.distributed.ProcessGroup | None" = None,
    vocab_start: int | None = None,
    shift: int = 0,
):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, without the logits.

    The logits are ``z = (hidden @ weight.T + bias) * logit_scale``, then
    ``softcap * tanh(z / softcap)`` when ``softcap`` is set; the loss equals
    ``F.cross_entropy(z.float(), targets, weight=class_weight, ignore_index=...,
    reduction=..., label_smoothing=...)``, plus the z-loss ``z_loss_scale * logsumexp(z)**2`` of
    each non-ignored row (summed, or averaged over those rows for "mean"; never class-weighted).

    Args:
        hidden: (..., H) float32, bfloat16, float16 or float64.
        weight: (V, H), hidden's dtype.
        targets: hidden's leading shape, int64 (or int32, compared in int64); ``ignore_index``
            marks rows without a loss.
        bias: (V,) in hidden's dtype, or None.
        ignore_index: target value of ignored rows.
        logit_scale: multiplies the logits (before the softcap).
        softcap: if set (> 0), logits become ``softcap * tanh(z / softcap)``. This option and
            the other float ones take a number or a 0-d tensor (read on the host, no gradient).
        reduction: "mean" (over non-ignored rows, or weighted by ``class_weight``; NaN when all
            are ignored, as PyTorch), "sum", or "none" (float32 of targets' shape, 0 at ignored
            rows).
        return_metrics: also return ``{"num_correct_tokens": int64, "entropy_sum": float32,
            "num_valid_tokens": int64, "predictions": int64}``: sums over non-ignored rows of
            (argmax == target) and of the softmax entropy in nats, the count of those rows
            (``token_metrics`` turns them into means), and the argmax of each row (targets'
            shape, -1 at ignored rows); with reduction "none" also per row ``"correct_tokens"``
            (bool, False at ignored rows) and ``"entropy"`` (float32, 0 at ignored rows).
            Forward-only, unweighted by ``class_weight``; the loss and gradients are
            bit-identical either way.
        label_smoothing: PyTorch's label smoothing, in [0, 1].
        z_loss_scale: weight of the z-loss ``logsumexp(z)**2`` (PaLM), >= 0.
        return_lse: also return the per-row ``logsumexp(z)`` (float32, targets' shape),
            which receives gradients too.
        class_weight: (V,) of the whole vocabulary (every rank passes all of it under
            ``process_group``), any float dtype, or None: ``F.cross_entropy``'s ``weight``. Row i's
            cross-entropy counts w[t_i] times and a mean divides it by the sum of w[t_i] over the
            non-ignored rows; label smoothing combines with it as in PyTorch. The z-loss is not
            weighted, as in Liger-Kernel's fused linear cross-entropy (the same loss for users who
            switch): "mean" is ``sum_i w[t_i] CE_i / sum_i w[t_i] + z_loss_scale * sum_i lse_i**2 /
            n_valid``, "none" ``w[t_i] CE_i + z_loss_scale * lse_i**2``. No gradient.
        process_group: vocabulary parallelism. ``weight`` (and ``bias``) hold this rank's
            contiguous slice of the vocabulary's rows; ``hidden`` and ``targets`` (global
            indices) are the same on every rank. Every rank gets the loss and metrics of the
            whole vocabulary and the full grad of ``hidden``; weight and bias get their
            slice's gradients. Ranks whose arguments disagree (N, H, dtype, options, targets,
            class_weight, which inputs take gradients, slices that do not tile the vocabulary)
            all raise the same ValueError: one all-reduce of a few int64 per rank and a host
            sync per call, skipped where the targets' range check is (torch.compile, CUDA-graph
            capture, ``FLCE_CHECK_TARGETS=0``).
        vocab_start: index of this rank's first vocabulary row; by default the slices are
            taken to lie in rank order.
        shift: the causal-LM shift along the last dim of ``targets`` (the sequence dim of
            ``hidden``): with ``shift=1``, position i is scored against ``targets[..., i + 1]``,
            i.e. the last position of hidden and the first target are dropped, as
            transformers does for ``labels``. With ``reduction="none"`` and ``return_lse`` the
            outputs have ``shift`` fewer positions.

    DTensor inputs: ``weight`` (and ``bias``) placed ``Shard(0)`` on a 1-D device mesh, with
    ``hidden`` and ``targets`` plain or ``Replicate()`` on that mesh, is vocabulary parallelism
    over the mesh (group and ``vocab_start`` from the placement); ``weight.grad`` comes back
    sharded as ``weight``. Other layouts raise an error that says what is supported.

    Returns:
        ``loss``, or a tuple ``(loss, metrics)``, ``(loss, lse)`` or ``(loss, metrics, lse)``.
        float64 inputs give float64 loss, lse and entropy.

    Under ``torch.autocast`` the three take the autocast dtype first, as ``F.linear``'s
    inputs would; outside it they must share one dtype.

    Gradients reach ``hidden``, ``weight`` and ``bias``. When they are needed and the
    reduction is "mean" or "sum" (without ``return_lse``), they are computed during the
    forward and only scaled by the backward, so call it under ``torch.no_grad()`` when no
    backward will follow. The gradients are not differentiable: a backward with
    ``create_graph=True`` (e.g. for a gradient penalty) raises a ``RuntimeError``, and so does a
    grad of a grad under ``torch.func``. An in-place change of ``hidden``, ``weight``,
    ``targets`` or ``class_weight`` before the backward raises there, as with ``F.linear`` +
    ``F.cross_entropy``.

    Under ``torch.func`` transforms, ``grad``, ``grad_and_value``, ``vjp``, ``jacrev`` and
    ``vmap`` (and their compositions, e.g. per-sample gradients) work, with the gradients
    recomputed in the backward; forward-mode AD (``jvp``, ``jacfwd``, ``hessian``) raises.
    """
    if has_dtensor(hidden, weight, targets, bias):
        return dtensor_loss(
            fused_linear_cross_entropy, hidden, weight, targets, bias, ignore_index, logit_scale, softcap,
            reduction, return_metrics, label_smoothing=label_smoothing, z_loss_scale=z_loss_scale,
            return_lse=return_lse, class_weight=class_weight, process_group=process_group, vocab_start=vocab_start,
            shift=shift,
        )
    hidden, weight, bias = _autocast(hidden, weight, bias)
    logit_scale, softcap, label_smoothing, z_loss_scale = (
        _number(name, value) for name, value in (("logit_scale", logit_scale), ("softcap", softcap),
                                                 ("label_smoothing", label_smoothing), ("z_loss_scale", z_loss_scale)))
    _check_inputs(hidden, weight, targets, bias, logit_scale, softcap, reduction, label_smoothing, z_loss_scale)
    ignore_index = _checked_ignore_index(ignore_index)
    _check_no_dual(hidden, weight, bias)
    _check_options(targets, return_metrics, return_lse, shift)
    if targets.dtype == torch.int32 and not (_INT32.min <= ignore_index <= _INT32.max):
        # No int32 target equals this ignore_index: compare in int64 (before the shift pads with it).
        targets = targets.long()
    if shift:
        targets = _shift_targets(targets, shift, ignore_index)
    vocab_size, hidden_size = weight.shape
    functorch = _under_functorch()
    total_vocab_size = vocab_size
    if process_group is not None:
        if functorch:
            raise RuntimeError("fused_linear_cross_entropy does not support process_group under torch.func "
                               "transforms (grad, vjp, jacrev, vmap)")
        _check_process_group(process_group)
        if _targets_checked(targets):  # the ranks' agreement, the slices' tiling and the targets' range, at once
            options = dict(ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap, reduction=reduction,
                           return_metrics=return_metrics, return_lse=return_lse, label_smoothing=label_smoothing,
                           z_loss_scale=z_loss_scale, shift=shift)
            vocab_start, total_vocab_size = check_ranks_agree(process_group, hidden, weight, targets, bias,
                                                              class_weight, vocab_start, options)
        else:
            layout_start, total_vocab_size = vocabulary_layout(process_group, vocab_size, weight.device)
            vocab_start = layout_start if vocab_start is None else int(vocab_start)
    elif vocab_start is not None:
        raise ValueError("vocab_start needs a process_group")
    if class_weight is not None:
        _check_class_weight(class_weight, total_vocab_size, hidden)
        class_weight = class_weight.to(accumulation_dtype(hidden.dtype)).contiguous()  # (itself if it can)
    leading_shape = targets.shape
    hidden_2d = hidden.reshape(-1, hidden_size)  # any strides: columns made adjacent once (_chunked.unit_columns)
    targets_1d = targets.reshape(-1).contiguous()  # the kernels index these two densely
    # The targets' range flag is queued first and read once the loss's work is queued behind
    # it: the host never waits for the loss itself, so the GPU does not idle at the check.
    if not functorch:
        backend_for(hidden.device).precompile("metrics" if return_metrics else "loss", hidden.device)
    target_check = (_start_target_check(targets_1d, total_vocab_size, ignore_index)
                    if _targets_checked(targets) and process_group is None else None)
    if bias is not None:
        bias = bias.contiguous()
    options = LossOptions(
        ignore_index=int(ignore_index), logit_scale=float(logit_scale),
        softcap=None if softcap is None else float(softcap), label_smoothing=float(label_smoothing),
        z_loss_scale=float(z_loss_scale), total_vocab_size=total_vocab_size, group=process_group,
        vocab_start=int(vocab_start or 0),
    )
    if functorch:
        loss, lse, num_correct, entropy_sum, prediction, correct, entropy = FunctorchLoss.apply(
            hidden_2d, weight, targets_1d, bias, class_weight, Request(options, reduction, bool(return_metrics)))
    else:
        grad_wanted = torch.is_grad_enabled()
        needs = [grad_wanted and t is not None and t.requires_grad for t in (hidden, weight, bias)]
        in_forward = loss_grads_in_forward(needs, reduction, bool(return_lse), hidden.dtype, class_weight is not None,
                                           label_smoothing, z_loss_scale)
        out = loss_forward(hidden_2d, weight, targets_1d, bias, class_weight,
                           Request(options, reduction, bool(return_metrics), *in_forward, all_rows=bool(return_lse)))
        loss, lse, num_correct, entropy_sum = out.loss, out.lse, out.num_correct, out.entropy_sum
        prediction, correct, entropy = out.prediction, out.correct, out.entropy
    if target_check is not None:
        _finish_target_check(target_check, targets_1d, total_vocab_size, ignore_index)
    if reduction == "none":
        loss = _drop_shifted(loss.reshape(leading_shape), shift)
    outputs = [loss]
    if return_metrics:
        metrics = {"num_correct_tokens": num_correct, "entropy_sum": entropy_sum,
                   "num_valid_tokens": (targets_1d != ignore_index).sum(),
                   "predictions": _drop_shifted(prediction.reshape(leading_shape), shift)}
        if reduction == "none":
            metrics["correct_tokens"] = _drop_shifted(correct.reshape(leading_shape), shift)
            metrics["entropy"] = _drop_shifted(entropy.reshape(leading_shape), shift)
        outputs.append(metrics)
    if return_lse:
        outputs.append(_drop_shifted(lse.reshape(leading_shape), shift))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
