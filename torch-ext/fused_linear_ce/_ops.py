"""torch.library operators and their autograd: what torch.compile and CUDA graphs see.

The operators are opaque to the compiler (one fake implementation each) and are named in
the namespace of the package as it was imported: ``fused_linear_ce`` when installed with
pip, the kernel's unique id when loaded by ``kernels`` (so two loaded versions never clash).
"""

import torch
from torch import Tensor

from . import _chunked
from ._distributed import Shard, resolve_group
from ._options import LossOptions

NAMESPACE = __name__.split(".")[0]


def _options(ignore_index, logit_scale, softcap, label_smoothing, z_loss_scale, total_vocab_size,
             return_metrics=False):
    return LossOptions(
        ignore_index=ignore_index, logit_scale=logit_scale, softcap=softcap, label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale, return_metrics=return_metrics, total_vocab_size=total_vocab_size,
    )


def _shard(group_name: str | None, vocab_start: int, total_vocab_size: int) -> Shard | None:
    # Operators take the group's registered name: a ProcessGroup is no schema type.
    return None if group_name is None else Shard(resolve_group(group_name), vocab_start, total_vocab_size)


def _no_autocast(t: Tensor):
    return torch.autocast(t.device.type, enabled=False)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t


@torch.library.custom_op(f"{NAMESPACE}::forward", mutates_args=())
def forward_op(
    hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
    ignore_index: int, logit_scale: float, softcap: float | None, label_smoothing: float,
    z_loss_scale: float, total_vocab_size: int, group_name: str | None, vocab_start: int,
    reduction: str, return_metrics: bool, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
    lse_of_all_rows: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, num_correct, entropy_sum, grad_hidden, grad_weight, grad_bias); the
    gradients are computed in the same sweep (for grad_output 1) where asked, else empty.
    With a ``group_name``, weight and bias are the rows [vocab_start, vocab_start + V) of a
    vocabulary of ``total_vocab_size`` sharded over that group's ranks. The lse of rows with
    an ignored target is 0 unless ``lse_of_all_rows``."""
    opts = _options(ignore_index, logit_scale, softcap, label_smoothing, z_loss_scale, total_vocab_size,
                    return_metrics)
    with _no_autocast(hidden):  # the inputs are cast already; matmuls inside keep their dtype
        res = _chunked.forward(hidden, weight, targets, bias, opts, reduction,
                               (grad_hidden, grad_weight, grad_bias), _shard(group_name, vocab_start, total_vocab_size),
                               all_rows=lse_of_all_rows)
    return (
        res.loss, res.lse, res.num_correct, res.entropy_sum,
        _or_empty(res.grad_hidden, hidden), _or_empty(res.grad_weight, hidden), _or_empty(res.grad_bias, hidden),
    )


@forward_op.register_fake
def _(hidden, weight, targets, bias, ignore_index, logit_scale, softcap, label_smoothing, z_loss_scale,
      total_vocab_size, group_name, vocab_start, reduction, return_metrics, grad_hidden, grad_weight, grad_bias,
      lse_of_all_rows=False):
    n_rows = hidden.shape[0]
    f32 = dict(device=hidden.device, dtype=torch.float32)
    return (
        hidden.new_empty((n_rows,) if reduction == "none" else (), dtype=torch.float32),
        hidden.new_empty((n_rows,), dtype=torch.float32),
        torch.empty((), device=hidden.device, dtype=torch.int64),
        torch.empty((), **f32),
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        hidden.new_empty(weight.shape if grad_weight else (0,)),
        hidden.new_empty(bias.shape if grad_bias else (0,)),
    )


@torch.library.custom_op(f"{NAMESPACE}::backward", mutates_args=())
def backward_op(
    hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, lse: Tensor,
    loss_grad: Tensor, lse_grad: Tensor | None,
    ignore_index: int, logit_scale: float, softcap: float | None, label_smoothing: float,
    z_loss_scale: float, total_vocab_size: int, group_name: str | None, vocab_start: int,
    grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients by recomputation for a per-row ``loss_grad`` [N] and optional ``lse_grad`` [N]."""
    opts = _options(ignore_index, logit_scale, softcap, label_smoothing, z_loss_scale, total_vocab_size)
    with _no_autocast(hidden):
        grads = _chunked.backward(hidden, weight, targets, bias, lse, loss_grad, lse_grad, opts,
                                  (grad_hidden, grad_weight, grad_bias),
                                  _shard(group_name, vocab_start, total_vocab_size))
    return tuple(_or_empty(g, hidden) for g in grads)


@backward_op.register_fake
def _(hidden, weight, targets, bias, lse, loss_grad, lse_grad, ignore_index, logit_scale, softcap,
      label_smoothing, z_loss_scale, total_vocab_size, group_name, vocab_start, grad_hidden, grad_weight, grad_bias):
    return (
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        hidden.new_empty(weight.shape if grad_weight else (0,)),
        hidden.new_empty(bias.shape if grad_bias else (0,)),
    )


@torch.library.custom_op(f"{NAMESPACE}::scale_", mutates_args=("x",))
def scale_op(x: Tensor, scale: Tensor) -> None:
    """x *= scale in place (scale: a 0-d or 1-element tensor)."""
    scale = scale.detach().reshape(1).to(torch.float32)
    _chunked.backend_for(x.device).scale_(x, scale)


@scale_op.register_fake
def _(x, scale):
    return None


# ---- autograd ---------------------------------------------------------------------------
_EAGER, _RECOMPUTE = 0, 1


def _setup_context(ctx, inputs, output):
    (hidden, weight, targets, bias, ignore_index, logit_scale, softcap, label_smoothing, z_loss_scale,
     total_vocab_size, group_name, vocab_start, reduction, _, grad_hidden, grad_weight, grad_bias, _) = inputs
    loss, lse, num_correct, entropy_sum, saved_grad_hidden, saved_grad_weight, saved_grad_bias = output
    ctx.mark_non_differentiable(num_correct, entropy_sum, saved_grad_hidden, saved_grad_weight, saved_grad_bias)
    # Unused outputs get None, not zeros: materialising a zero grad_weight-sized tensor
    # would cost V x H memory and a fill.
    ctx.set_materialize_grads(False)
    ctx.options = (ignore_index, logit_scale, softcap, label_smoothing, z_loss_scale, total_vocab_size,
                   group_name, vocab_start)
    ctx.reduction = reduction
    ctx.has_bias = bias is not None
    ctx.path = _EAGER if (grad_hidden or grad_weight or grad_bias) else _RECOMPUTE
    ctx.consumed = False
    if ctx.path == _EAGER:
        ctx.save_for_backward(saved_grad_hidden, saved_grad_weight, saved_grad_bias)
    else:
        ctx.save_for_backward(hidden, weight, targets, bias, lse)


def _backward(ctx, loss_grad, lse_grad, *unused):
    needs = ctx.needs_input_grad
    if loss_grad is None and lse_grad is None:
        return (None,) * 18
    if loss_grad is None:  # only the returned lse was used
        loss_grad = lse_grad.new_zeros(() if ctx.reduction != "none" else lse_grad.shape)
    want = (needs[0], needs[1], ctx.has_bias and needs[3])
    if ctx.path == _EAGER:
        # The gradients were computed in the forward for grad_output = 1: scale them in
        # place (no copy), which can only be done once.
        if ctx.consumed:
            raise RuntimeError(
                "fused_linear_cross_entropy computed its gradients in the forward and they were "
                "already used: backward through it twice (retain_graph=True) is not supported."
            )
        ctx.consumed = True
        grads = list(ctx.saved_tensors)
        for g in grads:
            if g.numel():
                scale_op(g, loss_grad)
    else:
        hidden, weight, targets, bias, lse = ctx.saved_tensors
        row_grad = _chunked.row_loss_grad(targets, _options(*ctx.options[:6]), ctx.reduction, loss_grad)
        if lse_grad is not None:  # autograd may hand an expanded (stride 0) tensor
            lse_grad = lse_grad.float().contiguous()
        grads = backward_op(hidden, weight, targets, bias, lse, row_grad, lse_grad, *ctx.options, *want)
    grads = [g if w else None for g, w in zip(grads, want, strict=True)]
    return grads[0], grads[1], None, grads[2], *([None] * 14)


forward_op.register_autograd(_backward, setup_context=_setup_context)
