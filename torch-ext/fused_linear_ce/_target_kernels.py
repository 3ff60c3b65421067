"""Target bookkeeping: the rows' order, the target logits from a tensor-core product, the range
check, the uniform-gradient test, the take_out flags and grad_weight's target terms.
"""

import torch
import triton
import triton.language as tl

from ._kernel_math import OUT_ALWAYS, OUT_IF_IMPROBABLE, _tanh
from ._launch import input_precision, interpreting, scale_and_cap
from ._options import LossOptions


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _order_rows_kernel(
    targets_ptr,  # [n_rows] int
    order_ptr,  # [n_rows] int64 out: the rows with a loss first, each group in row order
    ordered_targets_ptr,  # [n_rows] int64 out: targets[order]
    count_ptr,  # [1] int64 out: how many rows have a loss
    loss_grad_ptr,  # [n_rows] fp32 out: d loss / d loss_i of the ordered rows (1 / count for a mean)
    n_rows,
    ignore_index,
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A stable partition of the rows, those with a loss first, a program per BLOCK rows (a launch
    instead of a sort's several: it sits before the first logit sweep). Each program counts the
    rows with a loss before its block and in all (every program reads every target, from L2 after
    the first), then places its block's rows: those with a loss after the ones before them, the
    others after all rows with a loss and the others before them."""
    block_start = tl.program_id(0) * BLOCK
    kept_before = tl.zeros([BLOCK], dtype=tl.int32)
    kept = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_rows, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        targets = tl.load(targets_ptr + offs, mask=offs < n_rows, other=ignore_index)
        has_loss = (targets != ignore_index).to(tl.int32)
        kept += has_loss
        kept_before += tl.where(start < block_start, has_loss, 0)
    kept = tl.sum(kept, axis=0)
    kept_before = tl.sum(kept_before, axis=0)
    offs = block_start + tl.arange(0, BLOCK)
    mask = offs < n_rows
    targets = tl.load(targets_ptr + offs, mask=mask, other=ignore_index)
    keep = mask & (targets != ignore_index)
    drop = mask & (targets == ignore_index)
    position = tl.where(keep, kept_before + tl.cumsum(keep.to(tl.int32), axis=0) - 1,
                        kept + (block_start - kept_before) + tl.cumsum(drop.to(tl.int32), axis=0) - 1)
    tl.store(order_ptr + position, offs.to(tl.int64), mask=mask)
    tl.store(ordered_targets_ptr + position, targets.to(tl.int64), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(count_ptr, kept.to(tl.int64))
    row_grad = 1.0
    if MEAN:  # rounded as PyTorch's 1 / n: a trainer's mean gives its rows this weight bit for bit
        row_grad = tl.math.div_rn(1.0, kept.to(tl.float32))
    tl.store(loss_grad_ptr + offs, tl.where(offs < kept, row_grad, 0.0), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _picked_logit_dot_kernel(
    hidden_ptr,  # [n_rows, H]
    weight_ptr,  # [V, H]
    targets_ptr,  # [n_rows] int: columns of this weight (out of range: column 0 instead)
    out_ptr,  # [n_rows] fp32 out: z at column c (s * hidden_i . weight_c, then bias and softcap)
    target_logit_ptr,  # [n_rows] fp32 out: the same, NaN where the target is not a column here
    bias_ptr,  # [V], or None
    rows_ptr,  # [n_rows] int64: row i is hidden[rows[i]]; or None: hidden[i]
    n_rows,
    vocab_size,
    hidden_size,
    stride_hn,
    stride_hk,
    stride_wv,
    stride_wk,
    logit_scale,
    softcap,  # or None
    INPUT_PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One logit per row, at its target column (column 0 where the target is not a column of this
    weight): the reference B of the factored gradient, a lower bound of the row's max that is
    close to it wherever the target is not extremely unlikely, and the target's logit of the loss
    (NaN where the target is not a column of this weight). Each is taken from a product on the
    tensor cores, hidden[BLOCK_R rows] @ weight[their target columns].T [BLOCK_R, BLOCK_R], which holds them on
    its diagonal. The product adds each logit's H terms in the same order of K steps as the
    logit kernel's tiles (a wgmma output sums its own terms, whatever N; BLOCK_R = 64 keeps the
    product on wgmma), so that z_t carries the rounding of the lse's logits and the loss lse - z_t
    cancels it, where an exact fp32 dot product leaves it (about 1e-5 of the loss on the Llama-3
    head). Bias, scale and softcap follow in ``_tile_logits``'s operations, so that z_t is the
    tiles' value bit for bit."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = offs_r < n_rows
    targets = tl.load(targets_ptr + offs_r, mask=row_mask, other=0)
    local = (targets >= 0) & (targets < vocab_size)
    columns = tl.where(local, targets, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    load_r = (offs_r % n_rows).to(tl.int64)  # rows past the end wrap onto valid ones, not stored
    if rows_ptr is not None:  # the rows of a whole step's order, read in place instead of gathered by chunk
        load_r = tl.load(rows_ptr + load_r)
    h_ptrs = hidden_ptr + load_r[:, None] * stride_hn + offs_k[None, :] * stride_hk  # [BLOCK_R, BLOCK_K]
    w_ptrs = weight_ptr + columns[None, :] * stride_wv + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_R]
    acc = tl.zeros((BLOCK_R, BLOCK_R), tl.float32)
    for k in range(0, tl.cdiv(hidden_size, BLOCK_K)):
        k_mask = offs_k < hidden_size - k * BLOCK_K  # zeros past H, as the copy engine fills them
        h = tl.load(h_ptrs, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(h, w, acc, input_precision=INPUT_PRECISION)
        h_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk
    on_diagonal = tl.arange(0, BLOCK_R)[:, None] == tl.arange(0, BLOCK_R)[None, :]
    picked = tl.sum(tl.where(on_diagonal, acc, 0.0), axis=1)  # exact: one term at most a row is not zero
    if bias_ptr is not None:
        picked = picked + tl.load(bias_ptr + columns).to(tl.float32)
    picked = picked * logit_scale
    if softcap is not None:
        picked = softcap * _tanh(picked / softcap)
    tl.store(out_ptr + offs_r, picked, mask=row_mask)
    tl.store(target_logit_ptr + offs_r, tl.where(local, picked, float("nan")), mask=row_mask)


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _targets_out_of_range_kernel(
    targets_ptr,  # [n_rows] int
    flag_ptr,  # [1] int32, zero on entry: set to 1 if a target is out of range
    n_rows,
    vocab_size,
    ignore_index,
    BLOCK: tl.constexpr,
):
    """flag = 1 where a target is neither a column of the (whole) vocabulary nor
    ``ignore_index``; every program that finds one stores the same 1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    targets = tl.load(targets_ptr + offs, mask=offs < n_rows, other=0)
    bad = (offs < n_rows) & ((targets < 0) | (targets >= vocab_size)) & (targets != ignore_index)
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.store(flag_ptr, 1)


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _mean_grad_ratio_kernel(
    row_grad_ptr,  # [n_rows] fp32: d out / d log_probs_i
    targets_ptr,  # [n_rows] int
    out_ptr,  # [2] fp32 out: 1 if every row with a target has the same gradient c (else 0), then -c / w
    n_rows,
    ignore_index,
    BLOCK: tl.constexpr,
):
    """Whether a per-token backward's gradient of log_probs is one value c on every row with a
    target, and the ratio -c / w, with w = 1 / count the weight of a mean over those rows (both
    divisions rounded as PyTorch's): the sweep's gradients of the mean of -log_probs times the
    ratio are the wanted ones, and the ratio is exactly 1 where c = -1 / count. One program:
    the rows of a call are a few thousand (a NaN gradient is never uniform)."""
    offs = tl.arange(0, BLOCK)
    first = tl.full([BLOCK], n_rows, dtype=tl.int32)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offs
        targets = tl.load(targets_ptr + rows, mask=rows < n_rows, other=ignore_index)
        valid = (rows < n_rows) & (targets != ignore_index)
        count += valid.to(tl.int32)
        first = tl.minimum(first, tl.where(valid, rows, n_rows))
    count = tl.sum(count, axis=0)
    first = tl.min(first, axis=0)
    common = tl.load(row_grad_ptr + first, mask=first < n_rows, other=0.0)
    differ = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offs
        targets = tl.load(targets_ptr + rows, mask=rows < n_rows, other=ignore_index)
        valid = (rows < n_rows) & (targets != ignore_index)
        grad = tl.load(row_grad_ptr + rows, mask=valid, other=0.0)
        differ += (valid & (grad != common)).to(tl.int32)
    weight = tl.math.div_rn(1.0, tl.maximum(count, 1).to(tl.float32))
    tl.store(out_ptr, (tl.sum(differ, axis=0) == 0).to(tl.float32))
    tl.store(out_ptr + 1, tl.math.div_rn(-common, weight))


@triton.jit(do_not_specialize=["n_rows", "ignore_index"])
def _count_targets_kernel(
    targets_ptr,  # [n_rows] int: each row's column of this weight (out of range: none)
    counts_ptr,  # [V] int32, zero on entry: the rows of each column
    n_rows,
    vocab_size,
    ignore_index,
    BLOCK: tl.constexpr,
):
    """counts[t] += 1 for each row whose target t is a column here and not ``ignore_index``.
    Integer atomics are exact, so the counts do not depend on the order the rows come in."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    targets = tl.load(targets_ptr + offs, mask=offs < n_rows, other=-1)
    counted = (offs < n_rows) & (targets >= 0) & (targets < vocab_size) & (targets != ignore_index)
    tl.atomic_add(counts_ptr + tl.where(counted, targets, 0), tl.full([BLOCK], 1, tl.int32), mask=counted)


@triton.jit(do_not_specialize=["n_rows", "ignore_index", "rare_count", "improbable_count"])
def _take_out_flags_kernel(
    targets_ptr,  # [n_rows] int
    counts_ptr,  # [V] int32 from _count_targets_kernel
    flags_ptr,  # [n_rows] int8 out: 0, OUT_ALWAYS or OUT_IF_IMPROBABLE
    n_rows,
    vocab_size,
    ignore_index,
    rare_count,  # OUT_ALWAYS where the target is of at most this many rows
    improbable_count,  # OUT_IF_IMPROBABLE where it is of at most this many (and more than rare_count)
    BLOCK: tl.constexpr,
):
    """Each row's take_out flag (see ``_row_kernels._factor_rows``) from its target's count of rows; 0 for
    rows without a target here."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    targets = tl.load(targets_ptr + offs, mask=offs < n_rows, other=-1)
    counted = (offs < n_rows) & (targets >= 0) & (targets < vocab_size) & (targets != ignore_index)
    count = tl.load(counts_ptr + tl.where(counted, targets, 0), mask=counted, other=0)
    flags = tl.where(count <= rare_count, OUT_ALWAYS, tl.where(count <= improbable_count, OUT_IF_IMPROBABLE, 0))
    tl.store(flags_ptr + offs, tl.where(counted, flags, 0).to(tl.int8), mask=offs < n_rows)


@triton.jit(do_not_specialize=["n_rows"])
def _target_keys_kernel(
    targets_ptr,  # [n_rows] int
    target_grad_ptr,  # [n_rows] fp32 c of each row (0: no term)
    keys_ptr,  # [n_rows] int16 or int32 out: the target where the row has a term, else V
    n_rows,
    vocab_size,
    BLOCK: tl.constexpr,
):
    """The sort keys of ``_target_segments_kernel``: each row's target where it has a term (c != 0
    and a column of this weight), V elsewhere, so that every key lies in [0, V]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_rows
    targets = tl.load(targets_ptr + offs, mask=mask, other=-1)
    target_grad = tl.load(target_grad_ptr + offs, mask=mask, other=0.0)
    has_term = (target_grad != 0) & (targets >= 0) & (targets < vocab_size)
    tl.store(keys_ptr + offs, tl.where(has_term, targets, vocab_size).to(keys_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _target_segments_kernel(
    acc_ptr,  # [V, H] grad_weight's sum (any float dtype, unit column stride), updated in place
    sorted_keys_ptr,  # [n_rows] int16 or int32: ``_target_keys_kernel``'s keys sorted (stably)
    perm_ptr,  # [n_rows] int64: the row of each sorted position
    target_grad_ptr,  # [n_rows] fp32 c of each row
    hidden_ptr,  # [*, H]
    hidden_rows_ptr,  # [n_rows] int64: row i's row of hidden, or None: row i
    n_rows,
    vocab_size,
    hidden_size,
    stride_acc,
    stride_hn,
    stride_hk,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """grad_weight's target terms: acc[t] += sum over the rows i with target t of c_i h_i, for
    columns BLOCK_H x program_id(1). Each program takes BLOCK_P sorted positions at a time
    (grid-stride), and stops at the first block whose keys are all V: past it no row has a term.
    The first position of each target's segment sums its rows in fp32, one a step in the sorted
    order (deterministic), while the BLOCK_P segments of a block go in parallel, and the sum meets
    acc's entry in one rounding. The next key is loaded with each row, so that a segment of one
    row takes one step."""
    offs_p = tl.arange(0, BLOCK_P)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden_size
    start = tl.program_id(0) * BLOCK_P
    keys = tl.load(sorted_keys_ptr + start + offs_p, mask=start + offs_p < n_rows, other=vocab_size)
    while tl.min(keys, axis=0) < vocab_size:
        positions = start + offs_p
        previous = tl.load(sorted_keys_ptr + positions - 1, mask=(positions > 0) & (positions < n_rows), other=-1)
        leader = (keys != previous) & (keys < vocab_size)
        acc_ptrs = acc_ptr + keys.to(tl.int64)[:, None] * stride_acc + offs_h[None, :]  # V * H can pass 2^31
        acc_mask = leader[:, None] & mask_h[None, :]
        acc = tl.load(acc_ptrs, mask=acc_mask, other=0.0).to(tl.float32)
        total = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
        in_segment = leader
        while tl.max(in_segment.to(tl.int32), axis=0) > 0:
            rows = tl.load(perm_ptr + positions, mask=in_segment, other=0)
            following = tl.load(sorted_keys_ptr + positions + 1, mask=in_segment & (positions + 1 < n_rows),
                                other=vocab_size)
            target_grad = tl.load(target_grad_ptr + rows, mask=in_segment, other=0.0)
            if hidden_rows_ptr is not None:
                rows = tl.load(hidden_rows_ptr + rows, mask=in_segment, other=0)
            h = tl.load(hidden_ptr + rows[:, None] * stride_hn + offs_h[None, :] * stride_hk,
                        mask=in_segment[:, None] & mask_h[None, :], other=0.0)
            total += target_grad[:, None] * h.to(tl.float32)
            in_segment = in_segment & (following == keys)
            positions += 1
        tl.store(acc_ptrs, (acc + total).to(acc_ptr.dtype.element_ty), mask=acc_mask)
        start += tl.num_programs(0) * BLOCK_P
        keys = tl.load(sorted_keys_ptr + start + offs_p, mask=start + offs_p < n_rows, other=vocab_size)


# ---- launches ---------------------------------------------------------------------------
def order_rows(targets: torch.Tensor, ignore_index: int, mean: bool):
    """The rows with a loss first: (order int64 [N], targets[order] int64 [N], their count
    int64 [1], d loss / d loss_i [N] fp32 of the ordered rows: 1, or 1 / count for a mean)."""
    n_rows = targets.shape[0]
    device = targets.device
    order = torch.empty(n_rows, device=device, dtype=torch.int64)
    ordered_targets = torch.empty(n_rows, device=device, dtype=torch.int64)
    count = torch.empty(1, device=device, dtype=torch.int64)
    loss_grad = torch.empty(n_rows, device=device, dtype=torch.float32)
    # Each program reads all N targets: blocks grow with N to keep the programs at 64 or fewer
    # (up to 262144 rows; a few when interpreting), to 4096 rows at 8 warps (8192 at 16 spill
    # on sm_90 in Triton 3.9): one program walking the blocks in turn took four times as long
    # (docs/design.md).
    parts = 4 if interpreting() else 64
    block = min(4096, max(64 if interpreting() else 1024, triton.next_power_of_2(triton.cdiv(n_rows, parts))))
    _order_rows_kernel[(max(1, triton.cdiv(n_rows, block)),)](
        targets, order, ordered_targets, count, loss_grad, n_rows, int(ignore_index), MEAN=mean, BLOCK=block,
        num_warps=max(4, block // 512))
    return order, ordered_targets, count, loss_grad


def picked_logits(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, opts: LossOptions,
                  bias: torch.Tensor | None = None, rows: torch.Tensor | None = None):
    """(z_ic, the same or NaN where t_i is not a column here), both [rows] fp32, with c = t_i
    (column 0 where the target is not a column of this weight) and z the final logit (bias, scale,
    softcap), from a tensor-core product that sums each logit as the logit kernel's tiles do
    (``_picked_logit_dot_kernel``). With ``rows`` (int64 [rows]) row i is hidden[rows[i]]."""
    n_rows, hidden_size = (hidden.shape[0] if rows is None else rows.shape[0]), hidden.shape[1]
    out = torch.empty(n_rows, device=hidden.device, dtype=torch.float32)
    target_logit = torch.empty_like(out)
    block_r, block_k = (32, 16) if interpreting() else (64, 64)
    _picked_logit_dot_kernel[(triton.cdiv(n_rows, block_r),)](
        hidden, weight, targets, out, target_logit, bias, rows,
        n_rows, weight.shape[0], hidden_size, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        float(opts.logit_scale), scale_and_cap(opts)[1],
        INPUT_PRECISION=input_precision(hidden.dtype), BLOCK_R=block_r, BLOCK_K=block_k,
        # six stages of 16 KiB: a 64-row program a multiprocessor is bound by the loads in flight
        # (three stages took a third longer; docs/design.md)
        num_warps=4, num_stages=6,
    )
    return out, target_logit


def targets_out_of_range(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """A [] int32 flag, 1 if a target is neither in [0, vocab_size) nor ``ignore_index``: one
    launch beside its zero fill, for the loss's range check."""
    flag = torch.zeros((), device=targets.device, dtype=torch.int32)
    n_rows = targets.numel()
    if n_rows:
        block = 64 if interpreting() else 1024
        _targets_out_of_range_kernel[(triton.cdiv(n_rows, block),)](
            targets, flag, n_rows, vocab_size, int(ignore_index), BLOCK=block)
    return flag


def mean_grad_ratio(row_grad: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """[2] fp32 (uniform, ratio) of ``_mean_grad_ratio_kernel``, in one launch."""
    out = torch.empty(2, device=targets.device, dtype=torch.float32)
    _mean_grad_ratio_kernel[(1,)](row_grad, targets, out, targets.shape[0], int(ignore_index),
                                  BLOCK=64 if interpreting() else 1024)
    return out


def take_out_flags(targets: torch.Tensor, vocab_size: int, ignore_index: int, rare_count: int,
                   improbable_count: int) -> torch.Tensor:
    """[N] int8 take_out flags (``_kernel_math``): OUT_ALWAYS on the rows whose target column is the
    target of at most ``rare_count`` of the rows, OUT_IF_IMPROBABLE where of at most
    ``improbable_count``, 0 elsewhere and on rows without a target here (out of range, or
    ``ignore_index``). Counted with int32 atomics (``_count_targets_kernel``, then
    ``_take_out_flags_kernel``) and no host sync (so also under CUDA-graph capture)."""
    n_rows = targets.shape[0]
    counts = torch.zeros(vocab_size, device=targets.device, dtype=torch.int32)
    flags = torch.empty(n_rows, device=targets.device, dtype=torch.int8)
    if n_rows == 0:
        return flags
    block = 64 if interpreting() else 1024
    grid = (triton.cdiv(n_rows, block),)
    _count_targets_kernel[grid](targets, counts, n_rows, vocab_size, int(ignore_index), BLOCK=block)
    _take_out_flags_kernel[grid](targets, counts, flags, n_rows, vocab_size, int(ignore_index),
                                 int(rare_count), int(improbable_count), BLOCK=block)
    return flags


def target_keys(targets: torch.Tensor, target_grad: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The sort keys [rows] of ``target_segments``: each row's target where it has a term
    (``target_grad`` != 0 and a column here), V elsewhere; int16 where V < 2^15, which takes half
    the radix passes of int32 keys (``_target_keys_kernel``)."""
    n_rows = targets.shape[0]
    keys = torch.empty(n_rows, device=targets.device, dtype=torch.int16 if vocab_size < 2**15 else torch.int32)
    block = 64 if interpreting() else 1024
    _target_keys_kernel[(triton.cdiv(n_rows, block),)](targets, target_grad, keys, n_rows, vocab_size, BLOCK=block)
    return keys


def target_segments(acc: torch.Tensor, sorted_keys: torch.Tensor, perm: torch.Tensor, target_grad: torch.Tensor,
                    hidden: torch.Tensor, hidden_rows: torch.Tensor | None, max_programs: int) -> None:
    """acc[t] += sum over the rows i with key t of target_grad[i] * hidden[hidden_rows[i]], in place,
    from the keys sorted (stably) and their ``perm`` (``_target_segments_kernel``): as many programs
    as ``max_programs`` multiprocessors hold, 16 each."""
    n_rows = sorted_keys.shape[0]
    vocab_size, hidden_size = acc.shape
    # Bound by memory (a row of hidden and acc's row twice per term): as many programs as the
    # multiprocessors hold, grid-stride, each with four positions' loads in flight.
    block_p, block_h = 4, 32 if interpreting() else 1024
    column_blocks = triton.cdiv(hidden_size, block_h)
    programs = min(triton.cdiv(n_rows, block_p), max(1, 16 * max_programs // column_blocks))
    _target_segments_kernel[(programs, column_blocks)](
        acc, sorted_keys, perm, target_grad, hidden, hidden_rows,
        n_rows, vocab_size, hidden_size, acc.stride(0), hidden.stride(0), hidden.stride(1),
        BLOCK_P=block_p, BLOCK_H=block_h,
    )
