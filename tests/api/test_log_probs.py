"""``fused_linear_log_probs``: per-token log-probs, entropy, log_sum_sq_probs, mean_logits and is_top1
against a float64 PyTorch reference, their gradients for any per-token upstream gradient (the
recomputing backward) and for SFT's equal weights (the sweep's gradients), and outputs that are the
same bit for bit with or without gradients. On the CPU the Triton kernels run in the interpreter;
the same file runs on the GPU (bf16 included)."""

import weakref

import pytest
import torch
from conftest import DEVICE, DTYPES, assert_rel, make_inputs, submodule, tolerance

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def reference(hidden, weight, targets, bias=None, temperature=1.0, logit_scale=1.0, softcap=None, ignore_index=-100):
    """The five outputs in float64 from materialised logits, 0 (False) on ignored rows."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    picked = log_p.gather(-1, torch.where(valid, targets, 0).long().unsqueeze(-1)).squeeze(-1)
    values = dict(
        log_probs=picked,
        entropy=-(log_p.exp() * log_p).sum(-1),
        log_sum_sq_probs=torch.logsumexp(2 * log_p, dim=-1),
        mean_logits=z.mean(-1),
    )
    out = {k: torch.where(valid, v, torch.zeros_like(v)) for k, v in values.items()}
    out["is_top1"] = valid & (z.argmax(-1) == targets)
    return out


def _check_outputs(got, expected, dtype, what=""):
    tol = tolerance(dtype, "loss")
    for name in OUTPUTS:
        value = getattr(got, name)
        if name == "is_top1":
            assert value.dtype == torch.bool
            # a row whose two largest logits are closer than the dtype's rounding may flip: none here
            assert torch.equal(value.cpu(), expected[name].cpu()), f"{what}is_top1"
        else:
            # the scale of log-probs and logits is that of the logits (a few units)
            assert_rel(value, expected[name], tol, f"{what}{name}", floor=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", [
    {},
    {"temperature": 0.7},
    {"temperature": 0.7, "softcap": 3.0, "logit_scale": 2.0},
    {"bias": True, "temperature": 1.3},
], ids=["plain", "temperature", "softcap-scale", "bias"])
def test_outputs_match_reference(flce, dtype, options):
    options = dict(options)
    hidden, weight, targets, bias = make_inputs(40, 32, 97, dtype, seed=1, bias=options.pop("bias", False),
                                                ignore=0.2, requires_grad=False)
    got = flce.fused_linear_log_probs(hidden, weight, targets, bias, outputs=OUTPUTS, **options)
    _check_outputs(got, reference(hidden, weight, targets, bias, **options), dtype)


def test_only_the_outputs_asked_for(flce):
    hidden, weight, targets, _ = make_inputs(8, 16, 33, torch.float32, seed=2, requires_grad=False)
    got = flce.fused_linear_log_probs(hidden, weight, targets, outputs=("entropy",))
    assert got.log_probs is not None and got.entropy is not None  # log_probs are always computed
    assert got.log_sum_sq_probs is None and got.mean_logits is None and got.is_top1 is None
    assert got.log_probs.shape == targets.shape


def test_leading_shape_and_ignored_rows(flce):
    hidden, weight, targets, _ = make_inputs(0, 16, 50, torch.float32, seed=3, lead=(3, 5), ignore=0.3,
                                             requires_grad=False)
    got = flce.fused_linear_log_probs(hidden, weight, targets, outputs=OUTPUTS)
    expected = reference(hidden, weight, targets)
    ignored = targets == -100
    for name in OUTPUTS:
        value = getattr(got, name)
        assert value.shape == (3, 5)
        assert not value[ignored].any(), f"{name} is not 0 on ignored rows"
    assert_rel(got.log_probs, expected["log_probs"], tolerance(torch.float32, "loss"), "log_probs", floor=1.0)


def _grads(loss_fn, tensors):
    for t in tensors:
        t.grad = None
    loss_fn().backward()
    return [t.grad.detach().clone() for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_gradients_of_any_token_weights(flce, dtype, softcap, path):
    """log_probs and entropy with random per-token upstream gradients (GRPO's advantages and
    entropy bonus): the recomputing backward, against float64 autograd, on both paths."""
    hidden, weight, targets, _ = make_inputs(40, 32, 97, dtype, seed=4, ignore=0.2, device=path.device)
    gen = torch.Generator().manual_seed(5)
    log_prob_weight = torch.randn(40, generator=gen, dtype=torch.float64).to(path.device)
    entropy_weight = torch.randn(40, generator=gen, dtype=torch.float64).to(path.device)
    options = dict(temperature=0.7, softcap=softcap)

    def loss():
        out = flce.fused_linear_log_probs(hidden, weight, targets, outputs=("log_probs", "entropy"), **options)
        return (out.log_probs.double() * log_prob_weight).sum() + (out.entropy.double() * entropy_weight).sum()

    got = _grads(loss, (hidden, weight))
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = reference(h64, w64, targets, **options)
    ((ref["log_probs"] * log_prob_weight).sum() + (ref["entropy"] * entropy_weight).sum()).backward()
    for name, g, e in zip(("grad_hidden", "grad_weight"), got, (h64.grad, w64.grad), strict=True):
        assert_rel(g, e, tolerance(dtype, "grad"), name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("function", ["log_probs", "loss_per_row"])
def test_rows_without_gradient_are_left_out(flce, monkeypatch, tune, dtype, path, function):
    """GRPO's tokens of a group whose rewards are all equal (advantage 0, no entropy bonus) and
    ignored rows have grad logits exactly 0: the recomputing backward (of the log-probs, or of the
    loss with ``reduction="none"``) computes only the other rows (in chunks of 8 here, the first
    chunk sized before their count is known), and the gradients still match float64 autograd,
    grad_hidden exactly 0 on the rows left out. (No kept rows: all are recomputed here.)"""
    tune(chunk_rows=8, keep_mib=0)
    hidden, weight, targets, _ = make_inputs(48, 32, 97, dtype, seed=8, ignore=0.2, device=path.device)
    advantage = torch.randn(6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    advantage[[1, 2, 4]] = 0.0  # 3 of 6 sequences of 8 tokens in groups whose rewards were all equal
    token_weight = advantage.repeat_interleave(8).to(path.device)
    with_gradient = (token_weight != 0) & (targets != -100)
    backend = submodule(flce, "_triton_backend" if path.name == "kernels" else "_torch_backend")
    computed = []
    grad_logits = backend.grad_logits
    monkeypatch.setattr(backend, "grad_logits", lambda hidden_c, *a, **k: computed.append(hidden_c.shape[0])
                        or grad_logits(hidden_c, *a, **k))
    def per_row():  # log_probs, or the loss -log_probs per row
        if function == "log_probs":
            return flce.fused_linear_log_probs(hidden, weight, targets, temperature=0.7,
                                               outputs=("log_probs", "entropy")).log_probs
        return -flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none", logit_scale=1 / 0.7)

    got = _grads(lambda: (per_row().double() * token_weight).sum(), (hidden, weight))
    assert sum(computed) == max(8, int(with_gradient.sum())) and computed[0] == 8, computed
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    (reference(h64, w64, targets, temperature=0.7)["log_probs"] * token_weight).sum().backward()
    assert torch.equal(got[0][~with_gradient], torch.zeros_like(got[0][~with_gradient]))
    for name, g, e in zip(("grad_hidden", "grad_weight"), got, (h64.grad, w64.grad), strict=True):
        assert_rel(g, e, tolerance(dtype, "grad"), name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normaliser", ["rows", "sum", "other"])
@pytest.mark.parametrize("chunk_rows", [None, 8], ids=["one-chunk", "chunks-of-8"])
def test_sft_gradients_from_the_sweep(flce, monkeypatch, tune, dtype, normaliser, chunk_rows):
    """SFT's loss, -sum log_probs / n: the backward finds equal weights and takes the gradients
    the forward's sweep computed (those of the mean over the rows with a target: untouched when n
    is their count, one scaling each of grad_hidden and grad_weight otherwise); they match
    float64 autograd, step after step, in one chunk or several."""
    tune(chunk_rows=chunk_rows)
    hidden, weight, targets, _ = make_inputs(40, 32, 97, dtype, seed=6, ignore=0.2)
    n = {"rows": (targets != -100).sum(), "sum": 1, "other": 7}[normaliser]
    outputs = ("log_probs", "entropy", "is_top1")
    ops = submodule(flce, "_ops")
    ops.TOKEN_SPECULATION.forget("entropy,is_top1,log_probs")  # as a fresh process: no earlier backward's verdict
    scalings = []
    scale_in_place = ops._scale_in_place
    monkeypatch.setattr(ops, "_scale_in_place", lambda x, scale: scalings.append(x.shape) or scale_in_place(x, scale))
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    (-reference(h64, w64, targets)["log_probs"].sum() / n).backward()
    for step in range(2):
        got = _grads(lambda: -flce.fused_linear_log_probs(hidden, weight, targets, outputs=outputs).log_probs.sum()
                     / n, (hidden, weight))
        assert ops.TOKEN_SPECULATION.speculates("entropy,is_top1,log_probs")
        assert scalings == ([] if normaliser == "rows" else [hidden.shape, weight.shape]), scalings
        scalings.clear()
        for name, g, e in zip(("grad_hidden", "grad_weight"), got, (h64.grad, w64.grad), strict=True):
            assert_rel(g, e, tolerance(dtype, "grad"), f"step {step} {name}")


@pytest.mark.parametrize("backend_name", ["_triton_backend", "_torch_backend"])
def test_mean_grad_ratio(flce, backend_name):
    """The backward's test of the per-token gradient: uniform on the rows with a target (the others
    do not count), and the ratio to the mean's weight 1 / count, exactly 1 for the gradient that
    PyTorch's autograd gives -sum / count."""
    device = DEVICE if backend_name == "_triton_backend" else "cpu"
    backend = submodule(flce, backend_name)
    gen = torch.Generator().manual_seed(11)
    for n_rows in (1, 37, 3000):
        targets = torch.randint(0, 50, (n_rows,), generator=gen)
        targets[torch.rand(n_rows, generator=gen) < 0.3] = -100
        targets[-1] = 3  # at least one row with a target
        count = int((targets != -100).sum())
        log_probs = torch.randn(n_rows, generator=gen, requires_grad=True)
        (-log_probs.sum() / (targets != -100).sum()).backward()
        mean_grad = log_probs.grad.to(device)  # -1 / count on every row, from autograd
        noisy = torch.where((targets != -100).to(device), mean_grad, torch.randn(n_rows, generator=gen).to(device))
        cases = [(mean_grad, 1.0, True), (noisy, 1.0, True), (2.5 * mean_grad, 2.5, True),
                 (-mean_grad * count, -count, True)]
        if count > 1:
            differs = mean_grad.clone()
            differs[int(torch.nonzero(targets != -100)[0])] *= 2
            cases.append((differs, None, False))
            with_nan = mean_grad.clone()
            with_nan[-1] = float("nan")
            cases.append((with_nan, None, False))
        t = targets.to(device)
        for grad, ratio, uniform in cases:
            got_uniform, got_ratio = backend.mean_grad_ratio(grad.contiguous(), t, -100).tolist()
            assert got_uniform == float(uniform), (n_rows, ratio)
            if ratio == 1.0:
                assert got_ratio == 1.0  # exactly: no pass over the gradients then
            elif ratio is not None:
                assert got_ratio == pytest.approx(ratio, rel=1e-6)  # two fp32 roundings


def test_unequal_weights_after_the_sweep_recompute(flce):
    """A backward whose token weights differ cannot use the sweep's gradients: it recomputes (exact),
    and the next forward of the same outputs stops computing them in its sweep."""
    hidden, weight, targets, _ = make_inputs(24, 16, 41, torch.float32, seed=7)
    ops = submodule(flce, "_ops")
    outputs = ("log_probs",)
    ops.TOKEN_SPECULATION.forget("log_probs")
    weights = torch.linspace(-1.0, 2.0, 24, dtype=torch.float64).to(DEVICE)
    got = _grads(lambda: (flce.fused_linear_log_probs(hidden, weight, targets, outputs=outputs).log_probs.double()
                          * weights).sum(), (hidden, weight))
    assert not ops.TOKEN_SPECULATION.speculates("log_probs")
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    (reference(h64, w64, targets)["log_probs"] * weights).sum().backward()
    for name, g, e in zip(("grad_hidden", "grad_weight"), got, (h64.grad, w64.grad), strict=True):
        assert_rel(g, e, tolerance(torch.float32, "grad"), name)
    ops.TOKEN_SPECULATION.forget("log_probs")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grad_in_forward", [None, False], ids=["sweep-gradients", "kept-rows"])
def test_outputs_bit_identical_with_or_without_gradients(flce, tune, dtype, grad_in_forward):
    """The same outputs without gradients, with the sweep's gradients, and with rows kept for the
    backward (the first 13 here: a chunk of 8 and one that the budget cuts)."""
    if grad_in_forward is False:
        tune(chunk_rows=8, keep_mib=1, keep_rows=13)
    hidden, weight, targets, _ = make_inputs(40, 32, 97, dtype, seed=8, ignore=0.2)
    outputs = ("log_probs", "entropy", "is_top1")
    submodule(flce, "_ops").TOKEN_SPECULATION.forget("entropy,is_top1,log_probs")  # the sweep computes gradients
    with torch.no_grad():
        plain = flce.fused_linear_log_probs(hidden, weight, targets, outputs=outputs)
    assert submodule(flce, "_ops").TOKEN_SPECULATION.speculates("entropy,is_top1,log_probs")
    trained = flce.fused_linear_log_probs(hidden, weight, targets, outputs=outputs, grad_in_forward=grad_in_forward)
    assert trained.log_probs.requires_grad and trained.entropy.requires_grad
    for name in outputs:
        assert torch.equal(getattr(plain, name), getattr(trained, name).detach()), name


def test_bad_arguments(flce):
    hidden, weight, targets, _ = make_inputs(4, 8, 10, torch.float32, seed=9, requires_grad=False)
    with pytest.raises(ValueError, match="unknown outputs"):
        flce.fused_linear_log_probs(hidden, weight, targets, outputs=("log_probs", "logits"))
    with pytest.raises(TypeError, match="tuple of names"):
        flce.fused_linear_log_probs(hidden, weight, targets, outputs="entropy")
    with pytest.raises(ValueError, match="temperature"):
        flce.fused_linear_log_probs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="targets must be in"):
        flce.fused_linear_log_probs(hidden, weight, torch.full_like(targets, 10))


# ---- kept rows --------------------------------------------------------------------------------
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _kept_bound(hidden, weight, targets, bias, options, log_prob_weight, entropy_weight):
    """Elementwise bounds (grad_hidden, grad_weight) of the kept rows' gradients against float64
    (``_kept``'s bound on the grad logits, with the logits' own fp32 rounding and that of the
    products), from float64 logits: G~ - G per entry at most u |G| + 2 u p (1 + s)(|g| + |e| (2 +
    |log p + H|)), s = row max - z, times dz/du, plus 2 u s |G| / c with a softcap c."""
    u = UNIT_ROUNDOFF[hidden.dtype]
    acc = 2.0**-24  # fp32 accumulation: the logits' dot products and the gradient products
    h, w = hidden.detach().double(), weight.detach().double()
    raw = h @ w.T + (0.0 if bias is None else bias.detach().double())
    scale, cap = 1.0 / options["temperature"], options.get("softcap")
    z = raw * scale if cap is None else (cap * scale) * torch.tanh(raw / cap)
    log_p = torch.log_softmax(z, dim=-1)
    p, entropy = log_p.exp(), -(log_p.exp() * log_p).sum(-1, keepdim=True)
    valid = (targets != -100)[:, None]
    g, e = (torch.where(valid, x[:, None], 0.0) for x in (log_prob_weight, entropy_weight))
    onehot = torch.nn.functional.one_hot(torch.where(valid[:, 0], targets, 0), w.shape[0]).double()
    grad_z = g * (onehot - p) - e * p * (log_p + entropy)
    dz_du = torch.full_like(z, scale) if cap is None else scale * (1 - (z / (cap * scale)) ** 2)
    s = z.amax(-1, keepdim=True) - z
    weigh = g.abs() + e.abs() * (2 + (log_p + entropy).abs())
    # the logits' rounding: H + 2 fp32 roundings of |h| . |w|, relative in p
    dz = (h.shape[1] + 2) * acc * (h.abs() @ w.abs().T) * scale
    per_entry = (u * grad_z.abs() + 2 * u * p * (1 + s) * weigh + 2 * p * dz * weigh) * dz_du.abs()
    if cap is not None:
        per_entry = per_entry + 2 * u * s / (cap * scale) * grad_z.abs() * dz_du.abs()
    grad_u = (grad_z * dz_du).abs()
    bound_h = per_entry @ w.abs() + (w.shape[0] * acc + u) * (grad_u @ w.abs())
    bound_w = per_entry.T @ h.abs() + (h.shape[0] * acc + 2 * u) * (grad_u.T @ h.abs())
    return bound_h, bound_w


def _counting_rows(monkeypatch, flce, path) -> dict:
    """Counts the rows the backwards take on ``path``: those whose grad logits come from a kept
    buffer (``grad_from_kept``) and those recomputed (``grad_logits``), through monkeypatched
    backend functions (a kept chunk's buffer, a recomputed chunk's hidden rows: rows x ...)."""
    backend = submodule(flce, "_triton_backend" if path.name == "kernels" else "_torch_backend")
    rows = {"kept": 0, "recomputed": 0}

    def counting(function, key):
        def counted(rows_first, *a, **k):
            rows[key] += rows_first.shape[0]
            return function(rows_first, *a, **k)
        return counted

    monkeypatch.setattr(backend, "grad_from_kept", counting(backend.grad_from_kept, "kept"))
    monkeypatch.setattr(backend, "grad_logits", counting(backend.grad_logits, "recomputed"))
    if hasattr(backend, "row_factors"):  # kept exponentials whose products take them as they are
        monkeypatch.setattr(backend, "row_factors", counting(backend.row_factors, "kept"))
    return rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("budget", "whole"), [("all", True), ("all", False), ("some", True), ("some", False),
                                               ("off", None)],
                         ids=["all-whole", "all-counted", "some-whole", "some-counted", "off"])
@pytest.mark.parametrize("options", [{"temperature": 0.7}, {"temperature": 0.7, "softcap": 3.0, "bias": True}],
                         ids=["temperature", "softcap-bias"])
@pytest.mark.parametrize("bonus", [True, False], ids=["entropy-bonus", "log-probs-alone"])
def test_kept_rows_gradients(flce, monkeypatch, tune, dtype, budget, whole, options, bonus, path):
    """GRPO-like weights (per-token advantages, a quarter of them 0, and an entropy bonus, or the
    log-probs alone, whose kept exponentials go to the products as they are) on rows of
    every kind: kept by the forward (every row with a target, 11 of them in chunks of 8: a chunk cut
    by the budget, or none), recomputed and ignored. The gradients are within ``_kept``'s bound of
    float64 autograd (elementwise), equal to the recomputing backward's within the dtype's
    tolerance, and exactly 0 on the rows without gradient, whichever way the backward goes: where
    the last kept backward found a gradient on every computed row (``whole``; wrong here) it takes
    every row its forward computed, kept parts whole; otherwise each row with a gradient once, from
    its kept buffer or by recomputation, and no row without one. Either way it finds rows without
    gradient, for the next backward."""
    options = dict(options)
    hidden, weight, targets, bias = make_inputs(36, 32, 97, dtype, seed=12, bias=options.pop("bias", False),
                                                ignore=0.2, device=path.device)
    tune(chunk_rows=8, keep_mib={"off": 0}.get(budget, 1), keep_rows={"some": 11}.get(budget))
    outputs = ("log_probs", "entropy") if bonus else ("log_probs",)
    speculation, key = submodule(flce, "_kept").SPECULATION, ",".join(sorted(outputs))
    if whole is not None:
        speculation.found(key, whole)  # what the last kept backward of these outputs found
    gen = torch.Generator().manual_seed(13)
    log_prob_weight = torch.randn(36, generator=gen, dtype=torch.float64)
    log_prob_weight[torch.rand(36, generator=gen) < 0.25] = 0.0
    entropy_weight = torch.where(log_prob_weight != 0, 0.01 * torch.randn(36, generator=gen, dtype=torch.float64), 0.0)
    entropy_weight = entropy_weight if bonus else torch.zeros_like(entropy_weight)
    log_prob_weight, entropy_weight = log_prob_weight.to(path.device), entropy_weight.to(path.device)
    rows = _counting_rows(monkeypatch, flce, path)

    def loss():
        out = flce.fused_linear_log_probs(hidden, weight, targets, bias, outputs=outputs, grad_in_forward=False,
                                          **options)
        bonus_term = (out.entropy.double() * entropy_weight).sum() if bonus else 0.0
        return (out.log_probs.double() * log_prob_weight).sum() + bonus_term

    tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
    got = _grads(loss, tensors)
    with_gradient = (log_prob_weight != 0) & (targets != -100)
    # the kept rows: the first rows with a target (all, 11 or none); those without gradient are left
    # out unless the backward takes every computed row (those with a target)
    kept_rows = torch.nonzero(targets != -100)[:, 0][: {"all": 36, "some": 11, "off": 0}[budget]]
    kept = int(with_gradient[kept_rows].sum())
    if whole:
        assert rows == {"kept": len(kept_rows), "recomputed": int((targets != -100).sum()) - len(kept_rows)}, rows
    else:
        assert rows["kept"] == kept and 0 < kept < len(kept_rows) or budget == "off", (rows, len(kept_rows))
        assert rows["recomputed"] == int(with_gradient.sum()) - kept, rows
    assert budget == "off" or not speculation.speculates(key)  # rows without gradient: counted next time
    assert torch.equal(got[0][~with_gradient], torch.zeros_like(got[0][~with_gradient]))
    h64, w64, b64 = (None if t is None else t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    ref = reference(h64, w64, targets, b64, **options)
    ((ref["log_probs"] * log_prob_weight).sum() + (ref["entropy"] * entropy_weight).sum()).backward()
    bound_h, bound_w = _kept_bound(hidden, weight, targets, bias, options, log_prob_weight, entropy_weight)
    for name, g, e, bound in (("grad_hidden", got[0], h64.grad, bound_h), ("grad_weight", got[1], w64.grad, bound_w)):
        excess = (g.double() - e).abs() - bound
        assert excess.max() <= 0, f"{name}: {excess.max():.3g} over the bound"
    tune(keep_mib=0)
    recomputed = _grads(loss, tensors)
    for name, g, e in zip(("grad_hidden", "grad_weight", "grad_bias"), got, recomputed, strict=False):
        assert_rel(g, e, tolerance(dtype, "grad"), f"{name} against the recomputing backward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("options", [{"bias": True}, {"softcap": 3.0}, {}], ids=["bias", "softcap", "plain"])
def test_mean_logits_leave_the_kept_rows_their_form(flce, monkeypatch, tune, dtype, options, path):
    """DPO's outputs (log-probs, entropy, mean_logits and is_top1; the upstream per sequence on the
    log-probs alone), every row kept. Without a softcap the mean logit is affine in the row
    (``_ops.affine_mean_logits``), so the sweep sums no logits and the kept rows take the form they
    take without mean_logits: on the kernels without a bias, the factored exponentials, which the
    products take as they are (``row_factors``, no pass over the buffer), else ``z - tile_max`` or
    the PyTorch path's exponentials, made into grad logits (``grad_from_kept``); with a softcap the
    sweep sums them. mean_logits matches float64's and the gradients the recomputing backward's."""
    options = dict(options)
    hidden, weight, targets, bias = make_inputs(36, 32, 97, dtype, seed=31, bias=options.pop("bias", False),
                                                ignore=0.2, device=path.device)
    tune(chunk_rows=8, keep_mib=1)
    backend = submodule(flce, "_triton_backend" if path.name == "kernels" else "_torch_backend")
    calls = {"logit_sum": [], "row_factors": 0, "grad_from_kept": 0}
    row_stats, grad_from_kept = backend.row_stats, backend.grad_from_kept

    def stats(*args, **kwargs):
        calls["logit_sum"].append(kwargs.get("logit_sum", False))
        return row_stats(*args, **kwargs)

    def from_kept(*args, **kwargs):
        calls["grad_from_kept"] += 1
        return grad_from_kept(*args, **kwargs)

    monkeypatch.setattr(backend, "row_stats", stats)
    monkeypatch.setattr(backend, "grad_from_kept", from_kept)
    if hasattr(backend, "row_factors"):
        row_factors = backend.row_factors

        def factors(*args, **kwargs):
            calls["row_factors"] += 1
            return row_factors(*args, **kwargs)

        monkeypatch.setattr(backend, "row_factors", factors)
    sequence_weight = torch.randn(6, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
    log_prob_weight = sequence_weight.repeat_interleave(6).to(path.device)
    tensors = (hidden, weight) if bias is None else (hidden, weight, bias)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    mean_logits = []

    def loss():
        out = flce.fused_linear_log_probs(hidden, weight, targets, bias, outputs=outputs, grad_in_forward=False,
                                          temperature=0.7, **options)
        mean_logits.append(out.mean_logits)
        return (out.log_probs.double() * log_prob_weight).sum()

    got = _grads(loss, tensors)
    softcap = "softcap" in options
    assert calls["logit_sum"] and set(calls["logit_sum"]) == {softcap}, calls["logit_sum"]
    factored = path.name == "kernels" and not softcap and bias is None and dtype != torch.float16
    assert (calls["row_factors"] > 0, calls["grad_from_kept"] > 0) == (factored, not factored), calls
    expected = reference(hidden.detach(), weight.detach(), targets, None if bias is None else bias.detach(),
                         temperature=0.7, **options)["mean_logits"]
    assert_rel(mean_logits[0], expected, tolerance(dtype, "loss"), "mean_logits", floor=1.0)
    tune(keep_mib=0)
    recomputed = _grads(loss, tensors)
    for name, g, e in zip(("grad_hidden", "grad_weight", "grad_bias"), got, recomputed, strict=False):
        assert_rel(g, e, tolerance(dtype, "grad"), f"{name} against the recomputing backward")


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "counted"])
def test_no_kept_buffer_lives_beside_a_recomputed_chunk(flce, monkeypatch, tune, whole, path):
    """The default budget gives the kept rows all the room under TRL's head's peak, whether or not
    other rows are recomputed (``_kept.budget``), because a recomputed chunk never lives beside them:
    when the backward allocates the recomputed chunks' buffer, every buffer its forward kept has been
    released. Checked through weak references on a backward with kept parts and recomputed rows
    (kept parts whole, or their rows with a gradient counted first), and the gradients still right."""
    tune(chunk_rows=8, keep_mib=1, keep_rows=11)
    kept_module, key = submodule(flce, "_kept"), "entropy,log_probs"
    kept_module.SPECULATION.found(key, whole)
    backend = submodule(flce, "_triton_backend" if path.name == "kernels" else "_torch_backend")
    forward_buffers, alive_at_recompute = [], []
    new_buffer = backend.new_buffer

    def tracked(*args, **kwargs):
        buffer = new_buffer(*args, **kwargs)
        if phase == "forward":
            forward_buffers.append(weakref.ref(buffer))
        else:
            alive_at_recompute.append(sum(ref() is not None for ref in forward_buffers))
        return buffer

    monkeypatch.setattr(backend, "new_buffer", tracked)
    hidden, weight, targets, _ = make_inputs(36, 32, 97, torch.float32, seed=21, ignore=0.2, device=path.device)
    gen = torch.Generator().manual_seed(22)
    log_prob_weight = torch.randn(36, generator=gen, dtype=torch.float64).to(path.device)
    h, w = (t.detach().requires_grad_() for t in (hidden, weight))
    phase = "forward"
    out = flce.fused_linear_log_probs(h, w, targets, outputs=("log_probs", "entropy"), grad_in_forward=False)
    loss = (out.log_probs.double() * log_prob_weight).sum() + 0.01 * out.entropy.double().sum()
    phase = "backward"
    del out
    loss.backward()
    assert forward_buffers and alive_at_recompute == [0], (len(forward_buffers), alive_at_recompute)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = reference(h64, w64, targets)
    ((ref["log_probs"] * log_prob_weight).sum() + 0.01 * ref["entropy"].sum()).backward()
    # fp32 inputs keep fp32 exponentials: the recompute's tolerance
    assert_rel(h.grad, h64.grad, tolerance(torch.float32, "grad"), "grad_hidden")
    assert_rel(w.grad, w64.grad, tolerance(torch.float32, "grad"), "grad_weight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_kept_backward_follows_the_last_ones_finding(flce, monkeypatch, tune, dtype, path):
    """Calls whose upstream reaches [every row with a target, all but a third of them, every row,
    every row] (fresh random weights each call, an entropy bonus on the same rows): a fresh key
    takes every row the forward computed, kept parts whole, with no host read (call 1); so does
    call 2, wrongly (its rows without gradient computed too); its check, queued on the device,
    makes call 3 count its rows with a gradient on the host (``first_order``), and call 3's counts
    make call 4 take them whole again. Kept rows (11: a chunk of 8 and one cut by the budget),
    recomputed and ignored rows each call; every call's gradients within ``_kept``'s bound of
    float64 autograd, exactly 0 on the rows without gradient."""
    tune(chunk_rows=8, keep_mib=1, keep_rows=11)
    kept_module, key = submodule(flce, "_kept"), "entropy,log_probs"
    kept_module.SPECULATION.forget(key)  # as a fresh process: no earlier kept backward
    hidden, weight, targets, _ = make_inputs(36, 32, 97, dtype, seed=18, ignore=0.2, device=path.device)
    rows = _counting_rows(monkeypatch, flce, path)
    host_reads = []  # a call of ``first_order``: the counts of the rows with a gradient read on the host
    first_order = kept_module.first_order
    monkeypatch.setattr(kept_module, "first_order", lambda *a: host_reads.append(None) or first_order(*a))
    with_target = targets != -100
    kept_rows, recomputed_rows = torch.nonzero(with_target)[:, 0][:11], torch.nonzero(with_target)[:, 0][11:]
    gen = torch.Generator().manual_seed(19)
    paths, verdicts = [], []
    for call, every_row in enumerate([True, False, True, True]):
        log_prob_weight = torch.randn(36, generator=gen, dtype=torch.float64)
        if not every_row:
            log_prob_weight[torch.rand(36, generator=gen) < 1 / 3] = 0.0
        entropy_weight = torch.where(log_prob_weight != 0, 0.01 * torch.randn(36, generator=gen, dtype=torch.float64),
                                     0.0)
        with_gradient = (log_prob_weight != 0).to(path.device) & with_target
        without = with_target & ~with_gradient  # (rows with a target but no gradient: kept and recomputed ones)
        assert every_row or (without[kept_rows].any() and without[recomputed_rows].any())
        weights = [w.to(path.device) for w in (log_prob_weight, entropy_weight)]

        def loss(log_prob_weight=weights[0], entropy_weight=weights[1]):
            out = flce.fused_linear_log_probs(hidden, weight, targets, outputs=("log_probs", "entropy"),
                                              grad_in_forward=False)
            return (out.log_probs.double() * log_prob_weight).sum() + (out.entropy.double() * entropy_weight).sum()

        rows.update(kept=0, recomputed=0)
        reads_before = len(host_reads)
        got = _grads(loss, (hidden, weight))
        paths.append("counted" if len(host_reads) > reads_before else "whole")
        verdicts.append(kept_module.SPECULATION.speculates(key))
        taken = with_target if paths[-1] == "whole" else with_gradient
        assert rows == {"kept": int(taken[kept_rows].sum()), "recomputed": int(taken.sum() - taken[kept_rows].sum())}
        assert torch.equal(got[0][~with_gradient], torch.zeros_like(got[0][~with_gradient])), f"call {call}"
        h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
        ref = reference(h64, w64, targets)
        ((ref["log_probs"] * weights[0]).sum() + (ref["entropy"] * weights[1]).sum()).backward()
        # the bound from the dtype's unit roundoff: the kept buffer's rounding of p (``_kept``'s), and fp32's of
        # the logits and products, which the recomputed rows pay too
        bounds = _kept_bound(hidden, weight, targets, None, {"temperature": 1.0}, *weights)
        for name, g, e, bound in zip(("grad_hidden", "grad_weight"), got, (h64.grad, w64.grad), bounds, strict=True):
            excess = (g.double() - e).abs() - bound
            assert excess.max() <= 0, f"call {call} {name}: {excess.max():.3g} over the bound"
    assert paths == ["whole", "whole", "counted", "whole"]
    assert verdicts == [True, False, True, True]
    kept_module.SPECULATION.forget(key)


def test_the_sweep_re_arms_after_unequal_weights(flce, monkeypatch):
    """[sft, sft, sft, rand, sft, sft]: the sweep computes SFT's gradients in calls 1-3, and in call 4,
    whose backward finds the weights unequal and recomputes; call 5 keeps rows instead, its backward
    finds equal weights, and call 6 computes them in its sweep again. ``grad_in_forward`` decides
    per call, whatever the verdict. Every step's gradients match float64 autograd."""
    hidden, weight, targets, _ = make_inputs(24, 16, 41, torch.float32, seed=14, ignore=0.2)
    ops, chunked = submodule(flce, "_ops"), submodule(flce, "_chunked")
    ops.TOKEN_SPECULATION.forget("log_probs")
    in_sweep, backwards = [], []
    forward, backward = chunked.forward, chunked.backward
    monkeypatch.setattr(chunked, "forward", lambda *a, **k: in_sweep.append(any(a[4].grads)) or forward(*a, **k))
    monkeypatch.setattr(chunked, "backward", lambda *a, **k: backwards.append(len(in_sweep)) or backward(*a, **k))
    n = (targets != -100).sum()
    weights = torch.linspace(-1.0, 2.0, 24, dtype=torch.float64).to(DEVICE)
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = reference(h64, w64, targets)["log_probs"]
    expected = {"sft": torch.autograd.grad(-ref.sum() / n, (h64, w64), retain_graph=True),
                "rand": torch.autograd.grad((ref * weights).sum(), (h64, w64))}
    steps = [("sft", None), ("sft", None), ("sft", None), ("rand", None), ("sft", None), ("sft", None),
             ("sft", False), ("rand", True)]
    for step, (kind, explicit) in enumerate(steps):
        def loss(kind=kind, explicit=explicit):
            log_probs = flce.fused_linear_log_probs(hidden, weight, targets, grad_in_forward=explicit).log_probs
            return -log_probs.sum() / n if kind == "sft" else (log_probs.double() * weights).sum()
        for name, g, e in zip(("grad_hidden", "grad_weight"), _grads(loss, (hidden, weight)), expected[kind],
                              strict=True):
            assert_rel(g, e, tolerance(torch.float32, "grad"), f"step {step} ({kind}) {name}")
    assert in_sweep == [True, True, True, True, False, True, False, True]
    assert backwards == [4, 5, 7, 8]  # the backwards of calls 4, 5, 7 and 8 (1-based) computed their gradients
    ops.TOKEN_SPECULATION.forget("log_probs")


@pytest.mark.parametrize("grad_in_forward", [None, False])
def test_empty_batch_gives_zero_gradients(flce, path, grad_in_forward):
    """A micro-batch with no row (TRL's head on a fully masked one) backpropagates zeros, as float64
    autograd does, on both paths, whether the sweep computes gradients or the backward does."""
    hidden, weight, _, _ = make_inputs(0, 8, 16, torch.float32, seed=15, device=path.device)
    targets = torch.zeros(0, dtype=torch.long, device=path.device)
    submodule(flce, "_ops").TOKEN_SPECULATION.forget("entropy,log_probs")
    out = flce.fused_linear_log_probs(hidden, weight, targets, outputs=("log_probs", "entropy"),
                                      grad_in_forward=grad_in_forward)
    (-out.log_probs.sum() + 0.01 * out.entropy.sum()).backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    ref = reference(h64, w64, targets)
    (-ref["log_probs"].sum() + 0.01 * ref["entropy"].sum()).backward()
    assert hidden.grad.shape == (0, 8) and torch.equal(weight.grad.double(), w64.grad)


def test_kept_rows_backward_twice_recomputes(flce, tune):
    """retain_graph=True: the first backward turns the kept buffers into grad logits, so the second
    recomputes; both give float64 autograd's gradients (accumulated twice)."""
    tune(keep_mib=1)
    hidden, weight, targets, _ = make_inputs(24, 16, 41, torch.float32, seed=16, ignore=0.2)
    weights = torch.randn(24, generator=torch.Generator().manual_seed(17), dtype=torch.float64).to(DEVICE)
    out = flce.fused_linear_log_probs(hidden, weight, targets, grad_in_forward=False)
    loss = (out.log_probs.double() * weights).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    (2 * (reference(h64, w64, targets)["log_probs"] * weights).sum()).backward()
    for name, g, e in zip(("grad_hidden", "grad_weight"), (hidden.grad, weight.grad), (h64.grad, w64.grad),
                          strict=True):
        assert_rel(g, e, tolerance(torch.float32, "grad"), name)
