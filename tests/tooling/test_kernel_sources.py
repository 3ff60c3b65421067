"""The kernels' sources against the limits the package keeps: no Triton or Gluon function takes
more than 28 parameters (Liger-Kernel's fused linear cross-entropy kernel takes 28, Triton's
attention tutorial 29), and no module of kernels is over 700 lines. Read from the sources, no
kernel compiled."""

import ast

import pytest
from conftest import ROOT

SOURCES = ROOT / "torch-ext" / "fused_linear_ce"
KERNEL_MODULES = ("_kernel_math", "_tile_kernels", "_row_kernels", "_target_kernels", "_elementwise_kernels",
                  "_divergence_kernels", "_gluon_stats")
MAX_PARAMETERS = 28
MAX_LINES = 700


def _jit_functions(module: str) -> dict[str, int]:
    """Each ``@triton.jit`` / ``@gluon.jit`` function of ``module`` and its parameter count."""
    tree = ast.parse((SOURCES / f"{module}.py").read_text())
    return {node.name: len(node.args.args) + len(node.args.kwonlyargs) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)}


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernels_take_at_most_28_parameters(module):
    functions = _jit_functions(module)
    assert functions, module
    over = {name: count for name, count in functions.items() if count > MAX_PARAMETERS}
    assert not over, over


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_modules_are_at_most_700_lines(module):
    lines = len((SOURCES / f"{module}.py").read_text().splitlines())
    assert lines <= MAX_LINES, lines


def test_every_kernel_lives_in_a_kernel_module():
    """The modules above hold every Triton and Gluon function of the package: the launch and
    backend modules import them."""
    others = [path.stem for path in SOURCES.glob("*.py") if path.stem not in KERNEL_MODULES]
    assert "_triton_backend" in others
    assert {module: functions for module in others if (functions := _jit_functions(module))} == {}
