"""The Hub packaging: build/ matches the sources, metadata.json is what kernels expects, and
the kernel loads as the model card says, as a variant folder and as the pip package."""

import json
import subprocess
import sys
from pathlib import Path

import kernels
import pytest
import torch
from conftest import DEVICE, ROOT, assert_rel, make_inputs, tolerance
from reference import reference

VARIANTS = {"cuda": ROOT / "build" / "torch-cuda", "cpu": ROOT / "build" / "torch-cpu"}


def test_build_folder_matches_sources():
    """build/ is generated from torch-ext/ by scripts/build_variants.py; --check exits 1 on drift."""
    result = subprocess.run([sys.executable, "scripts/build_variants.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_build_check_detects_drift(tmp_path):
    """--check is not vacuous: a build folder missing a file or holding a changed one fails it."""
    build = tmp_path / "build"
    subprocess.run([sys.executable, "scripts/build_variants.py", "--build-dir", str(build)], cwd=ROOT, check=True)
    check = [sys.executable, "scripts/build_variants.py", "--check", "--build-dir", str(build)]
    assert subprocess.run(check, cwd=ROOT, capture_output=True).returncode == 0
    (build / "torch-cpu" / "interface.py").write_text("# edited\n")
    result = subprocess.run(check, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and "torch-cpu/interface.py" in result.stdout


@pytest.mark.parametrize("backend", list(VARIANTS))
def test_metadata(backend):
    path = VARIANTS[backend] / "metadata.json"
    data = json.loads(path.read_text())
    assert data["name"] == "fused-linear-ce"
    assert data["version"] == 1
    assert data["license"] == "apache-2.0"
    assert data["python-depends"] == []
    assert data["backend"] == {"type": backend}
    assert data["id"].startswith(f"_fused_linear_ce_{backend}_") and data["id"].isidentifier()
    # kernels' own parser accepts it and reads the same fields.
    meta = kernels.Metadata.read_from_file(str(path))
    assert str(meta.name) == "fused-linear-ce" and meta.version == 1 and meta.license == "apache-2.0"
    assert meta.id == data["id"] and list(meta.python_depends) == []
    assert str(meta.backend.backend_type) == backend


def _metadata_id(module) -> str:
    return json.loads((Path(module.__file__).parent / "metadata.json").read_text())["id"]


def test_card_line_loads_this_checkout(flce):
    """The fixture is the card's ``get_kernel("qgallouedec/fused-linear-ce", version=1,
    trust_remote_code=True)``: with LOCAL_KERNELS it is the variant of this checkout for this torch."""
    expected = VARIANTS["cuda" if torch.version.cuda else "cpu"]
    assert Path(flce.__file__).resolve().parent == expected.resolve()
    assert flce.__name__ == _metadata_id(flce)
    assert callable(flce.fused_linear_cross_entropy)


def test_ops_are_named_by_the_metadata_id(flce):
    """Ops live in torch.ops.<metadata id> (two loaded versions never clash); traced calls go
    through them (test_compile.py), while an eager call runs their implementation through an
    autograd.Function, without the operator's dispatch."""
    op_id = _metadata_id(flce)
    namespace = getattr(torch.ops, op_id)
    for op in ("forward", "backward", "scale_", "token_forward", "token_backward"):
        assert hasattr(namespace, op), op
    hidden, weight, targets, _ = make_inputs(5, 8, 11, torch.float32, seed=0)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets)
    assert type(loss.grad_fn).__name__ == "_EagerForwardBackward"


def test_cuda_variant_loads_as_a_folder_on_any_torch(flce):
    """``get_local_kernel`` on the variant folder (noarch: the CUDA variant imports on a CPU torch)."""
    module = kernels.get_local_kernel(VARIANTS["cuda"])
    assert module.__name__ == _metadata_id(module) and "_cuda_" in module.__name__
    assert module.__all__ == flce.__all__
    assert hasattr(torch.ops, module.__name__) and hasattr(getattr(torch.ops, module.__name__), "forward")
    hidden, weight, targets, _ = make_inputs(5, 8, 11, torch.float32, seed=1, requires_grad=False)
    loss = module.fused_linear_cross_entropy(hidden, weight, targets)
    assert_rel(loss, reference(hidden, weight, targets).loss, tolerance(torch.float32, "loss"), "loss")


def test_pip_package_exposes_the_same_api(flce):
    """``import fused_linear_ce`` (pip, editable here): the same public names as the Hub kernel
    built from the same checkout, and its ops in its own namespace."""
    try:
        import fused_linear_ce
    except ImportError:  # not pip-installed (a bare GPU machine): the layout pyproject.toml maps
        sys.path.insert(0, str(ROOT / "torch-ext"))
        import fused_linear_ce
    # An editable install may point at another checkout of the repository: compare with that
    # checkout's Hub build, which is this session's kernel when the checkout is this one.
    checkout = Path(fused_linear_ce.__file__).resolve().parents[2]
    hub = flce if checkout == ROOT.resolve() else kernels.get_local_kernel(checkout / "build" / Path(flce.__file__)
                                                                           .parent.name)
    assert "fused_linear_cross_entropy" in fused_linear_ce.__all__
    assert fused_linear_ce.__all__ == hub.__all__
    assert hasattr(torch.ops.fused_linear_ce, "forward")
    hidden, weight, targets, _ = make_inputs(5, 8, 11, torch.float32, seed=2, device=DEVICE, requires_grad=False)
    loss = fused_linear_ce.fused_linear_cross_entropy(hidden, weight, targets, reduction="sum")
    assert_rel(loss, hub.fused_linear_cross_entropy(hidden, weight, targets, reduction="sum"),
               tolerance(torch.float32, "loss"), "pip vs hub")


def test_benchmark_tables_are_generated_from_the_recorded_results():
    """BENCHMARKS.md and README's performance section are what benchmarks/report.py makes of
    benchmarks/results/*.json: no number typed by hand, none left stale."""
    pytest.importorskip("matplotlib")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
