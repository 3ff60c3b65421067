"""torch.library operators and their autograd: what torch.compile and CUDA graphs see.

The operators are opaque to the compiler (one fake implementation each) and are named in
the namespace of the package as it was imported: ``fused_linear_ce`` when installed with
pip, the kernel's unique id when loaded by ``kernels`` (so two loaded versions never clash).

Under torch.func transforms the same operators run inside ``FunctorchLoss``, an
autograd.Function with ``setup_context``, which is what those transforms require.
"""

import contextlib
import weakref

import torch
from torch import Tensor

from . import _chunked
from ._distributed import Shard, resolve_group
from ._options import LossOptions, accumulation_dtype

NAMESPACE = __name__.split(".")[0]


def _shard(opts: LossOptions) -> Shard | None:
    # Operators take the group's registered name: a ProcessGroup is no schema type.
    if opts.group_name is None:
        return None
    return Shard(resolve_group(opts.group_name), opts.vocab_start, opts.total_vocab_size)


def _no_autocast(t: Tensor):
    """A context without autocast on ``t``'s device (a no-op where it is off: entering an
    autocast context costs host time at every call)."""
    if not torch.is_autocast_enabled(t.device.type):
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return like.new_empty(0) if t is None else t


def _traced(op, eager, probe: Tensor):
    """``op`` (a torch.library operator) where traced or transformed, else its implementation
    ``eager``. Traced: while dynamo compiles, or where ``probe`` (one of the call's tensors) is of a
    subclass, as the fake and functional tensors that AOTAutograd traces a compiled backward with;
    transformed: ``probe`` wrapped by a torch.func transform, which the operator unwraps. In eager
    mode the operator's dispatch is host time at every call and, at the first, imports
    torch._dynamo, as PyTorch wraps the implementation to be skipped by it (docs/design.md, "The
    cold start")."""
    if (torch.compiler.is_compiling() or type(probe) not in (Tensor, torch.nn.Parameter)
            or torch._C._functorch.is_functorch_wrapped_tensor(probe)):
        return op
    return eager


_NUM_OPTIONS = LossOptions.num_op_args()
_FORWARD_FLAGS = ("str reduction, bool return_metrics, bool grad_hidden, bool grad_weight, bool grad_bias, "
                  "bool lse_of_all_rows")
_FORWARD_SCHEMA = (f"(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, Tensor? class_weight, "
                   f"{LossOptions.op_schema()}, {_FORWARD_FLAGS}) -> ({', '.join(['Tensor'] * 10)})")
_BACKWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, Tensor? class_weight, Tensor lse, "
                    f"Tensor loss_grad, Tensor? lse_grad, {LossOptions.op_schema()}, "
                    "bool grad_hidden, bool grad_weight, bool grad_bias) -> (Tensor, Tensor, Tensor)")


def _forward_args(args: tuple):
    """(options, reduction, return_metrics, (grad_hidden, grad_weight, grad_bias), lse_of_all_rows)
    from forward_op's arguments after its five tensors."""
    reduction, return_metrics, *grads, all_rows = args[_NUM_OPTIONS:]
    return LossOptions.from_op_args(args), reduction, return_metrics, tuple(grads), all_rows


def _forward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, class_weight: Tensor | None,
               *args) -> tuple[Tensor, ...]:
    """(loss, lse, num_correct, entropy_sum, grad_hidden, grad_weight, grad_bias, prediction,
    correct, entropy) of the loss that ``args`` define: the ``LossOptions`` as flat arguments
    (``LossOptions.op_args``), then reduction, return_metrics, which gradients to compute in the
    same sweep (for grad_output 1; else empty) and lse_of_all_rows. The last three outputs are
    per row with ``return_metrics``, else empty. With a ``group_name``, weight and bias are the
    rows [vocab_start, vocab_start + V) of a vocabulary of ``total_vocab_size`` sharded over that
    group's ranks; ``class_weight`` [that total V] (fp32, fp64 for fp64 inputs) weights the
    classes. Rows with an ignored target are skipped (lse 0, prediction -1) unless
    ``lse_of_all_rows``."""
    opts, reduction, return_metrics, grads, all_rows = _forward_args(args)
    # (the public function warms up too, before its range check; a compiled graph reaches only this)
    _chunked.backend_for(hidden.device).precompile("metrics" if return_metrics else "loss", hidden.device)
    with _no_autocast(hidden):  # the inputs are cast already; matmuls inside keep their dtype
        res = _chunked.forward(hidden, weight, targets, bias, opts, reduction, grads, _shard(opts), class_weight,
                               all_rows=all_rows, return_metrics=return_metrics)
    no_row = hidden.new_empty(0, dtype=torch.int64)
    return (
        res.loss, res.lse, res.num_correct, res.entropy_sum,
        _or_empty(res.grad_hidden, hidden), _or_empty(res.grad_weight, hidden), _or_empty(res.grad_bias, hidden),
        _or_empty(res.prediction, no_row), _or_empty(res.correct, no_row).bool(), _or_empty(res.entropy, res.lse),
    )


forward_op = torch.library.custom_op(f"{NAMESPACE}::forward", _forward, mutates_args=(), schema=_FORWARD_SCHEMA)


@forward_op.register_fake
def _(hidden, weight, targets, bias, class_weight, *args):
    _, reduction, return_metrics, (grad_hidden, grad_weight, grad_bias), _ = _forward_args(args)
    n_rows = hidden.shape[0]
    acc = dict(device=hidden.device, dtype=accumulation_dtype(hidden.dtype))
    per_row = (n_rows,) if return_metrics else (0,)
    return (
        hidden.new_empty((n_rows,) if reduction == "none" else (), **acc),
        hidden.new_empty((n_rows,), **acc),
        torch.empty((), device=hidden.device, dtype=torch.int64),
        torch.empty((), **acc),
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        hidden.new_empty(weight.shape if grad_weight else (0,)),
        hidden.new_empty(bias.shape if grad_bias else (0,)),
        torch.empty(per_row, device=hidden.device, dtype=torch.int64),
        torch.empty(per_row, device=hidden.device, dtype=torch.bool),
        torch.empty(per_row, **acc),
    )


def _backward_grads(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, class_weight: Tensor | None,
                lse: Tensor, loss_grad: Tensor, lse_grad: Tensor | None, *args) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients by recomputation for a per-row ``loss_grad`` [N] (d out / d loss_i) and optional
    ``lse_grad`` [N]; ``args``: the ``LossOptions`` as flat arguments, then which gradients."""
    opts, grads = LossOptions.from_op_args(args), tuple(args[_NUM_OPTIONS:])
    with _no_autocast(hidden):
        grads = _chunked.backward(hidden, weight, targets, bias, lse, loss_grad, lse_grad, opts, grads,
                                  _shard(opts), class_weight)
    return tuple(_or_empty(g, hidden) for g in grads)


backward_op = torch.library.custom_op(f"{NAMESPACE}::backward", _backward_grads, mutates_args=(),
                                      schema=_BACKWARD_SCHEMA)


@backward_op.register_fake
def _(hidden, weight, targets, bias, class_weight, lse, loss_grad, lse_grad, *args):
    grad_hidden, grad_weight, grad_bias = args[_NUM_OPTIONS:]
    return (
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        hidden.new_empty(weight.shape if grad_weight else (0,)),
        hidden.new_empty(bias.shape if grad_bias else (0,)),
    )


def _scale(x: Tensor, scale: Tensor) -> None:
    """x *= scale in place (scale: a 0-d or 1-element tensor)."""
    _chunked.backend_for(x.device).scale_(x, scale.detach().reshape(1).to(torch.float32))


scale_op = torch.library.custom_op(f"{NAMESPACE}::scale_", _scale, mutates_args=("x",))


@scale_op.register_fake
def _(x, scale):
    return None


def _scale_in_place(x: Tensor, scale: Tensor) -> None:
    """x *= scale: ``scale_op`` where traced, the backend's kernel directly in eager mode."""
    _traced(scale_op, _scale, x)(x, scale)


def _vmap_per_sample(op):
    """A vmap rule that runs ``op`` once per sample and stacks the results (what PyTorch's
    fallback does, without its warning that asks for a batching rule)."""

    def rule(info, in_dims, *args):
        def sample(i):
            return op(*(a if dim is None else a.select(dim, i) for a, dim in zip(args, in_dims, strict=True)))

        samples = [sample(i) for i in range(info.batch_size)]
        outputs = tuple(torch.stack(parts) for parts in zip(*samples, strict=True))
        return outputs, (0,) * len(outputs)

    op.register_vmap(rule)


_vmap_per_sample(forward_op)
_vmap_per_sample(backward_op)


# ---- autograd ---------------------------------------------------------------------------
_EAGER, _RECOMPUTE = 0, 1
_NUM_INPUTS = 5 + _NUM_OPTIONS + 6  # forward_op's arguments: tensors, options, flags

DOUBLE_BACKWARD_ERROR = (
    "fused_linear_cross_entropy does not support double backward: its backward is not differentiable, so "
    "a backward with create_graph=True (a gradient penalty, a Hessian-vector product) or torch.func.grad "
    "of a grad is refused. Compute such terms from materialised logits, with F.linear + F.cross_entropy."
)
FORWARD_AD_ERROR = (
    "fused_linear_cross_entropy does not support forward-mode AD (torch.func.jvp, jacfwd, hessian, "
    "torch.autograd.forward_ad); reverse mode works under torch.func.grad, vjp, jacrev and vmap."
)


class _FirstOrderOnly(torch.autograd.Function):
    """Passes gradients through unchanged, as functions of the loss's inputs (the anchors) whose
    derivative raises."""

    generate_vmap_rule = True

    @staticmethod
    def forward(num_anchors, *anchors_and_grads):
        return tuple(g.view_as(g) for g in anchors_and_grads[num_anchors:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grad_grads):
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _first_order_only(grads: list, anchors) -> list:
    """The gradients under torch.func, where the backward always runs with a graph (as with
    create_graph=True): made to depend on the loss's inputs ``anchors`` through a function whose
    derivative raises, so that a grad of the grad fails instead of taking them for constants
    (which would silently drop, say, a gradient penalty's second term)."""
    if not torch.is_grad_enabled():
        return grads
    anchors = [a for a in anchors if a is not None]
    present = [g for g in grads if g is not None]
    wrapped = iter(_FirstOrderOnly.apply(len(anchors), *anchors, *present))
    return [None if g is None else next(wrapped) for g in grads]


def _forward_versions(*tensors) -> list:
    """(weak reference, version) of the tensors whose forward-time values the in-forward
    gradients are computed from, through the tensor that owns their version counter (a view's
    base). Weak references: holding hidden would keep it alive until the backward."""
    if torch.compiler.is_compiling():
        return []
    watched = []
    for t in tensors:
        if t is None or t.is_inference():
            continue
        owner = t if t._base is None else t._base
        watched.append((weakref.ref(owner), owner._version))
    return watched


def _check_versions(watched: list) -> None:
    """PyTorch's error for a saved tensor modified in place between the forward and the backward."""
    for ref, version in watched:
        owner = ref()
        if owner is not None and owner._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{owner.type()} {list(owner.shape)}] is at version {owner._version}; expected "
                f"version {version} instead. fused_linear_cross_entropy computed its gradients from the values "
                "its forward saw."
            )


def _recomputed_grads(saved, opts: LossOptions, reduction: str, loss_grad, lse_grad, want) -> list:
    """Gradients (hidden, weight, bias) of the saved forward by recomputation."""
    hidden, weight, targets, bias, class_weight, lse = saved
    if loss_grad is None:  # only the returned lse was used
        loss_grad = lse_grad.new_zeros(() if reduction != "none" else lse_grad.shape)
    row_weight = _chunked.row_weights(targets, class_weight, opts.ignore_index)
    if lse_grad is not None:  # autograd may hand an expanded (stride 0) tensor
        lse_grad = lse_grad.to(lse.dtype).contiguous()
    row_grad, lse_grad = _chunked.recomputed_row_grads(targets, opts, reduction, loss_grad, lse_grad, lse, row_weight)
    grads = _traced(backward_op, _backward_grads, hidden)(hidden, weight, targets, bias, class_weight, lse, row_grad,
                                                          lse_grad, *opts.op_args(), *want)
    return [g if w else None for g, w in zip(grads, want, strict=True)]


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, class_weight, *args = inputs
    opts, reduction, _, (grad_hidden, grad_weight, grad_bias), _ = _forward_args(args)
    loss, lse, *rest = output
    num_correct, entropy_sum, saved_grad_hidden, saved_grad_weight, saved_grad_bias = rest[:5]
    ctx.mark_non_differentiable(*rest)
    # Unused outputs get None, not zeros: materialising a zero grad_weight-sized tensor
    # would cost V x H memory and a fill.
    ctx.set_materialize_grads(False)
    ctx.options = opts
    ctx.reduction = reduction
    ctx.has_bias = bias is not None
    ctx.path = _EAGER if (grad_hidden or grad_weight or grad_bias) else _RECOMPUTE
    ctx.consumed = False
    if ctx.path == _EAGER:
        ctx.save_for_backward(saved_grad_hidden, saved_grad_weight, saved_grad_bias)
        # What PyTorch's F.linear + F.cross_entropy would save (not the bias): checked in the backward.
        ctx.watched = _forward_versions(hidden, weight, targets, class_weight)
    else:
        # The bias as the forward saw it: F.linear does not save its bias, so changing it in place
        # before the backward neither raises nor changes the gradients there; hidden, weight,
        # targets and class_weight are saved as PyTorch saves them (an in-place change raises).
        ctx.save_for_backward(hidden, weight, targets, None if bias is None else bias.detach().clone(),
                              class_weight, lse)


def _backward(ctx, loss_grad, lse_grad, *unused):
    needs = ctx.needs_input_grad
    if loss_grad is None and lse_grad is None:
        return (None,) * _NUM_INPUTS
    if torch.is_grad_enabled():  # create_graph=True: the gradients would be taken for constants
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)
    want = (needs[0], needs[1], ctx.has_bias and needs[3])
    if ctx.path == _EAGER:
        _check_versions(ctx.watched)
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
                _scale_in_place(g, loss_grad)
        grads = [g if w else None for g, w in zip(grads, want, strict=True)]
    else:
        grads = _recomputed_grads(ctx.saved_tensors, ctx.options, ctx.reduction, loss_grad, lse_grad, want)
    return grads[0], grads[1], None, grads[2], *([None] * (_NUM_INPUTS - 4))


forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerForward(torch.autograd.Function):
    """``forward_op`` in eager mode: the same forward, context and backward without the operator's
    dispatch (``_traced``). Its ``forward`` takes ``ctx`` rather than having a ``setup_context``:
    with one, ``Function.apply`` binds the arguments to ``forward``'s signature through
    ``inspect`` at every call, host time that the GPU waits for where the caller has just
    synchronised."""

    @staticmethod
    def forward(ctx, *args):
        output = _forward(*args)
        _setup_context(ctx, args, output)
        return output

    backward = staticmethod(_backward)


def loss_forward(*args) -> tuple[Tensor, ...]:
    """``forward_op(*args)``: the operator where traced, ``_EagerForward`` otherwise."""
    return _traced(forward_op, _EagerForward.apply, args[0])(*args)


class FunctorchLoss(torch.autograd.Function):
    """The loss under torch.func transforms (grad, vjp, jacrev, vmap, and compositions of them),
    which need an autograd.Function with ``setup_context``: a custom op's registered autograd is
    invisible to them. Gradients are always recomputed in the backward (which may then run more
    than once, e.g. under jacrev); vmap runs the operators once per sample."""

    generate_vmap_rule = True

    @staticmethod
    def forward(hidden, weight, targets, bias, class_weight, options: LossOptions, reduction, return_metrics):
        out = forward_op(hidden, weight, targets, bias, class_weight, *options.op_args(), reduction, return_metrics,
                         False, False, False, True)
        return out[:4] + out[7:]  # loss, lse, num_correct, entropy_sum, prediction, correct, entropy

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, targets, bias, class_weight, options, reduction, _ = inputs
        ctx.mark_non_differentiable(*output[2:])
        ctx.options, ctx.reduction, ctx.has_bias = options, reduction, bias is not None
        ctx.save_for_backward(hidden, weight, targets, bias, class_weight, output[1])

    @staticmethod
    def backward(ctx, loss_grad, lse_grad, *unused):
        needs = ctx.needs_input_grad
        want = (needs[0], needs[1], ctx.has_bias and needs[3])
        saved = ctx.saved_tensors
        with torch.no_grad():
            grads = _recomputed_grads(saved, ctx.options, ctx.reduction, loss_grad, lse_grad, want)
        grads = _first_order_only(grads, anchors=(saved[0], saved[1], saved[3]))
        return grads[0], grads[1], None, grads[2], None, None, None, None

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(FORWARD_AD_ERROR)


# ---- per-token outputs ------------------------------------------------------------------
_TOKEN_FLAGS = ("str outputs, bool metrics, bool logit_sum, bool sum_sq, bool grad_hidden, bool grad_weight, "
                "bool grad_bias")
_TOKEN_FORWARD_SCHEMA = (f"(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, {LossOptions.op_schema()}, "
                         f"{_TOKEN_FLAGS}) -> ({', '.join(['Tensor'] * 9)})")
_TOKEN_BACKWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, Tensor lse, Tensor loss_grad, "
                          f"Tensor? lse_grad, Tensor? entropy_grad, {LossOptions.op_schema()}, "
                          "bool grad_hidden, bool grad_weight, bool grad_bias) -> (Tensor, Tensor, Tensor)")


def _token_outputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, *args,
                   keep: bool = False) -> tuple[tuple[Tensor, ...], "_chunked._kept.KeptRows | None"]:
    """(``_token_forward``'s outputs, what the forward kept for its backward): with ``keep`` (no
    gradients in the sweep) the rows that ``_kept`` keeps, None without."""
    opts = LossOptions.from_op_args(args)
    _, metrics, logit_sum, sum_sq, *grads = args[_NUM_OPTIONS:]
    _chunked.backend_for(hidden.device).precompile("tokens:" + args[_NUM_OPTIONS], hidden.device)  # (as in _forward)
    with _no_autocast(hidden):
        res = _chunked.forward(hidden, weight, targets, bias, opts, "none", tuple(grads), return_metrics=metrics,
                               logit_sum=logit_sum, sum_sq=sum_sq, match_training=True, grad_reduction="mean",
                               keep=keep)
    def wanted(flag, t):  # (a new empty tensor for each output left out: outputs may not alias)
        return t if flag else res.lse.new_empty(0, dtype=t.dtype if t is not None else None)

    return (
        res.lse, res.loss.neg(), wanted(metrics, res.entropy),
        res.correct.bool() if metrics else res.lse.new_empty(0, dtype=torch.bool),
        wanted(logit_sum, res.mean_logit), wanted(sum_sq, res.log_sum_sq),
        _or_empty(res.grad_hidden, hidden), _or_empty(res.grad_weight, hidden), _or_empty(res.grad_bias, hidden),
    ), res.kept


def _token_forward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                   *args) -> tuple[Tensor, ...]:
    """(lse, log_probs, entropy, is_top1, mean_logits, log_sum_sq_probs, grad_hidden, grad_weight,
    grad_bias), all per row [N] but the gradients, of the loss options in ``args`` (flat, then
    the outputs' names, which statistics: metrics (entropy and is_top1), the logit sum, the sum of
    squares, then which gradients to compute in the same sweep). Statistics not asked for are empty. The gradients are
    those of -mean_i log_probs_i over the n rows with a target (d out / d log_probs_i = -1 / n,
    rounded as PyTorch's), a trainer's usual loss; empty when not asked for. Rows whose target is
    ``ignore_index`` get 0 (False) everywhere."""
    return _token_outputs(hidden, weight, targets, bias, *args)[0]


token_forward_op = torch.library.custom_op(f"{NAMESPACE}::token_forward", _token_forward, mutates_args=(),
                                           schema=_TOKEN_FORWARD_SCHEMA)


@token_forward_op.register_fake
def _(hidden, weight, targets, bias, *args):
    _, metrics, logit_sum, sum_sq, grad_hidden, grad_weight, grad_bias = args[_NUM_OPTIONS:]
    n_rows = hidden.shape[0]
    acc = dict(device=hidden.device, dtype=accumulation_dtype(hidden.dtype))

    def per_row(wanted, dtype=None):
        return torch.empty((n_rows,) if wanted else (0,), device=hidden.device, dtype=dtype or acc["dtype"])

    return (
        per_row(True), per_row(True), per_row(metrics), per_row(metrics, torch.bool), per_row(logit_sum),
        per_row(sum_sq),
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        hidden.new_empty(weight.shape if grad_weight else (0,)),
        hidden.new_empty(bias.shape if grad_bias else (0,)),
    )


def _token_backward_grads(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, lse: Tensor,
                      loss_grad: Tensor, lse_grad: Tensor | None, entropy_grad: Tensor | None,
                      *args) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients by recomputation for the per-row coefficients: ``loss_grad`` [N] of the loss
    lse - z_t (minus d out / d log_probs), ``lse_grad`` [N] of lse, ``entropy_grad`` [N] of the
    entropy (its -e H part inside ``lse_grad``); ``args``: the options, then which gradients."""
    opts, grads = LossOptions.from_op_args(args), tuple(args[_NUM_OPTIONS:])
    with _no_autocast(hidden):
        grads = _chunked.backward(hidden, weight, targets, bias, lse, loss_grad, lse_grad, opts, grads,
                                  entropy_grad=entropy_grad)
    return tuple(_or_empty(g, hidden) for g in grads)


token_backward_op = torch.library.custom_op(f"{NAMESPACE}::token_backward", _token_backward_grads, mutates_args=(),
                                            schema=_TOKEN_BACKWARD_SCHEMA)


@token_backward_op.register_fake
def _(hidden, weight, targets, bias, lse, loss_grad, lse_grad, entropy_grad, *args):
    grad_hidden, grad_weight, grad_bias = args[_NUM_OPTIONS:]
    return (
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        hidden.new_empty(weight.shape if grad_weight else (0,)),
        hidden.new_empty(bias.shape if grad_bias else (0,)),
    )


# Whether a backward of per-token outputs last found d out / d log_probs equal on every row with
# a target (and no entropy gradient): then the gradients made in the forward's sweep, scaled, are
# exact. Keyed by the outputs asked for ("entropy,log_probs"): a trainer whose loss weights its
# tokens alike (SFT's NLL) keeps the sweep's gradients, one whose weights differ (RL, preference
# losses) recomputes them after its first step. A backward that did not take the sweep's
# gradients still checks its weights (one small launch, read by the next forward: ``_pending``),
# so that the sweep re-arms once they are equal again: [sft, sft, rl, sft, sft] computes the
# gradients in the sweep of calls 1, 2, 3 and 5 (call 3's backward finds them unequal and
# recomputes, call 4's finds them equal).
_uniform_grads: dict[str, bool] = {}
_pending: dict[str, tuple] = {}  # outputs -> (host flag [1], ready event or None), from a later backward


def speculates(outputs: str) -> bool:
    """Whether a per-token forward of ``outputs`` computes gradients in its sweep by default (its
    caller's ``grad_in_forward`` None): unless the last backward of those outputs found unequal weights."""
    pending = _pending.pop(outputs, None)
    if pending is not None:
        flag, ready = pending
        if ready is not None:
            ready.synchronize()  # (long done: queued in the last backward)
        _uniform_grads[outputs] = bool(flag[0] == 1.0)
    return _uniform_grads.get(outputs, True)


def _recheck_weights(key: str, log_prob_grad: Tensor, targets: Tensor, ignore_index: int) -> None:
    """Queues the check of a backward that did not take the sweep's gradients, while the sweep is
    off for ``key``: whether the weights were equal, for ``speculates`` to read (no host wait here)."""
    if _uniform_grads.get(key) is not False or (targets.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    found = _chunked.backend_for(targets.device).mean_grad_ratio(log_prob_grad.float().contiguous(), targets,
                                                                 ignore_index)
    _pending[key] = _chunked.copy_to_host(found[:1])


def _token_setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, *args = inputs
    opts = LossOptions.from_op_args(args)
    outputs, metrics, logit_sum, sum_sq, *grads = args[_NUM_OPTIONS:]
    lse, log_probs, entropy, *rest = output
    ctx.mark_non_differentiable(lse, *rest)
    ctx.set_materialize_grads(False)
    ctx.options = opts
    ctx.has_bias = bias is not None
    ctx.speculated = any(grads)
    ctx.consumed = False
    ctx.key = outputs
    ctx.kept = None  # what the eager forward kept (``_EagerTokenForward``)
    saved_grads = rest[3:] if ctx.speculated else ()
    ctx.save_for_backward(hidden, weight, targets, None if bias is None else bias.detach().clone(), lse,
                          entropy if metrics else None, *saved_grads)


def _mean_grad_ratio(log_prob_grad: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, bool, float]:
    """(ratio, uniform, host_ratio): whether ``log_prob_grad`` [N] is one value c on every row with
    a target, and -c / w with w = 1 / their count, on the device (``ratio`` [1] fp32) and on the
    host (one sync: the last launch queued is the one that finds them)."""
    found = _chunked.backend_for(targets.device).mean_grad_ratio(log_prob_grad.float().contiguous(), targets,
                                                                 ignore_index)
    uniform, ratio = found.tolist()
    return found[1:], uniform == 1.0, ratio


def _token_backward(ctx, lse_grad, log_prob_grad, entropy_grad, *unused):
    if log_prob_grad is None and entropy_grad is None:
        return (None,) * (4 + _NUM_OPTIONS + 7)
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)
    needs = ctx.needs_input_grad
    want = (needs[0], needs[1], ctx.has_bias and needs[3])
    hidden, weight, targets, bias, lse, entropy, *saved_grads = ctx.saved_tensors
    opts = ctx.options
    if ctx.speculated:
        if ctx.consumed:
            raise RuntimeError("fused_linear_log_probs computed its gradients in the forward and they were already "
                               "used: backward through it twice (retain_graph=True) is not supported.")
        ctx.consumed = True
        if entropy_grad is None and log_prob_grad is not None:
            # The sweep's gradients are those of -mean log_probs, each row weighted w = 1 / n: times
            # -c / w they are exact if every row's weight is c, and untouched (no pass over them)
            # where c = -1 / n, as a trainer that divides by this call's rows gives: the host reads
            # whether the weights are equal and the ratio (one sync), and launches no pass then.
            ratio, uniform, host_ratio = _mean_grad_ratio(log_prob_grad, targets, opts.ignore_index)
            grads = []
            for g, w in zip(saved_grads, want, strict=True):
                if uniform and host_ratio != 1.0 and w and g.numel():
                    _scale_in_place(g, ratio)
                grads.append(g if w else None)
            _uniform_grads[ctx.key] = uniform
            if uniform:
                return grads[0], grads[1], None, grads[2], *([None] * (_NUM_OPTIONS + 7))
        else:
            _uniform_grads[ctx.key] = False
    elif log_prob_grad is not None and entropy_grad is None:
        _recheck_weights(ctx.key, log_prob_grad, targets, opts.ignore_index)
    valid = targets != opts.ignore_index
    zero = torch.zeros((), device=lse.device, dtype=lse.dtype)
    loss_grad = zero.expand_as(lse) if log_prob_grad is None else torch.where(valid, -log_prob_grad.to(lse.dtype), zero)
    row_entropy_grad, row_lse_grad = None, None
    if entropy_grad is not None:
        row_entropy_grad = torch.where(valid, entropy_grad.to(lse.dtype), zero).contiguous()
        row_lse_grad = -row_entropy_grad * entropy  # d H / d z_j = -p_j (log p_j + H): the H part
    kept, ctx.kept = ctx.kept, None  # used once: the backward turns its buffers into grad logits
    if kept is not None:
        with _no_autocast(hidden):
            grads = _chunked.backward(hidden, weight, targets, bias, lse, loss_grad.contiguous(), row_lse_grad, opts,
                                      want, entropy_grad=row_entropy_grad, kept=kept)
    else:
        grads = _traced(token_backward_op, _token_backward_grads, hidden)(
            hidden, weight, targets, bias, lse, loss_grad.contiguous(), row_lse_grad, row_entropy_grad,
            *opts.op_args(), *want)
    grads = [g if w else None for g, w in zip(grads, want, strict=True)]
    return grads[0], grads[1], None, grads[2], *([None] * (_NUM_OPTIONS + 7))


token_forward_op.register_autograd(_token_backward, setup_context=_token_setup_context)


def _keeps_rows(ctx, hidden: Tensor, grads) -> bool:
    """Whether an eager per-token forward keeps rows for its backward (``_kept``): where gradients
    are wanted and not computed in the sweep; not for fp64 (gradcheck: recomputed, as the loss is)
    nor while a CUDA graph is captured."""
    needs = ctx.needs_input_grad
    if any(grads) or not (needs[0] or needs[1] or needs[3]) or hidden.dtype == torch.float64:
        return False
    return not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())


class _EagerTokenForward(torch.autograd.Function):
    """``token_forward_op`` in eager mode, as ``_EagerForward`` is ``forward_op``'s: TRL's head
    gathers the rows with a label, a sync, right before it. Only here does the forward keep rows
    for its backward (the operator's outputs are fixed tensors)."""

    @staticmethod
    def forward(ctx, *args):
        output, kept = _token_outputs(*args, keep=_keeps_rows(ctx, args[0], args[-3:]))
        _token_setup_context(ctx, args, output)
        ctx.kept = kept if kept is not None and kept.count > 0 else None
        return output

    backward = staticmethod(_token_backward)


def token_forward(*args) -> tuple[Tensor, ...]:
    """``token_forward_op(*args)``: the operator where traced, ``_EagerTokenForward`` otherwise."""
    return _traced(token_forward_op, _EagerTokenForward.apply, args[0])(*args)
