"""Makes the Hub's build folders from the sources, as kernel-builder does for a noarch kernel.

torch-ext/fused_linear_ce/*.py and its data files (*.json) are copied flat into build/torch-cuda/ and build/torch-cpu/,
with a symbols.json (the public functions and layers, which ``kernels describe-api`` lists) and a
metadata.json: an id unique to the sources and the backend, the upstream and source repositories
(``kernels info``), the provenance (this script in kernel-builder's place), and the digest that
kernels >= 0.19 verifies on load: each file of the variant but metadata.json (and __pycache__),
by its path relative to the variant, the base64 of its SHA-256 (kernels' ``Digest.hash_variant``).
build/ is not tracked on main: the tests (tests/conftest.py) and scripts/gpu-check make it before they load
the checkout, and scripts/release commits it to the Hub's version branch. Only files that differ are written.
With --check, nothing is written: the exit status says whether build/ matches the sources.

    python scripts/build_variants.py [--check]
"""

import argparse
import ast
import base64
import hashlib
import json
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "torch-ext" / "fused_linear_ce"
BACKENDS = ("cuda", "cpu")
REPOSITORY = "https://huggingface.co/qgallouedec/fused-linear-ce"  # the sources ship in it (torch-ext/)
PROVENANCE = {"kernel-builder": {"version": "scripts/build_variants.py"}}  # no kernel-builder, no git state:
# the commit of a build that is itself committed cannot be written into it


def symbols(sources: dict[str, bytes]) -> dict:
    """symbols.json (schema 1, as ``kernels describe-api`` reads it): the functions among
    ``__init__.__all__`` and the layers of layers.py (their ``has_backward`` and ``can_torch_compile``),
    read from the sources' syntax trees (nothing is imported)."""
    trees = {name.removesuffix(".py"): ast.parse(content) for name, content in sources.items() if name.endswith(".py")}
    exported = next(ast.literal_eval(node.value) for node in trees["__init__"].body
                    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets))
    functions = {node.name for tree in trees.values() for node in tree.body if isinstance(node, ast.FunctionDef)}
    layers = []
    for node in trees["layers"].body:
        if isinstance(node, ast.ClassDef):
            flags = {t.id: n.value.value for n in node.body if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
            layers.append({"name": node.name, "attributes": {k: flags.get(k) for k in ("has_backward",
                                                                                     "can_torch_compile")}})
    return {"schema_version": 1, "functions": [{"name": n} for n in exported if n in functions], "layers": layers}


def digest(files: dict[str, bytes]) -> dict:
    """The metadata's digest of a variant's files (relative path -> content)."""
    return {"algorithm": "sha256",
            "files": {path: base64.b64encode(hashlib.sha256(content).digest()).decode()
                      for path, content in sorted(files.items())}}


def expected_files() -> dict[Path, bytes]:
    """Every file of build/ as it should be: relative path -> content."""
    general = tomllib.loads((ROOT / "build.toml").read_text())["general"]
    sources = {p.name: p.read_bytes() for p in sorted(SOURCES.iterdir()) if p.suffix in (".py", ".json")}
    source_digest = hashlib.sha256()
    for name, content in sources.items():
        source_digest.update(name.encode() + b"\0" + content + b"\0")
    variant_files = {**sources, "symbols.json": (json.dumps(symbols(sources), indent=2) + "\n").encode()}
    files = {}
    for backend in BACKENDS:
        variant = Path(f"torch-{backend}")
        for name, content in variant_files.items():
            files[variant / name] = content
        metadata = {
            "name": general["name"],
            "id": f"_{general['name'].replace('-', '_')}_{backend}_{source_digest.hexdigest()[:10]}",
            "version": general["version"],
            "license": general["license"],
            "upstream": REPOSITORY,
            "source": REPOSITORY,
            "python-depends": [],
            "backend": {"type": backend},
            "provenance": PROVENANCE,
            "digest": digest(variant_files),
        }
        files[variant / "metadata.json"] = (json.dumps(metadata, indent=2) + "\n").encode()
    return files


def actual_files(build: Path) -> dict[Path, bytes]:
    return {p.relative_to(build): p.read_bytes() for p in sorted(build.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare build/ with the sources")
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build")
    args = parser.parse_args()
    expected = expected_files()
    if args.check:
        actual = actual_files(args.build_dir) if args.build_dir.exists() else {}
        drift = sorted(str(p) for p in expected.keys() | actual.keys() if expected.get(p) != actual.get(p))
        if drift:
            print("build/ differs from the sources; run python scripts/build_variants.py:\n  " + "\n  ".join(drift))
            return 1
        return 0
    for path in actual_files(args.build_dir) if args.build_dir.exists() else {}:
        if path not in expected:
            (args.build_dir / path).unlink()
    for path, content in expected.items():
        target = args.build_dir / path
        if not target.exists() or target.read_bytes() != content:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
