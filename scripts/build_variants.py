"""Makes the Hub's build folders from the sources, as kernel-builder does for a noarch kernel.

torch-ext/fused_linear_ce/*.py (and the data files, *.json) are copied flat into build/torch-cuda/ and build/torch-cpu/
with a metadata.json whose id is unique to the sources and the backend. With --check,
nothing is written: the exit status says whether build/ matches the sources.

    python scripts/build_variants.py [--check]
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "torch-ext" / "fused_linear_ce"
BACKENDS = ("cuda", "cpu")


def expected_files() -> dict[Path, bytes]:
    """Every file of build/ as it should be: relative path -> content."""
    general = tomllib.loads((ROOT / "build.toml").read_text())["general"]
    sources = {p.name: p.read_bytes() for p in sorted(SOURCES.iterdir()) if p.suffix in (".py", ".json")}
    digest = hashlib.sha256()
    for name, content in sources.items():
        digest.update(name.encode() + b"\0" + content + b"\0")
    files = {}
    for backend in BACKENDS:
        variant = Path(f"torch-{backend}")
        for name, content in sources.items():
            files[variant / name] = content
        metadata = {
            "name": general["name"],
            "id": f"_{general['name'].replace('-', '_')}_{backend}_{digest.hexdigest()[:10]}",
            "version": general["version"],
            "license": general["license"],
            "python-depends": [],
            "backend": {"type": backend},
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
        (args.build_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (args.build_dir / path).write_bytes(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
