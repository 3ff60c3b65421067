"""Elementwise kernels: rows scaled (with the factored gradient's target terms), rows zeroed, and
a tensor scaled in place.
"""

import torch
import triton
import triton.language as tl

from ._launch import interpreting


@triton.jit(do_not_specialize=["n_rows"])
def _scale_rows_kernel(
    src_ptr,  # [n_rows, n_cols] any float dtype, any strides
    factor_ptr,  # [n_rows] fp32
    dst_ptr,  # [*, n_cols] out, unit column stride: row i of the result goes to row dst_rows[i] (or i)
    dst_rows_ptr,  # [n_rows] int64, or None: row i
    target_grad_ptr,  # [n_rows] fp32 c, or None: no target terms
    targets_ptr,  # [n_rows] int, columns of weight   (with target_grad_ptr; out of range: no term)
    weight_ptr,  # [V, n_cols] any strides            (with target_grad_ptr)
    n_rows,
    n_cols,
    vocab_size,
    stride_src_row,
    stride_src_col,
    stride_dst,
    stride_wv,
    stride_wk,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dst[dst_rows[i]] = factor[i] * src[i] (+ c[i] * weight[targets[i]] with target terms: the
    factored grad_hidden's target term), computed in fp32 and rounded once to dst's dtype."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = offs_r < n_rows
    mask = row_mask[:, None] & (offs_c < n_cols)[None, :]
    factor = tl.load(factor_ptr + offs_r, mask=row_mask, other=0.0)
    src_ptrs = src_ptr + offs_r.to(tl.int64)[:, None] * stride_src_row + offs_c[None, :] * stride_src_col
    src = tl.load(src_ptrs, mask=mask, other=0.0)
    dst_rows = offs_r.to(tl.int64)
    if dst_rows_ptr is not None:
        dst_rows = tl.load(dst_rows_ptr + offs_r, mask=row_mask, other=0)
    value = src.to(tl.float32) * factor[:, None]
    if target_grad_ptr is not None:
        targets = tl.load(targets_ptr + offs_r, mask=row_mask, other=-1)
        target_grad = tl.load(target_grad_ptr + offs_r, mask=row_mask, other=0.0)
        # only the rows whose target entry left the products (c != 0) read their row of weight
        has_target = row_mask & (targets >= 0) & (targets < vocab_size) & (target_grad != 0.0)
        w_ptrs = (weight_ptr + tl.where(has_target, targets, 0).to(tl.int64)[:, None] * stride_wv
                  + offs_c[None, :] * stride_wk)
        w_t = tl.load(w_ptrs, mask=has_target[:, None] & (offs_c < n_cols)[None, :], other=0.0)
        value += target_grad[:, None] * w_t.to(tl.float32)
    tl.store(dst_ptr + dst_rows[:, None] * stride_dst + offs_c[None, :], value.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _zero_rows_kernel(
    dst_ptr,  # [*, n_cols], unit column stride
    rows_ptr,  # [n_rows] int64 rows of dst
    n_rows,
    n_cols,
    stride_dst,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dst[rows[i]] = 0 for i < n_rows: a program per BLOCK_R rows x BLOCK_C columns, in vector
    stores (the grad_hidden rows of the rows a step skips)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = offs_r < n_rows
    rows = tl.load(rows_ptr + offs_r, mask=row_mask, other=0)
    zeros = tl.zeros((BLOCK_R, BLOCK_C), dtype=dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + rows[:, None] * stride_dst + offs_c[None, :], zeros,
             mask=row_mask[:, None] & (offs_c < n_cols)[None, :])


@triton.jit
def _scale_kernel(
    x_ptr,  # [numel] any float dtype, scaled in place
    scale_ptr,  # [1] fp32
    numel,
    BLOCK: tl.constexpr,
):
    """x *= scale in place; a no-op without memory traffic when scale == 1 (the usual
    ``loss.backward()``), decided on the device so that no host sync is needed."""
    scale = tl.load(scale_ptr)
    if scale != 1.0:
        # Grid-stride loop with int64 offsets: numel can pass 2^31.
        start = tl.program_id(0).to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        offs = tl.arange(0, BLOCK)
        while start < numel:
            mask = start + offs < numel
            x = tl.load(x_ptr + start + offs, mask=mask).to(tl.float32)
            tl.store(x_ptr + start + offs, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)
            start += step


# ---- launches ---------------------------------------------------------------------------
def scale_rows(src: torch.Tensor, factor: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor | None = None,
               target_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """dst[dst_rows] = factor[:, None] * src (rounded once to dst's dtype); dst_rows: int64
    [rows] indices into dst, or None for dst's first rows. src [rows, C] any strides, dst [*, C]
    with unit column stride. With ``target_terms`` (c [rows] fp32, targets [rows], weight [V, C],
    any strides)
    also + c[:, None] * weight[targets] (rows whose target is out of range add nothing)."""
    n_rows, n_cols = src.shape
    block_r, block_c = (16, 32) if interpreting() else (16, 256)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    target_grad, targets, weight = target_terms if target_terms is not None else (None, None, None)
    _scale_rows_kernel[grid](
        src, factor, dst, dst_rows, target_grad, targets, weight,
        n_rows, n_cols, weight.shape[0] if target_terms is not None else 0,
        src.stride(0), src.stride(1), dst.stride(0), *(weight.stride() if target_terms is not None else (0, 0)),
        BLOCK_R=block_r, BLOCK_C=block_c,
    )
    return dst


def zero_rows(dst: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[rows] = 0 in place: dst [*, C] with unit column stride, rows int64 [n]. Vector stores,
    where ``index_fill_``'s elementwise kernel stores 2 bytes at a time (docs/design.md)."""
    n_rows, n_cols = rows.shape[0], dst.shape[1]
    if n_rows == 0:
        return
    block_r, block_c = (16, 32) if interpreting() else (16, 256)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    _zero_rows_kernel[grid](dst, rows, n_rows, n_cols, dst.stride(0), BLOCK_R=block_r, BLOCK_C=block_c)


def scale_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x *= scale in place (scale: a one-element fp32 tensor); no traffic when scale == 1."""
    if x.numel() == 0:
        return
    block = 4096
    numel = x.numel()
    programs = min(triton.cdiv(numel, block), 1024)
    _scale_kernel[(programs,)](x, scale, numel, BLOCK=block)
