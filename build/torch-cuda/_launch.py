"""What the Triton kernels' launchers share: whether the kernels run in the interpreter, and the
options and dtypes in the form the kernels take them."""

import os

import torch
import triton.language as tl

from ._options import LossOptions


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def acc_dtype(dtype: torch.dtype):
    """The kernels' ACC_DTYPE for inputs of ``dtype``."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def input_precision(dtype: torch.dtype) -> str:
    """The tl.dot precision for inputs of ``dtype``: fp32 inputs follow PyTorch's matmul precision
    ("highest" gets 3xTF32, about fp32 accuracy on the tensor cores; "high"/"medium" get TF32)."""
    if dtype != torch.float32:
        return "ieee"  # ignored for 16-bit operands
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def scale_and_cap(opts: LossOptions) -> tuple:
    """(logit_scale, softcap) as the logit kernels take them: None for a scale of 1, no softcap."""
    scale = float(opts.logit_scale)
    return None if scale == 1.0 else scale, float(opts.softcap) if opts.has_softcap else None


def smoothing_and_z_loss(opts: LossOptions) -> tuple:
    """(label_smoothing, z_loss_scale) as the kernels take them: None where absent (0)."""
    return (float(opts.label_smoothing) if opts.has_smoothing else None,
            float(opts.z_loss_scale) if opts.has_z_loss else None)


def unit_columns(t: torch.Tensor) -> bool:
    """Whether the columns of ``t`` [rows, C] are adjacent (``_chunked.unit_columns`` sees to it)."""
    return t.stride(1) == 1 or t.shape[1] <= 1


def contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [rows, C] with rows C elements apart, as the kernels that derive their row strides from
    the sizes read it: itself where it is (every layout but a view of every other row, or of some
    columns, of a larger tensor), else a copy."""
    return t if t.shape[0] <= 1 or (t.stride(0) == t.shape[1] and unit_columns(t)) else t.contiguous()
