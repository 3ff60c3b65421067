"""Without triton (macOS, Windows, a CPU-only Linux install), the package and the Hub's CPU variant
import and train on CPU tensors through the PyTorch backend; the Triton backend is imported only for
CUDA tensors or the interpreter, and there a missing triton is an ImportError that says to install it.

Each child is a fresh Python in which ``import triton`` fails as for a package that is not installed;
it trains on inputs saved by the test and saves what it got, which the test checks against the
float64 reference."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA, ROOT, assert_rel, make_inputs, tolerance
from reference import reference

# First lines of every child: `import triton` (or of a submodule) raises as for a missing package.
NO_TRITON = """
import sys

sys.modules["triton"] = None  # importlib.util.find_spec("triton") is None, as torch.cuda checks
try:
    import triton
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("triton was imported")
"""

# A training step of `flce` on the saved inputs; the Triton backend must not have been imported.
STEP = """
import torch
hidden, weight, targets = torch.load("inputs.pt")
loss, metrics = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="mean", return_metrics=True)
loss.backward()
triton_modules = {"_triton_backend", "_launch", "_kernel_math", "_tile_kernels", "_row_kernels", "_target_kernels",
                  "_elementwise_kernels"}
triton_modules = {name for name in triton_modules if flce.__name__ + "." + name in sys.modules}
assert not triton_modules, triton_modules
out = dict(loss=loss.detach(), grad_hidden=hidden.grad, grad_weight=weight.grad, metrics=metrics,
           package=flce.__file__)
"""

# Then the same call under TRITON_INTERPRET=1, which asks for the Triton kernels.
INTERPRETED_CALL = """
import os
os.environ["TRITON_INTERPRET"] = "1"
try:
    flce.fused_linear_cross_entropy(hidden, weight, targets)
except ImportError as error:
    out["interpreter_error"] = str(error)
"""

SAVE = """
torch.save(out, "out.pt")
"""

MISSING_TRITON = "and triton is not installed: pip install triton"


def _run_without_triton(script: str, cwd, **env: str) -> dict:
    """Runs ``script`` (unindented) after NO_TRITON in a fresh Python (no TRITON_INTERPRET, no LOCAL_KERNELS but
    ``env``'s, and none of this checkout on PYTHONPATH but ``env``'s) in ``cwd``; returns what it saved to out.pt.
    Other PYTHONPATH entries stay: where packages such as ``kernels`` are installed with pip's ``--target``."""
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCAL_KERNELS", "PYTHONPATH")}
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and not Path(p).resolve().is_relative_to(ROOT)]
    paths = [*filter(None, [env.pop("PYTHONPATH", None)]), *inherited]
    environ.update(env, **({"PYTHONPATH": os.pathsep.join(paths)} if paths else {}))
    result = subprocess.run([sys.executable, "-c", NO_TRITON + script], cwd=cwd, env=environ,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(cwd / "out.pt")


def _save_inputs(cwd):
    """fp32 CPU inputs (a fifth of the rows ignored) in cwd/inputs.pt; returns them."""
    hidden, weight, targets, _ = make_inputs(48, 32, 130, torch.float32, seed=11, device="cpu", ignore=0.2)
    torch.save((hidden, weight, targets), cwd / "inputs.pt")
    return hidden, weight, targets


def _assert_step_matches_reference(out: dict, hidden, weight, targets) -> None:
    ref = reference(hidden, weight, targets, reduction="mean", grad_output=torch.tensor(1.0))
    # fp32 on the CPU: the PyTorch backend's fp32 rounding over H = 32, V = 130 (conftest's CPU fp32 tolerances).
    tol, grad_tol = tolerance(torch.float32, "loss"), tolerance(torch.float32, "grad")
    assert_rel(out["loss"], ref.loss, tol, "loss", floor=1.0)
    assert_rel(out["grad_hidden"], ref.grad_hidden, grad_tol, "grad_hidden")
    assert_rel(out["grad_weight"], ref.grad_weight, grad_tol, "grad_weight")
    metrics = out["metrics"]
    assert int(metrics["num_valid_tokens"]) == ref.num_valid
    # rows whose argmax a rounding could flip may count either way
    correct = int(metrics["num_correct_tokens"])
    assert ref.num_correct_unambiguous <= correct <= ref.num_correct_unambiguous + ref.num_ambiguous
    assert_rel(metrics["entropy_sum"], ref.entropy_sum, tol, "entropy_sum", floor=ref.num_valid)


@pytest.fixture(scope="module")
def package_without_triton(tmp_path_factory):
    """The package from torch-ext/, imported and trained in a Python without triton."""
    cwd = tmp_path_factory.mktemp("no_triton_package")
    inputs = _save_inputs(cwd)
    script = "import fused_linear_ce as flce\n" + STEP + INTERPRETED_CALL + SAVE
    return _run_without_triton(script, cwd, PYTHONPATH=str(ROOT / "torch-ext")), inputs


def test_package_trains_without_triton(package_without_triton):
    """import fused_linear_ce and a training step with metrics on CPU tensors, triton absent."""
    out, inputs = package_without_triton
    assert Path(out["package"]).resolve() == ROOT / "torch-ext" / "fused_linear_ce" / "__init__.py"
    _assert_step_matches_reference(out, *inputs)


def test_interpreter_without_triton_says_to_install_it(package_without_triton):
    """TRITON_INTERPRET=1 asks for the Triton kernels on CPU tensors: without triton, a clear
    ImportError rather than the PyTorch path in its place."""
    out, _ = package_without_triton
    assert out["interpreter_error"] == (
        "TRITON_INTERPRET=1 runs the Triton kernels in Triton's CPU interpreter (unset it for the PyTorch path "
        f"on CPU tensors), {MISSING_TRITON}")


def test_hub_cpu_variant_trains_without_triton(tmp_path):
    """The card's get_kernel line, offline with LOCAL_KERNELS, loads build/torch-cpu, which trains
    without triton."""
    inputs = _save_inputs(tmp_path)
    script = textwrap.dedent("""
        from kernels import get_kernel
        flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True, backend="cpu")
    """) + STEP + SAVE
    out = _run_without_triton(script, tmp_path, LOCAL_KERNELS=f"qgallouedec/fused-linear-ce={ROOT}",
                              HF_HUB_OFFLINE="1")
    assert Path(out["package"]).resolve() == ROOT / "build" / "torch-cpu" / "__init__.py"
    _assert_step_matches_reference(out, *inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_tensors_without_triton_say_to_install_it(tmp_path):
    """CUDA tensors need the Triton kernels: without triton, an ImportError that says so."""
    script = textwrap.dedent("""
    import torch
    import fused_linear_ce as flce
    hidden, weight = torch.randn(4, 8, device="cuda"), torch.randn(6, 8, device="cuda")
    try:
        flce.fused_linear_cross_entropy(hidden, weight, torch.tensor([0, 1, 2, 3], device="cuda"))
    except ImportError as error:
        out = dict(error=str(error))
    torch.save(out, "out.pt")
    """)
    out = _run_without_triton(script, tmp_path, PYTHONPATH=str(ROOT / "torch-ext"))
    assert out["error"] == f"fused_linear_ce runs Triton kernels on CUDA tensors, {MISSING_TRITON}"
