"""A float64 PyTorch reference of ``fused_linear_cross_entropy``, independent of the package.

The inputs are the same (already rounded) tensors that the kernel sees, moved to the CPU and
promoted to float64, so the reference differs from the kernel only by the kernel's own arithmetic.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Reference:
    loss: torch.Tensor  # float64, () or targets' shape
    lse: torch.Tensor  # float64, targets' shape
    num_correct: int  # rows (not ignored) whose argmax is the target, PyTorch's first-index tie-break
    num_ambiguous: int  # rows (not ignored) where a rounding of the logits could flip that answer
    num_correct_unambiguous: int  # rows counted in num_correct that are not ambiguous
    entropy_sum: torch.Tensor  # float64 ()
    logits: torch.Tensor  # float64 [rows, V]
    predictions: torch.Tensor  # int64, targets' shape: the argmax of each row, -1 on ignored rows
    ambiguous: torch.Tensor  # bool, targets' shape: rows (ignored ones too) whose argmax a rounding could flip
    correct: torch.Tensor  # bool, targets' shape: argmax == target, False at ignored rows
    entropy: torch.Tensor  # float64, targets' shape: softmax entropy, 0 at ignored rows
    grad_hidden: torch.Tensor | None = None  # float64, hidden's shape
    grad_weight: torch.Tensor | None = None
    grad_bias: torch.Tensor | None = None
    num_valid: int = 0  # rows not ignored


def reference(
    hidden, weight, targets, bias=None, ignore_index=-100, logit_scale=1.0, softcap=None, reduction="mean",
    *, label_smoothing=0.0, z_loss_scale=0.0, class_weight=None, grad_output=None, lse_grad=None,
    ambiguity_tol=1e-5,
) -> Reference:
    """Loss, lse, metrics and, when ``grad_output`` (d out / d loss) or ``lse_grad`` is given,
    the gradients of ``sum(loss * grad_output) + sum(lse * lse_grad)`` with respect to hidden,
    weight and bias (each only where that input requires grad).

    ``class_weight`` is F.cross_entropy's ``weight``, for the cross-entropy only: the z-loss
    k lse^2 is summed unweighted over the non-ignored rows (a mean divides it by their count), as
    Liger-Kernel's fused linear cross-entropy does."""
    leaves = [None if t is None else t.detach().cpu().double().requires_grad_(t.requires_grad)
              for t in (hidden, weight, bias)]
    targets = targets.cpu()
    h64, w64, b64 = leaves
    vocab_size = weight.shape[0]
    z = h64 @ w64.T
    if b64 is not None:
        z = z + b64
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.reshape(-1, vocab_size)
    t = targets.reshape(-1).long()
    valid = t != ignore_index

    lse = torch.logsumexp(z, dim=-1)
    w64 = None if class_weight is None else class_weight.detach().cpu().double()
    ce = F.cross_entropy(z, t, weight=w64, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing)
    z_rows = torch.where(valid, z_loss_scale * lse * lse, 0.0)
    if reduction == "none":
        loss = (ce + z_rows).reshape(targets.shape)
    elif reduction == "sum":
        loss = ce + z_rows.sum()
    else:
        loss = ce + z_rows.sum() / valid.sum()

    with torch.no_grad():
        zd = z.detach()
        log_p = torch.log_softmax(zd, dim=-1)
        probs = log_p.exp()
        entropy = torch.where(probs > 0, -probs * log_p, torch.zeros_like(probs)).sum(-1)  # 0 log 0 = 0
        argmax = zd.argmax(dim=-1)
        correct = valid & (argmax == t)
        # A row is ambiguous when its target and another entry are within a rounding of the max
        # (and they are not exactly equal, where the first-index rule decides unambiguously).
        top = zd.max(dim=-1).values
        finite_abs = torch.where(zd.isfinite(), zd.abs(), torch.zeros_like(zd))  # -inf bias entries
        tol = ambiguity_tol * finite_abs.amax(dim=-1).clamp_min(1.0)
        near = (zd >= (top - tol)[:, None]) & (zd != top[:, None])
        ambiguous_rows = near.any(dim=-1)
        ambiguous = valid & ambiguous_rows
        num_correct = int(correct.sum())
        num_ambiguous = int(ambiguous.sum())
        num_correct_unambiguous = int((correct & ~ambiguous).sum())
        entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
        entropy_sum = entropy.sum()

    grads = [None, None, None]
    if grad_output is not None or lse_grad is not None:
        out = torch.zeros((), dtype=torch.float64)
        if grad_output is not None:
            out = out + (loss * torch.as_tensor(grad_output).cpu().double()).sum()
        if lse_grad is not None:
            out = out + (lse.reshape(targets.shape) * lse_grad.cpu().double()).sum()
        wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        if wanted:
            got = iter(torch.autograd.grad(out, wanted))
            grads = [next(got) if leaf is not None and leaf.requires_grad else None for leaf in leaves]
    return Reference(
        loss=loss.detach(), lse=lse.detach().reshape(targets.shape), num_correct=num_correct,
        num_ambiguous=num_ambiguous, num_correct_unambiguous=num_correct_unambiguous, entropy_sum=entropy_sum,
        logits=z.detach(), predictions=torch.where(valid, argmax, -1).reshape(targets.shape),
        ambiguous=ambiguous_rows.reshape(targets.shape),
        correct=correct.reshape(targets.shape), entropy=entropy.reshape(targets.shape),
        grad_hidden=grads[0], grad_weight=grads[1], grad_bias=grads[2], num_valid=int(valid.sum()),
    )
