"""Every ```python block of docs/integrations.md, and of README.md's quickstart,
metrics and integrations sections, runs as is (tiny CPU models, nothing downloaded) and its own
asserts hold.

Each block runs in a fresh namespace from the repository root, on the CPU's PyTorch path (as a
user's CPU run, without TRITON_INTERPRET). Without CUDA, ``torch.compile`` is given the
"aot_eager" backend: Inductor's cold C++ build would take a minute here (test_compile.py covers
the compiled results)."""

import re
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [  # (file, the heading of the section to read; None: the whole file)
    ("docs/integrations.md", None),
    ("README.md", "Quickstart: a transformers model"),
    ("README.md", "Metrics"),
    ("README.md", "Per-token outputs: log-probs and entropy for RL and preference training"),
    ("README.md", "Distillation"),
    ("README.md", "Integrations"),
]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _section(text: str, heading: str | None) -> str:
    if heading is None:
        return text
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.MULTILINE)
    if match is None:
        return ""
    level = len(match.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[match.end():], re.MULTILINE)
    return text[match.end(): match.end() + end.start()] if end else text[match.end():]


def _snippets():
    found = []
    for name, heading in SOURCES:
        path = ROOT / name
        if not path.exists():
            found.append(pytest.param(name, 0, None, marks=pytest.mark.skip(reason=f"{name} is absent"), id=name))
            continue
        text = path.read_text()
        section = _section(text, heading)
        if not section:  # a renamed heading fails here rather than running nothing
            found.append(pytest.param(name, 0, f"raise AssertionError({f'no section {heading!r}'!r})", id=name))
            continue
        offset = text.index(section) if section else 0
        for match in _BLOCK.finditer(section):
            line = text.count("\n", 0, offset + match.start()) + 1
            found.append(pytest.param(name, line, match.group(1), id=f"{name}:{line}"))
    return found


def test_docs_have_snippets():
    assert len([p for p in _snippets() if p.values[2] is not None]) >= 10


@pytest.mark.parametrize(("name", "line", "code"), _snippets())
def test_snippet_runs(flce, monkeypatch, name, line, code):
    for module in ("transformers", "trl", "kernels"):  # the integrations' optional dependencies
        if re.search(rf"^(from|import) {module}\b", code, re.MULTILINE):
            pytest.importorskip(module)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not HAS_CUDA:
        compile_ = torch.compile
        monkeypatch.setattr(torch, "compile", lambda *a, **k: compile_(*a, **{**k, "backend": "aot_eager"}))
    torch.manual_seed(0)
    torch._dynamo.reset()
    # A real module, so that torch.compile (Inductor on a GPU) can find the snippet's globals.
    module = types.ModuleType("__snippet__")
    monkeypatch.setitem(sys.modules, "__snippet__", module)
    exec(compile(code, f"{name}:{line}", "exec"), module.__dict__)
