"""The Hub packaging: build/ is made from the sources and released to the version branch,
metadata.json is what kernels expects, and the kernel loads as the model card says, as a variant
folder and as the pip package."""

import json
import os
import subprocess
import sys
from pathlib import Path

import kernels
import pytest
import torch
from conftest import DEVICE, ROOT, assert_rel, make_inputs, tolerance
from reference import reference

VARIANTS = {"cuda": ROOT / "build" / "torch-cuda", "cpu": ROOT / "build" / "torch-cpu"}


def test_build_check_detects_drift(tmp_path):
    """--check is not vacuous: a build folder missing a file or holding a changed one fails it."""
    build = tmp_path / "build"
    subprocess.run([sys.executable, "scripts/build_variants.py", "--build-dir", str(build)], cwd=ROOT, check=True)
    check = [sys.executable, "scripts/build_variants.py", "--check", "--build-dir", str(build)]
    assert subprocess.run(check, cwd=ROOT, capture_output=True).returncode == 0
    (build / "torch-cpu" / "interface.py").write_text("# edited\n")
    result = subprocess.run(check, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and "torch-cpu/interface.py" in result.stdout


def test_release_commits_the_build_to_the_version_branch(tmp_path):
    """scripts/release, in a repository of this checkout's sources (build/ untracked): the branch v1
    (build.toml's version, which get_kernel(..., version=1) resolves) holds HEAD's files plus build/ exactly
    as build_variants.py makes it, with HEAD as a parent; a second release keeps the first as a parent;
    main's own tree and index stay without build/."""
    repo = tmp_path / "repo"
    for path in ["build.toml", ".gitignore", "scripts/build_variants.py", "scripts/release",
                 *(str(p.relative_to(ROOT)) for p in (ROOT / "torch-ext" / "fused_linear_ce").iterdir()
                   if p.suffix in (".py", ".json"))]:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_bytes((ROOT / path).read_bytes())
    (repo / "scripts" / "release").chmod(0o755)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q", "-b", "main")
    git("add", "-A")
    git("commit", "-q", "-m", "sources")
    subprocess.run(["scripts/release"], cwd=repo, env=env, check=True, capture_output=True)
    first = git("rev-parse", "v1")
    assert git("rev-parse", "v1^1") == git("rev-parse", "main")
    released = set(git("ls-tree", "-r", "--name-only", "v1").splitlines())
    expected = {str(path.relative_to(ROOT)) for path in (ROOT / "build").rglob("*")
                if path.is_file() and "__pycache__" not in path.parts}
    assert expected and expected <= released
    assert released - expected == set(git("ls-tree", "-r", "--name-only", "main").splitlines())
    for path in sorted(expected):
        blob = subprocess.run(["git", "show", f"v1:{path}"], cwd=repo, env=env, check=True, capture_output=True).stdout
        assert blob == (ROOT / path).read_bytes(), path
    assert not any(line.startswith("build/") for line in git("ls-files").splitlines())
    (repo / "NOTE").write_text("a change\n")
    git("add", "NOTE")
    git("commit", "-q", "-m", "a change")
    subprocess.run(["scripts/release"], cwd=repo, env=env, check=True, capture_output=True)
    assert git("rev-parse", "v1^1") == git("rev-parse", "main") and git("rev-parse", "v1^2") == first


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


# ---- what current kernels releases verify and show ------------------------------------------------
# Tested: the pinned kernels (0.17.2) and the current release, installed into a temporary folder
# from PyPI (skipped where PyPI is out of reach).
CURRENT_KERNELS = "0.19.1"
LOAD = """
import logging, sys, warnings
from pathlib import Path
warnings.simplefilter("error")
logging.basicConfig(level=logging.WARNING, format="LOGGED %(levelname)s %(name)s: %(message)s")
import kernels
for variant in sys.argv[1:]:
    module = kernels.get_local_kernel(Path(variant))
    print(kernels.__version__ if hasattr(kernels, "__version__") else "", module.__name__)
"""


@pytest.fixture(scope="session")
def current_kernels(tmp_path_factory) -> dict:
    """The environment of a subprocess that imports kernels CURRENT_KERNELS (its own dependencies
    are this environment's, or installed beside it if they are missing)."""
    target = tmp_path_factory.mktemp(f"kernels-{CURRENT_KERNELS}")
    env = {**os.environ, "PYTHONPATH": str(target)}
    for extra in (["--no-deps"], []):
        install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                  "--retries", "1", "--timeout", "20", "--target", str(target), *extra,
                                  f"kernels=={CURRENT_KERNELS}"],
                                 capture_output=True, text=True, timeout=300)
        if install.returncode != 0:
            pytest.skip(f"kernels {CURRENT_KERNELS} could not be installed from PyPI: {install.stderr[-300:]}")
        check = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__version__)"],
                               capture_output=True, text=True, env=env)
        if check.stdout.strip() == CURRENT_KERNELS:
            return env
    pytest.fail(f"kernels {CURRENT_KERNELS} does not import: {check.stderr[-500:]}")


def _files_of(variant: Path) -> dict[str, bytes]:
    return {p.relative_to(variant).as_posix(): p.read_bytes() for p in sorted(variant.rglob("*"))
            if p.is_file() and p.name != "metadata.json" and "__pycache__" not in p.parts}


@pytest.mark.parametrize("backend", list(VARIANTS))
def test_metadata_records_a_digest_of_every_file_and_the_provenance(backend):
    """kernels >= 0.19 hashes each file of the variant but metadata.json (SHA-256, base64) and
    compares with the metadata's digest; ``kernels info`` shows upstream and source."""
    import base64
    import hashlib

    data = json.loads((VARIANTS[backend] / "metadata.json").read_text())
    files = _files_of(VARIANTS[backend])
    assert "symbols.json" in files and "__init__.py" in files
    assert data["digest"] == {"algorithm": "sha256", "files": {
        path: base64.b64encode(hashlib.sha256(content).digest()).decode() for path, content in files.items()}}
    assert data["upstream"] == data["source"] == "https://huggingface.co/qgallouedec/fused-linear-ce"
    assert data["provenance"] == {"kernel-builder": {"version": "scripts/build_variants.py"}}


def test_symbols_list_the_public_api(flce):
    """symbols.json (what ``kernels describe-api`` prints) names the public functions of __all__ and
    the layers with their flags, as the loaded kernel has them."""
    import inspect

    symbols = json.loads((Path(flce.__file__).parent / "symbols.json").read_text())
    assert symbols["schema_version"] == 1
    assert [f["name"] for f in symbols["functions"]] == [
        name for name in flce.__all__ if inspect.isfunction(getattr(flce, name))]
    assert "fused_linear_cross_entropy" in [f["name"] for f in symbols["functions"]]
    layers = [(name, cls) for name, cls in vars(flce.layers).items()
              if inspect.isclass(cls) and issubclass(cls, torch.nn.Module) and cls.__module__ == flce.layers.__name__]
    assert symbols["layers"] == [{"name": name, "attributes": {"has_backward": cls.has_backward,
                                                              "can_torch_compile": cls.can_torch_compile}}
                                 for name, cls in layers]


def _load(env: dict | None, *variants: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD, *map(str, variants)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_loads_without_warnings_under_the_pinned_kernels():
    run = _load(None, *VARIANTS.values())
    assert run.returncode == 0 and "LOGGED" not in run.stderr and "arning" not in run.stderr, run.stderr
    assert run.stdout.count("_fused_linear_ce_") == 2


def test_loads_without_warnings_under_the_current_kernels(current_kernels, tmp_path):
    """Both variants load under kernels CURRENT_KERNELS without a warning (no missing digest); a
    changed file fails its digest, so the check is real."""
    run = _load(current_kernels, *VARIANTS.values())
    assert run.returncode == 0 and "LOGGED" not in run.stderr and "arning" not in run.stderr, run.stderr
    assert run.stdout.splitlines()[0].startswith(CURRENT_KERNELS)
    changed = tmp_path / "torch-cpu"
    subprocess.run(["cp", "-r", str(VARIANTS["cpu"]), str(changed)], check=True)
    (changed / "layers.py").write_text((changed / "layers.py").read_text() + "# changed\n")
    run = _load(current_kernels, changed)
    assert run.returncode != 0 and "File hash mismatch for layers.py" in run.stderr, run.stderr


def test_describe_api_and_info_under_the_current_kernels(current_kernels, flce):
    """``kernels describe-api <checkout>`` lists the public functions and the layer; ``kernels info``
    shows the upstream and source repositories."""
    def cli(*args):
        code = "import sys; from kernels._internals.cli import main; sys.argv = ['kernels', *sys.argv[1:]]; main()"
        run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                             env=current_kernels, cwd=ROOT, timeout=300)
        assert run.returncode == 0, run.stderr
        return run.stdout

    described = cli("describe-api", str(ROOT))
    functions = described.split("Functions:")[1].split("Layers:")[0].split()
    assert functions == [f["name"] for f in json.loads((VARIANTS["cpu"] / "symbols.json").read_text())["functions"]]
    assert "ForCausalLMLoss  has_backward=True  can_torch_compile=True" in described
    info = cli("info", str(ROOT))
    assert "Upstream: https://huggingface.co/qgallouedec/fused-linear-ce" in info
    assert "Source: https://huggingface.co/qgallouedec/fused-linear-ce" in info
