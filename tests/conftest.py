"""Shared fixtures. On a machine without CUDA the Triton kernels run in the interpreter
(TRITON_INTERPRET=1 must be set before triton decorates them, hence here, first)."""

import contextlib
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path as _FilePath
from typing import NamedTuple

import torch

ROOT = _FilePath(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The card's own line resolves this checkout instead of the Hub, offline.
os.environ["LOCAL_KERNELS"] = f"qgallouedec/fused-linear-ce={ROOT}"

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"

# Hypothesis draws the same examples on every run, on every machine (CI, a laptop, the GPU run
# of these files), so that a failure reproduces; no example database on disk. To hunt for new
# counterexamples: python -m pytest --hypothesis-profile=random (with FLCE_TEST_EXAMPLES=k for
# k times the examples).
settings.register_profile("default", database=None, deadline=None, derandomize=True)
settings.register_profile("random", parent=settings.get_profile("default"), derandomize=False)
settings.load_profile("default")


@pytest.fixture(scope="session")
def flce():
    """The kernel as users load it: ``get_kernel`` with the card's arguments. Correctness tests
    on the GPU launch one configuration of the logit kernel: autotuning a new one for every
    (H, V) the tests draw would cost minutes (test_loss.py checks the autotuned launch once). Nor
    do they warm up the recorded specialisations, which their small shapes do not take
    (test_precompile.py checks the warm-up in fresh processes)."""
    from kernels import get_kernel

    kernel = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
    # The Triton backend is imported on first use, and Triton decides at decoration time whether a
    # kernel is interpreted: imported first inside a test that sets TRITON_INTERPRET=0 (the PyTorch
    # path for CPU tensors), its kernels would stay compiled ones that the interpreter cannot run
    # in the tests after it. Imported here, under this file's TRITON_INTERPRET, whatever the order.
    if importlib.util.find_spec("triton") is not None:
        submodule(kernel, "_triton_backend")
    with submodule(kernel, "_settings").override(autotune=False, precompile=False):
        yield kernel


@pytest.fixture
def tune(flce):
    """Sets fields of the loaded kernel's settings for the rest of a test, e.g.
    ``tune(chunk_rows=8)`` (``_settings.override``, undone when the test ends; a later call
    adds to or replaces earlier ones)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(submodule(flce, "_settings").override(**changes))


@pytest.fixture
def device():
    return DEVICE


class Path(NamedTuple):
    """A code path of the loss and the device of its tensors."""

    name: str  # "kernels": the Triton kernels (the GPU, or the interpreter on a CPU); "torch": the PyTorch path
    device: str


@pytest.fixture(params=["kernels", "torch"])
def path(request, monkeypatch) -> Path:
    """Both code paths: the Triton kernels on ``DEVICE``, and the chunked PyTorch path, which CPU
    tensors take outside the interpreter (``TRITON_INTERPRET`` is read per call)."""
    if request.param == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return Path("torch", "cpu")
    return Path("kernels", DEVICE)


def submodule(flce, name: str):
    """A private module of the loaded kernel, e.g. ``submodule(flce, "_triton_backend")`` (imported
    here if the kernel has not needed it yet: the Triton backend is imported on first use)."""
    return importlib.import_module(f"{flce.__name__}.{name}")


# ---- dtypes and tolerances ----------------------------------------------------------------
BF16_ON_CPU = ("bf16 runs only on CUDA: the Triton interpreter's tl.dot on bfloat16 is wrong "
               "(triton issue #11584)")
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(not HAS_CUDA, reason=BF16_ON_CPU)),
]
DTYPES_16 = [p for p in DTYPES if p.id != "fp32"]

# Relative errors allowed against the float64 reference: "loss" for loss, lse and entropy
# (scalars or per row), "grad" for gradients, measured as max |error| / max |reference| of the
# whole tensor (so tiny entries of a gradient are held to the scale of its large ones).
TOLERANCES = {
    # CPU fp32: the interpreter runs tl.dot in numpy float32 (exact IEEE), so only fp32
    # rounding of dot products, exp and log over H <= 64 and V <= 150 terms remains.
    ("cpu", torch.float32): dict(loss=1e-5, grad=1e-5),
    # CPU fp16: the reference gets the same rounded inputs; fp32 accumulation keeps the loss
    # near fp32 accuracy, but the buffered z - tile_max, the grad logits and the gradients
    # themselves are rounded to 16 bits (2^-11 relative), summed over up to V or N terms.
    ("cpu", torch.float16): dict(loss=2e-5, grad=1e-2),
    # CUDA fp32: PyTorch's default matmul precision "highest" gives 3xTF32 in the kernel
    # (about fp32 accuracy) and IEEE fp32 cuBLAS for the gradient products.
    ("cuda", torch.float32): dict(loss=1e-4, grad=1e-4),
    # CUDA fp16: as on the CPU, plus tensor-core accumulation order.
    ("cuda", torch.float16): dict(loss=1e-4, grad=1e-2),
    # CUDA bf16: fp32 accumulation keeps the loss near 1e-3; grad logits and gradients are
    # rounded to bf16 (2^-8 relative), hence 2e-2 on the gradients.
    ("cuda", torch.bfloat16): dict(loss=1e-3, grad=2e-2),
}


def tolerance(dtype: torch.dtype, kind: str) -> float:
    return TOLERANCES[(DEVICE, dtype)][kind]


def assert_rel(actual, expected, tol: float, what: str, floor: float = 1e-6) -> None:
    """max |actual - expected| <= tol * max(max |expected|, floor), with NaN and inf only where
    expected has them. ``floor`` is the scale of the quantity when the expected value happens
    to be much smaller than its terms (a loss near 0 made of logits near 1e3, say)."""
    actual = torch.as_tensor(actual).detach().cpu().double()
    expected = torch.as_tensor(expected).detach().cpu().double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN at other places than the reference"
    assert torch.equal(actual.isinf(), expected.isinf()), f"{what}: inf at other places than the reference"
    finite = expected.isfinite()
    if not finite.any():
        assert torch.equal(actual[expected.isinf()], expected[expected.isinf()]), f"{what}: wrong infinities"
        return
    a, e = actual[finite], expected[finite]
    scale = max(e.abs().max().item(), floor)
    err = (a - e).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g} (ratio {err / scale:.3g})"


# ---- inputs -------------------------------------------------------------------------------
def make_inputs(n, h, v, dtype, *, seed, device=DEVICE, bias=False, lead=None, ignore=0.0, ignore_index=-100,
                target_dtype=torch.int64, scale=1.0, requires_grad=True):
    """Random (seeded) hidden (*lead or n, h), weight (v, h), targets, bias (v,) or None.

    Weights are scaled by ``scale / sqrt(h)`` so that logits are O(scale); a fraction ``ignore``
    of the targets is set to ``ignore_index`` (at least one row when ``ignore`` > 0)."""
    gen = torch.Generator().manual_seed(seed)
    lead = (n,) if lead is None else tuple(lead)
    hidden = torch.randn(*lead, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * (scale / max(h, 1) ** 0.5)
    b = torch.randn(v, generator=gen) * 0.5 if bias else None
    targets = torch.randint(0, v, lead, generator=gen)
    if ignore:
        drop = torch.rand(lead, generator=gen) < ignore
        drop.view(-1)[0] = True
        targets = torch.where(drop, torch.full_like(targets, ignore_index), targets)
    tensors = [t if t is None else t.to(device=device, dtype=dtype).requires_grad_(requires_grad)
               for t in (hidden, weight, b)]
    return (*tensors[:2], targets.to(device=device, dtype=target_dtype), tensors[2])


@contextlib.contextmanager
def env(**values):
    """Sets environment variables (TRITON_INTERPRET) for the duration of a block (for hypothesis
    examples, where the function-scoped ``monkeypatch`` fixture does not reset between them)."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, val in values.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(val)
        yield
    finally:
        for k, val in saved.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val


def pytest_configure(config):
    # build/ (not tracked) is made from torch-ext/ before anything loads the checkout, once, by the
    # controlling process: pytest-xdist's workers start after this hook and find it made.
    if not hasattr(config, "workerinput"):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_variants.py")], check=True)
    # The interpreter's own noise: numpy deprecations inside triton, and 0 * -inf in lanes of
    # masked vocabulary columns that the kernels then discard with tl.where, exp overflowing
    # to inf where the kernels mean it to (the saturating tanh).
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:triton.runtime.interpreter")
    for numpy_warning in ("invalid value encountered", "overflow encountered"):
        config.addinivalue_line("filterwarnings", f"ignore:{numpy_warning}:RuntimeWarning:triton.runtime.interpreter")
