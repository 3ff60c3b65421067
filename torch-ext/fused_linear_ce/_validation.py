"""The public functions' argument checks: tensors' shapes, dtypes and devices, the float options,
ignore_index and the targets' range, reductions, and the inputs' handling under autocast, DTensor,
torch.func and forward-mode AD. Each check raises the error that names the argument at fault."""

import math
import numbers
import operator
from typing import NamedTuple

import torch
from torch import Tensor

from . import _torch_backend
from ._chunked import backend_for, copy_to_host
from ._dtensor import has_dtensor
from ._ops import FORWARD_AD_ERROR
from ._options import LossOptions
from ._settings import current as settings

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
REDUCTIONS = ("mean", "sum", "none")
INT32 = torch.iinfo(torch.int32)
INT64 = torch.iinfo(torch.int64)


# ---- the inputs' form: autocast, numbers, flags ----------------------------------------------
def autocast_inputs(hidden, weight, bias):
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


def number(name: str, value):
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


def type_name(value) -> str:
    """A value's type as an error message names it: ``int``, ``numpy.int64``, ``torch.Tensor``."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def is_bool(value) -> bool:
    """A Python bool or a numpy one, told by its type's name (no numpy import, and no look-up of
    sys.modules, which torch.compile would trace and guard on whole)."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def checked_ignore_index(ignore_index) -> int:
    """``ignore_index`` as a Python int: an integer (not a bool) in the int64 range."""
    try:
        value = None if isinstance(ignore_index, bool) else operator.index(ignore_index)
    except TypeError:
        value = None
    if value is None or not INT64.min <= value <= INT64.max:
        raise ValueError(f"ignore_index must be an integer in the int64 range, got {ignore_index!r}")
    return value


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_softcap(name: str, softcap) -> None:
    """A softcap (read by ``number``) is None or a finite number > 0."""
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"{name} must be None or a finite number > 0, got {softcap!r}")


def checked_softcap(name: str, softcap) -> float | None:
    """A softcap option (a number, a 0-d tensor or None), checked, as a float or None."""
    softcap = number(name, softcap)
    check_softcap(name, softcap)
    return softcap


def check_temperature(temperature) -> None:
    """A temperature (read by ``number``) is a finite number > 0."""
    if not (isinstance(temperature, float) and temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


# ---- where the inputs come from: DTensor, torch.func, forward-mode AD ------------------------
def refuse_dtensor(function: str, *tensors) -> None:
    """The functions without vocabulary parallelism take plain tensors only."""
    if has_dtensor(*tensors):
        raise TypeError(f"{function} takes plain tensors: gather DTensor inputs first (full_tensor())")


def under_functorch() -> bool:
    """True inside a torch.func transform (grad, vjp, jacrev, vmap, ...)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def refuse_functorch(function: str) -> None:
    if under_functorch():
        raise RuntimeError(f"{function} does not support torch.func transforms")


def check_no_dual(*tensors) -> None:
    """Forward-mode AD (torch.autograd.forward_ad) is not supported: refused rather than the
    tangents silently dropped."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise RuntimeError(FORWARD_AD_ERROR)


# ---- the LM head's tensors ------------------------------------------------------------------
def check_tensors(hidden, weight, targets, bias) -> None:
    """hidden (..., H) float, weight (V, H) and bias (V,) or None in its dtype, targets of its
    leading shape int64 or int32; all on hidden's device, none a meta tensor."""
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if hidden.dtype not in FLOAT_DTYPES:
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


def check_logit_options(logit_scale, softcap) -> None:
    """The logits' transform (numbers read by ``number``): a finite scale, a softcap > 0 or None."""
    if not (isinstance(logit_scale, (int, float)) and math.isfinite(logit_scale)):
        raise ValueError(f"logit_scale must be a finite number, got {logit_scale!r}")
    check_softcap("softcap", softcap)


# ---- fused_linear_cross_entropy -------------------------------------------------------------
def checked_loss_arguments(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, ignore_index,
                           logit_scale, softcap, reduction, label_smoothing, z_loss_scale, return_metrics, return_lse,
                           shift) -> tuple[float, float | None, float, float, int]:
    """Checks the loss's arguments (its tensors after autocast); returns its float options and
    ignore_index as Python numbers: (logit_scale, softcap, label_smoothing, z_loss_scale, ignore_index)."""
    logit_scale, softcap, label_smoothing, z_loss_scale = (
        number(name, value) for name, value in (("logit_scale", logit_scale), ("softcap", softcap),
                                                ("label_smoothing", label_smoothing), ("z_loss_scale", z_loss_scale)))
    check_tensors(hidden, weight, targets, bias)
    check_reduction(reduction)
    check_logit_options(logit_scale, softcap)
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not (isinstance(z_loss_scale, (int, float)) and math.isfinite(z_loss_scale) and z_loss_scale >= 0):
        raise ValueError(f"z_loss_scale must be a finite number >= 0, got {z_loss_scale!r}")
    ignore_index = checked_ignore_index(ignore_index)
    check_no_dual(hidden, weight, bias)
    for name, value in (("return_metrics", return_metrics), ("return_lse", return_lse)):
        if not is_bool(value):
            raise TypeError(f"{name} must be a bool, got {type_name(value)} {value!r}")
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise TypeError(f"shift must be an int, got {type_name(shift)} {shift!r}")
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if shift and targets.dim() == 0:
        raise ValueError("shift needs a sequence dimension: targets is 0-d")
    return logit_scale, softcap, label_smoothing, z_loss_scale, ignore_index


def check_process_group(process_group) -> None:
    """A ProcessGroup, not anything else that the collectives would misread (a group's name, a
    rank); and none inside a torch.func transform."""
    if under_functorch():
        raise RuntimeError("fused_linear_cross_entropy does not support process_group under torch.func "
                           "transforms (grad, vjp, jacrev, vmap)")
    dist = torch.distributed
    if not (dist.is_available() and isinstance(process_group, dist.ProcessGroup)):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type_name(process_group)} {process_group!r}")


def check_class_weight(class_weight, vocab_size: int, hidden: Tensor) -> None:
    """F.cross_entropy's ``weight``: (V,) of the whole vocabulary, float, on hidden's device, no grad."""
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


# ---- fused_linear_log_probs and the sparse losses -------------------------------------------
class TokenArguments(NamedTuple):
    """The checked tensors (after autocast) and options of a per-token call."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    options: LossOptions


def checked_token_arguments(hidden, weight, targets, bias, temperature, logit_scale, softcap, ignore_index,
                            ids_per_row: bool = False) -> TokenArguments:
    """Checks ``fused_linear_log_probs``'s arguments, with ``targets`` of hidden's leading shape
    or, ``ids_per_row``, (..., K) ids; the options with the temperature folded into the scale and
    the softcap, as z / T = (c / T) tanh((s / T) u / (c / T))."""
    refuse_dtensor("fused_linear_log_probs", hidden, weight, targets, bias)
    refuse_functorch("fused_linear_log_probs")
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    temperature, logit_scale, softcap = (number(name, value) for name, value in (
        ("temperature", temperature), ("logit_scale", logit_scale), ("softcap", softcap)))
    if ids_per_row:
        if targets.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"targets must be int64 (or int32), got {targets.dtype}")
        if targets.shape[:-1] != hidden.shape[:-1] or targets.shape[-1] == 0:
            raise ValueError(f"(..., K) targets must have shape {tuple(hidden.shape[:-1])} + (K,) with K >= 1, "
                             f"got {tuple(targets.shape)}")
        targets = targets[..., 0]
    check_tensors(hidden, weight, targets, bias)
    check_logit_options(logit_scale, softcap)
    check_temperature(temperature)
    options = LossOptions(ignore_index=checked_ignore_index(ignore_index), logit_scale=logit_scale / temperature,
                          softcap=None if softcap is None else softcap / temperature)
    return TokenArguments(hidden, weight, bias, options)


def check_teacher_log_probs(name: str, teacher: Tensor, ids: Tensor) -> None:
    """A teacher's log-probs: a float tensor of the ids' shape, on their device."""
    if not isinstance(teacher, Tensor) or not teacher.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {type(teacher).__name__}")
    if teacher.shape != ids.shape or teacher.device != ids.device:
        raise ValueError(f"{name} must have shape {tuple(ids.shape)} on {ids.device}, got {tuple(teacher.shape)} "
                         f"on {teacher.device}")


# ---- fused_linear_divergence ----------------------------------------------------------------
def check_head(name: str, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """One side of a divergence: hidden (..., H), weight (V, H), bias (V,) or None, one float dtype."""
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name}_hidden (..., H) and {name}_weight (V, H) do not match: {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}")
    if not hidden.is_floating_point() or {weight.dtype, hidden.dtype, weight.dtype if bias is None else bias.dtype} \
            != {hidden.dtype}:
        raise TypeError(f"{name}_hidden, {name}_weight and {name}_bias must share one floating dtype")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{name}_bias must be (V,) = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")


def check_heads_match(student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor,
                      teacher_weight: Tensor) -> None:
    """The student and the teacher share the vocabulary, the leading shape and the device."""
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's vocabulary ({student_weight.shape[0]}) and the teacher's "
                         f"({teacher_weight.shape[0]}) differ")
    if student_hidden.shape[:-1] != teacher_hidden.shape[:-1]:
        raise ValueError(f"student_hidden {tuple(student_hidden.shape)} and teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} have different leading shapes")
    if len({t.device for t in (student_hidden, student_weight, teacher_hidden, teacher_weight)}) > 1:
        raise ValueError("the student's and the teacher's tensors must be on one device")


def checked_divergence_options(beta, temperature, student_logit_scale, student_softcap, teacher_logit_scale,
                               teacher_softcap) -> tuple[float, ...]:
    """The divergence's numbers, checked: (beta, temperature, student_logit_scale,
    student_softcap, teacher_logit_scale, teacher_softcap), the softcaps None or floats."""
    beta, temperature = number("beta", beta), number("temperature", temperature)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    check_temperature(temperature)
    scales = [number(name, value) for name, value in (("student_logit_scale", student_logit_scale),
                                                      ("teacher_logit_scale", teacher_logit_scale))]
    if not all(math.isfinite(s) for s in scales):
        raise ValueError(f"the logit scales must be finite, got {scales}")
    student_softcap = checked_softcap("student_softcap", student_softcap)
    teacher_softcap = checked_softcap("teacher_softcap", teacher_softcap)
    return beta, temperature, scales[0], student_softcap, scales[1], teacher_softcap


# ---- the targets' range, checked beside the loss's work -------------------------------------
def targets_checked(targets: Tensor) -> bool:
    """Whether the targets' range is checked on this call."""
    # The range check waits on the host for a flag: skipped while tracing or capturing a CUDA
    # graph, when vmap batches the targets (a data-dependent branch per sample), and when
    # FLCE_CHECK_TARGETS=0. Unchecked, an out-of-range target gives a NaN loss.
    if torch.compiler.is_compiling() or not settings().check_targets:
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(targets):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class TargetCheck(NamedTuple):
    """A queued range check of ``targets`` [N]: the backend's flag on the host once ``ready``."""

    flag: Tensor
    ready: "torch.cuda.Event | None"
    targets: Tensor
    vocab_size: int
    ignore_index: int


def start_target_check(targets: Tensor, vocab_size: int, ignore_index: int) -> TargetCheck | None:
    """Queues the range check of the targets [N] ahead of the loss's own work (None where
    ``targets_checked`` says no): the backend's flag (on CUDA one kernel and its zero fill)
    copied to pinned host memory, and an event that marks it ready."""
    if not targets_checked(targets):
        return None
    # (inside a torch.func transform a new tensor is wrapped, which a Triton kernel cannot take)
    backend = _torch_backend if under_functorch() else backend_for(targets.device)
    flag, ready = copy_to_host(backend.targets_out_of_range(targets, vocab_size, ignore_index))
    return TargetCheck(flag, ready, targets, vocab_size, ignore_index)


def finish_target_check(check: TargetCheck | None) -> None:
    """Raises on an out-of-range target. Called once the loss's work is queued: the host waits
    for the flag only (the kernels queued before it), while the GPU goes on with the loss."""
    if check is None:
        return
    if check.ready is not None:
        check.ready.synchronize()
    if bool(check.flag):
        targets, vocab_size, ignore_index = check.targets, check.vocab_size, check.ignore_index
        value = int(targets[_torch_backend.out_of_range(targets, vocab_size, ignore_index)][0])
        raise ValueError(f"targets must be in [0, {vocab_size}) or ignore_index={ignore_index}, found {value}")
