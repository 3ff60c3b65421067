"""torch.library operators and their autograd: what torch.compile and CUDA graphs see.

The operators are opaque to the compiler (one fake implementation each) and are named in
the namespace of the package as it was imported: ``fused_linear_ce`` when installed with
pip, the kernel's unique id when loaded by ``kernels`` (so two loaded versions never clash).

Each operator takes the call's ``Request`` as flat schema arguments (``Request.encode``, decoded
by ``Request.decode``) and names its outputs (``LossOutputs``, ``TokenOutputs``, ``Gradients``). In
eager mode the request passes as it is, through an autograd.Function, with no operator dispatch.

Under torch.func transforms the same operators run inside ``FunctorchLoss``, an
autograd.Function with ``setup_context``, which is what those transforms require.
"""

import contextlib
import weakref
from dataclasses import replace

import torch
from torch import Tensor

from . import _chunked, _plan
from ._gradients import _MM_OUT_DTYPE
from ._options import Gradients, LossOptions, LossOutputs, Request, TokenOutputs, accumulation_dtype, returns
from ._row_algebra import recomputed_row_grads, row_weights
from ._row_order import copy_to_host

NAMESPACE = __name__.split(".")[0]

# What the last backward of per-token outputs found, keyed by the outputs asked for
# ("entropy,log_probs"): read by ``fused_linear_log_probs`` through ``_plan.token_grads_in_forward``.
TOKEN_SPECULATION = _plan.Speculation()


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


def _is_traced(probe: Tensor) -> bool:
    """Whether a call with ``probe`` among its tensors takes the operators (``_traced``)."""
    return (torch.compiler.is_compiling() or type(probe) not in (Tensor, torch.nn.Parameter)
            or torch._C._functorch.is_functorch_wrapped_tensor(probe))


def _input_grads(num_inputs: int, grads) -> tuple:
    """An autograd backward's result for inputs (hidden, weight, targets, bias, ...): the three
    gradients in their places, None for the rest of the ``num_inputs``."""
    return (grads[0], grads[1], None, grads[2], *([None] * (num_inputs - 4)))


_FORWARD_SCHEMA = (f"(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, Tensor? class_weight, "
                   f"{Request.schema()}) -> {returns(LossOutputs)}")
_BACKWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, Tensor? class_weight, Tensor lse, "
                    f"Tensor loss_grad, Tensor? lse_grad, {Request.schema()}) -> {returns(Gradients)}")


def _forward_outputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                     class_weight: Tensor | None, request: Request) -> LossOutputs:
    """The ``LossOutputs`` of the loss that ``request`` defines, the gradients it asks for
    computed in the same sweep (for grad_output 1; else empty); prediction, correct and entropy
    per row with ``return_metrics``, else empty. With a process group, weight and bias are the
    rows [vocab_start, vocab_start + V) of a vocabulary of ``total_vocab_size`` sharded over that
    group's ranks; ``class_weight`` [that total V] (fp32, fp64 for fp64 inputs) weights the
    classes. Rows with an ignored target are skipped (lse 0, prediction -1) unless ``all_rows``."""
    # (the public function warms up too, before its range check; a compiled graph reaches only this)
    _chunked.backend_for(hidden.device).precompile("metrics" if request.return_metrics else "loss", hidden.device)
    with _no_autocast(hidden):  # the inputs are cast already; matmuls inside keep their dtype
        res = _chunked.forward(hidden, weight, targets, bias, request, class_weight)
    no_row = hidden.new_empty(0, dtype=torch.int64)
    return LossOutputs(
        res.loss, res.lse, res.num_correct, res.entropy_sum,
        _or_empty(res.grad_hidden, hidden), _or_empty(res.grad_weight, hidden), _or_empty(res.grad_bias, hidden),
        _or_empty(res.prediction, no_row), _or_empty(res.correct, no_row).bool(), _or_empty(res.entropy, res.lse),
    )


def _forward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, class_weight: Tensor | None,
             *args) -> tuple[Tensor, ...]:
    """``_forward_outputs`` of the request encoded in ``args`` (``Request.encode``)."""
    return tuple(_forward_outputs(hidden, weight, targets, bias, class_weight, Request.decode(args)))


forward_op = torch.library.custom_op(f"{NAMESPACE}::forward", _forward, mutates_args=(), schema=_FORWARD_SCHEMA)


@forward_op.register_fake
def _(hidden, weight, targets, bias, class_weight, *args):
    request = Request.decode(args)
    n_rows = hidden.shape[0]
    acc = dict(device=hidden.device, dtype=accumulation_dtype(hidden.dtype))
    per_row = (n_rows,) if request.return_metrics else (0,)
    return LossOutputs(
        loss=hidden.new_empty((n_rows,) if request.reduction == "none" else (), **acc),
        lse=hidden.new_empty((n_rows,), **acc),
        num_correct=torch.empty((), device=hidden.device, dtype=torch.int64),
        entropy_sum=torch.empty((), **acc),
        **_fake_grads(hidden, weight, bias, request)._asdict(),
        prediction=torch.empty(per_row, device=hidden.device, dtype=torch.int64),
        correct=torch.empty(per_row, device=hidden.device, dtype=torch.bool),
        entropy=torch.empty(per_row, **acc),
    )


def _fake_grads(hidden, weight, bias, request: Request) -> Gradients:
    return Gradients(
        hidden.new_empty(hidden.shape if request.grad_hidden else (0,)),
        hidden.new_empty(weight.shape if request.grad_weight else (0,)),
        hidden.new_empty(bias.shape if request.grad_bias else (0,)),
    )


def _backward_outputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                      class_weight: Tensor | None, lse: Tensor, loss_grad: Tensor, lse_grad: Tensor | None,
                      request: Request) -> Gradients:
    """Gradients (those of ``request.grads``) by recomputation for a per-row ``loss_grad`` [N]
    (d out / d loss_i) and optional ``lse_grad`` [N]."""
    with _no_autocast(hidden):
        grads = _chunked.backward(hidden, weight, targets, bias, lse, loss_grad, lse_grad, request, class_weight)
    return Gradients(*(_or_empty(g, hidden) for g in grads))


def _backward_grads(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, class_weight: Tensor | None,
                    lse: Tensor, loss_grad: Tensor, lse_grad: Tensor | None, *args) -> tuple[Tensor, Tensor, Tensor]:
    """``_backward_outputs`` of the request encoded in ``args``."""
    return tuple(_backward_outputs(hidden, weight, targets, bias, class_weight, lse, loss_grad, lse_grad,
                                   Request.decode(args)))


backward_op = torch.library.custom_op(f"{NAMESPACE}::backward", _backward_grads, mutates_args=(),
                                      schema=_BACKWARD_SCHEMA)


@backward_op.register_fake
def _(hidden, weight, targets, bias, class_weight, lse, loss_grad, lse_grad, *args):
    return tuple(_fake_grads(hidden, weight, bias, Request.decode(args)))


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


def _recompute(hidden, weight, targets, bias, class_weight, lse, loss_grad, lse_grad, request: Request) -> Gradients:
    """``backward_op`` where traced, its implementation directly in eager mode."""
    if _is_traced(hidden):
        return Gradients(*backward_op(hidden, weight, targets, bias, class_weight, lse, loss_grad, lse_grad,
                                      *request.encode()))
    return _backward_outputs(hidden, weight, targets, bias, class_weight, lse, loss_grad, lse_grad, request)


def _recomputed_grads(saved, request: Request, loss_grad, lse_grad, want) -> list:
    """Gradients (hidden, weight, bias) of the saved forward by recomputation."""
    hidden, weight, targets, bias, class_weight, lse = saved
    opts, reduction = request.options, request.reduction
    if loss_grad is None:  # only the returned lse was used
        loss_grad = lse_grad.new_zeros(() if reduction != "none" else lse_grad.shape)
    row_weight = row_weights(targets, class_weight, opts.ignore_index)
    if lse_grad is not None:  # autograd may hand an expanded (stride 0) tensor
        lse_grad = lse_grad.to(lse.dtype).contiguous()
    row_grad, lse_grad = recomputed_row_grads(targets, opts, reduction, loss_grad, lse_grad, lse, row_weight)
    grads = _recompute(hidden, weight, targets, bias, class_weight, lse, row_grad, lse_grad, request.with_grads(want))
    return [g if w else None for g, w in zip(grads, want, strict=True)]


def _setup(ctx, tensors: tuple, request: Request, output: LossOutputs, num_inputs: int) -> None:
    """The autograd context of a loss forward of ``tensors`` (hidden, weight, targets, bias,
    class_weight) under ``request``, for either form of the call (operator or eager)."""
    hidden, weight, targets, bias, class_weight = tensors
    ctx.mark_non_differentiable(output.num_correct, output.entropy_sum, output.grad_hidden, output.grad_weight,
                                output.grad_bias, output.prediction, output.correct, output.entropy)
    # Unused outputs get None, not zeros: materialising a zero grad_weight-sized tensor
    # would cost V x H memory and a fill.
    ctx.set_materialize_grads(False)
    ctx.request = request
    ctx.num_inputs = num_inputs
    ctx.has_bias = bias is not None
    ctx.path = _EAGER if any(request.grads) else _RECOMPUTE
    ctx.consumed = False
    if ctx.path == _EAGER:
        ctx.save_for_backward(output.grad_hidden, output.grad_weight, output.grad_bias)
        # What PyTorch's F.linear + F.cross_entropy would save (not the bias): checked in the backward.
        ctx.watched = _forward_versions(hidden, weight, targets, class_weight)
    else:
        # The bias as the forward saw it: F.linear does not save its bias, so changing it in place
        # before the backward neither raises nor changes the gradients there; hidden, weight,
        # targets and class_weight are saved as PyTorch saves them (an in-place change raises).
        ctx.save_for_backward(hidden, weight, targets, None if bias is None else bias.detach().clone(),
                              class_weight, output.lse)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, class_weight, *encoded = inputs
    _setup(ctx, (hidden, weight, targets, bias, class_weight), Request.decode(encoded), LossOutputs(*output),
           len(inputs))


def _backward(ctx, loss_grad, lse_grad, *unused):
    needs = ctx.needs_input_grad
    if loss_grad is None and lse_grad is None:
        return (None,) * ctx.num_inputs
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
        grads = _recomputed_grads(ctx.saved_tensors, ctx.request, loss_grad, lse_grad, want)
    return _input_grads(ctx.num_inputs, grads)


forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerForward(torch.autograd.Function):
    """``forward_op`` in eager mode: the same forward, context and backward without the operator's
    dispatch (``_traced``), the request passed as it is. Its ``forward`` takes ``ctx`` rather than
    having a ``setup_context``: with one, ``Function.apply`` binds the arguments to ``forward``'s
    signature through ``inspect`` at every call, host time that the GPU waits for where the caller
    has just synchronised."""

    @staticmethod
    def forward(ctx, *inputs):
        *tensors, request = inputs
        output = _forward_outputs(*tensors, request)
        _setup(ctx, tensors, request, output, len(inputs))
        return tuple(output)

    backward = staticmethod(_backward)


def loss_forward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, class_weight: Tensor | None,
                 request: Request) -> LossOutputs:
    """The loss's outputs: ``forward_op`` where traced, ``_EagerForward`` otherwise."""
    if _is_traced(hidden):
        return LossOutputs(*forward_op(hidden, weight, targets, bias, class_weight, *request.encode()))
    return LossOutputs(*_EagerForward.apply(hidden, weight, targets, bias, class_weight, request))


class FunctorchLoss(torch.autograd.Function):
    """The loss under torch.func transforms (grad, vjp, jacrev, vmap, and compositions of them),
    which need an autograd.Function with ``setup_context``: a custom op's registered autograd is
    invisible to them. Gradients are always recomputed in the backward (which may then run more
    than once, e.g. under jacrev); vmap runs the operators once per sample. Returns (loss, lse,
    num_correct, entropy_sum, prediction, correct, entropy)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(hidden, weight, targets, bias, class_weight, request: Request):
        out = LossOutputs(*forward_op(hidden, weight, targets, bias, class_weight,
                                      *replace(request.with_grads((False,) * 3), all_rows=True).encode()))
        return out.loss, out.lse, out.num_correct, out.entropy_sum, out.prediction, out.correct, out.entropy

    @staticmethod
    def setup_context(ctx, inputs, output):
        hidden, weight, targets, bias, class_weight, request = inputs
        loss, lse, *rest = output
        ctx.mark_non_differentiable(*rest)
        ctx.request, ctx.has_bias, ctx.num_inputs = request, bias is not None, len(inputs)
        ctx.save_for_backward(hidden, weight, targets, bias, class_weight, lse)

    @staticmethod
    def backward(ctx, loss_grad, lse_grad, *unused):
        needs = ctx.needs_input_grad
        want = (needs[0], needs[1], ctx.has_bias and needs[3])
        saved = ctx.saved_tensors
        with torch.no_grad():
            grads = _recomputed_grads(saved, ctx.request, loss_grad, lse_grad, want)
        grads = _first_order_only(grads, anchors=(saved[0], saved[1], saved[3]))
        return _input_grads(ctx.num_inputs, grads)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(FORWARD_AD_ERROR)


# ---- per-token outputs ------------------------------------------------------------------
_TOKEN_FORWARD_SCHEMA = (f"(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, {Request.schema()}) "
                         f"-> {returns(TokenOutputs)}")
_TOKEN_BACKWARD_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias, Tensor lse, Tensor loss_grad, "
                          f"Tensor? lse_grad, Tensor? entropy_grad, {Request.schema()}) -> {returns(Gradients)}")


def _token_outputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, request: Request,
                   keep: bool = False) -> tuple[TokenOutputs, "_chunked._kept.KeptRows | None"]:
    """(the ``TokenOutputs`` of ``request``, what the forward kept for its backward): with ``keep``
    (no gradients in the sweep) the rows that ``_kept`` keeps, None without.

    Per row [N] but the gradients: lse, log_probs, then entropy and is_top1 (with
    ``return_metrics``), mean_logits (``logit_sum``), log_sum_sq_probs (``sum_sq``): empty where
    not asked for. The gradients, those the request makes in the sweep (else empty), are those of
    -mean_i log_probs_i over the n rows with a target (d out / d log_probs_i = -1 / n, rounded as
    PyTorch's), a trainer's usual loss. Rows whose target is ``ignore_index`` get 0 (False)."""
    _chunked.backend_for(hidden.device).precompile("tokens:" + request.outputs, hidden.device)  # (as the loss's)
    with _no_autocast(hidden):
        res = _chunked.forward(hidden, weight, targets, bias, request, keep=keep)

    def wanted(flag, t):  # (a new empty tensor for each output left out: outputs may not alias)
        return t if flag else res.lse.new_empty(0, dtype=t.dtype if t is not None else None)

    metrics = request.return_metrics
    return TokenOutputs(
        res.lse, res.loss.neg(), wanted(metrics, res.entropy),
        res.correct.bool() if metrics else res.lse.new_empty(0, dtype=torch.bool),
        wanted(request.logit_sum, res.mean_logit), wanted(request.sum_sq, res.log_sum_sq),
        _or_empty(res.grad_hidden, hidden), _or_empty(res.grad_weight, hidden), _or_empty(res.grad_bias, hidden),
    ), res.kept


def _token_forward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                   *args) -> tuple[Tensor, ...]:
    """``_token_outputs`` of the request encoded in ``args``."""
    return tuple(_token_outputs(hidden, weight, targets, bias, Request.decode(args))[0])


token_forward_op = torch.library.custom_op(f"{NAMESPACE}::token_forward", _token_forward, mutates_args=(),
                                           schema=_TOKEN_FORWARD_SCHEMA)


@token_forward_op.register_fake
def _(hidden, weight, targets, bias, *args):
    request = Request.decode(args)
    n_rows = hidden.shape[0]
    acc = dict(device=hidden.device, dtype=accumulation_dtype(hidden.dtype))

    def per_row(wanted, dtype=None):
        return torch.empty((n_rows,) if wanted else (0,), device=hidden.device, dtype=dtype or acc["dtype"])

    metrics = request.return_metrics
    return TokenOutputs(
        per_row(True), per_row(True), per_row(metrics), per_row(metrics, torch.bool), per_row(request.logit_sum),
        per_row(request.sum_sq), *_fake_grads(hidden, weight, bias, request),
    )


def _token_backward_outputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, lse: Tensor,
                            loss_grad: Tensor, lse_grad: Tensor | None, entropy_grad: Tensor | None,
                            request: Request) -> Gradients:
    """Gradients by recomputation for the per-row coefficients: ``loss_grad`` [N] of the loss
    lse - z_t (minus d out / d log_probs), ``lse_grad`` [N] of lse, ``entropy_grad`` [N] of the
    entropy (its -e H part inside ``lse_grad``); those of ``request.grads``."""
    with _no_autocast(hidden):
        grads = _chunked.backward(hidden, weight, targets, bias, lse, loss_grad, lse_grad, request,
                                  entropy_grad=entropy_grad)
    return Gradients(*(_or_empty(g, hidden) for g in grads))


def _token_backward_grads(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, lse: Tensor,
                          loss_grad: Tensor, lse_grad: Tensor | None, entropy_grad: Tensor | None,
                          *args) -> tuple[Tensor, Tensor, Tensor]:
    """``_token_backward_outputs`` of the request encoded in ``args``."""
    return tuple(_token_backward_outputs(hidden, weight, targets, bias, lse, loss_grad, lse_grad, entropy_grad,
                                         Request.decode(args)))


token_backward_op = torch.library.custom_op(f"{NAMESPACE}::token_backward", _token_backward_grads, mutates_args=(),
                                            schema=_TOKEN_BACKWARD_SCHEMA)


@token_backward_op.register_fake
def _(hidden, weight, targets, bias, lse, loss_grad, lse_grad, entropy_grad, *args):
    return tuple(_fake_grads(hidden, weight, bias, Request.decode(args)))


def token_recompute(hidden, weight, targets, bias, lse, loss_grad, lse_grad, entropy_grad,
                    request: Request) -> Gradients:
    """``token_backward_op`` where traced, its implementation directly in eager mode."""
    if _is_traced(hidden):
        return Gradients(*token_backward_op(hidden, weight, targets, bias, lse, loss_grad, lse_grad, entropy_grad,
                                            *request.encode()))
    return _token_backward_outputs(hidden, weight, targets, bias, lse, loss_grad, lse_grad, entropy_grad, request)


def _recheck_weights(key: str, log_prob_grad: Tensor, targets: Tensor, ignore_index: int) -> None:
    """Queues the check of a backward that did not take the sweep's gradients, while the sweep is
    off for ``key``: whether the weights were equal, for ``TOKEN_SPECULATION`` to read at the next
    forward (no host wait here)."""
    if not TOKEN_SPECULATION.off(key) or (targets.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    found = _chunked.backend_for(targets.device).mean_grad_ratio(log_prob_grad.float().contiguous(), targets,
                                                                 ignore_index)
    TOKEN_SPECULATION.recheck(key, copy_to_host(found[:1]))


def _token_setup(ctx, tensors: tuple, request: Request, output: TokenOutputs, num_inputs: int) -> None:
    """The autograd context of a per-token forward, for either form of the call."""
    hidden, weight, targets, bias = tensors
    ctx.mark_non_differentiable(output.lse, output.is_top1, output.mean_logits, output.log_sum_sq, output.grad_hidden,
                                output.grad_weight, output.grad_bias)
    ctx.set_materialize_grads(False)
    ctx.request = request
    ctx.num_inputs = num_inputs
    ctx.has_bias = bias is not None
    ctx.speculated = any(request.grads)
    ctx.consumed = False
    ctx.key = request.outputs
    ctx.kept = None  # what the eager forward kept (``_EagerTokenForward``)
    saved_grads = (output.grad_hidden, output.grad_weight, output.grad_bias) if ctx.speculated else ()
    ctx.save_for_backward(hidden, weight, targets, None if bias is None else bias.detach().clone(), output.lse,
                          output.entropy if request.return_metrics else None, *saved_grads)


def _token_setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, *encoded = inputs
    _token_setup(ctx, (hidden, weight, targets, bias), Request.decode(encoded), TokenOutputs(*output), len(inputs))


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
        return (None,) * ctx.num_inputs
    if torch.is_grad_enabled():
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)
    needs = ctx.needs_input_grad
    want = (needs[0], needs[1], ctx.has_bias and needs[3])
    hidden, weight, targets, bias, lse, entropy, *saved_grads = ctx.saved_tensors
    opts = ctx.request.options
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
            TOKEN_SPECULATION.found(ctx.key, uniform)
            if uniform:
                return _input_grads(ctx.num_inputs, grads)
        else:
            TOKEN_SPECULATION.found(ctx.key, False)
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
    request = ctx.request.with_grads(want)
    if kept is not None:
        with _no_autocast(hidden):
            grads = _chunked.backward(hidden, weight, targets, bias, lse, loss_grad.contiguous(), row_lse_grad,
                                      request, entropy_grad=row_entropy_grad, kept=kept)
    else:
        grads = token_recompute(hidden, weight, targets, bias, lse, loss_grad.contiguous(), row_lse_grad,
                                row_entropy_grad, request)
    grads = [g if w else None for g, w in zip(grads, want, strict=True)]
    return _input_grads(ctx.num_inputs, grads)


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
    def forward(ctx, *inputs):
        *tensors, request = inputs
        output, kept = _token_outputs(*tensors, request, keep=_keeps_rows(ctx, tensors[0], request.grads))
        _token_setup(ctx, tensors, request, output, len(inputs))
        ctx.kept = kept if kept is not None and kept.count > 0 else None
        return tuple(output)

    backward = staticmethod(_token_backward)


def token_forward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                  request: Request) -> TokenOutputs:
    """The per-token outputs: ``token_forward_op`` where traced, ``_EagerTokenForward`` otherwise."""
    if _is_traced(hidden):
        return TokenOutputs(*token_forward_op(hidden, weight, targets, bias, *request.encode()))
    return TokenOutputs(*_EagerTokenForward.apply(hidden, weight, targets, bias, request))


def affine_mean_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, opts: LossOptions,
                       valid: Tensor) -> Tensor:
    """Each row's mean logit [N] (fp32, fp64 for fp64 inputs) of ``hidden`` [N, H] against ``weight``
    [V, H] (and ``bias`` [V]), 0 where not ``valid`` [N], for logits without a softcap: their mean is
    affine in the row, s (h_i . sum_j w_j + sum_j b_j) / V, one read of the weight instead of a sum
    in the sweep (``_plan.mean_logits_in_sweep``). 16-bit rows on CUDA meet the fp32 column sum as
    two 16-bit parts (its rounding and the rest: 16 significant bits of bf16's, 22 of fp16's) in
    one fp32-accumulated product, without an fp32 copy of the rows. No gradient, as the output's."""
    acc = accumulation_dtype(hidden.dtype)
    with torch.no_grad(), _no_autocast(hidden):
        column_sum = weight.sum(0, dtype=acc)
        if hidden.is_cuda and hidden.dtype != acc and _MM_OUT_DTYPE:
            high = column_sum.to(hidden.dtype)
            parts = torch.stack((high, (column_sum - high).to(hidden.dtype)), 1)
            row_sum = torch.mm(hidden, parts, out_dtype=acc).sum(1)
        else:
            row_sum = hidden.to(acc) @ column_sum
        if bias is not None:
            row_sum += bias.sum(dtype=acc)
        mean = row_sum * (opts.logit_scale * opts.inv_vocab_size(weight.shape[0]))
        return torch.where(valid, mean, torch.zeros((), dtype=acc, device=mean.device))
