"""The package's layout limits, read from its sources' syntax trees: modules of at most 700 lines,
function bodies of at most 90, Triton and Gluon kernels of at most 28 parameters (Liger-Kernel's
fused linear cross-entropy kernel takes 28, Triton's attention tutorial 29), and a public API that
is exactly ``__init__.__all__``."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "torch-ext" / "fused_linear_ce"
MODULE_LINES = 700
BODY_LINES = 90
KERNEL_PARAMETERS = 28


def _modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE)): ast.parse(path.read_text(), filename=str(path))
            for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _functions(tree: ast.Module):
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's end."""
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                 str):
        body = body[1:]
    return function.end_lineno - body[0].lineno + 1 if body else 0


def _decorator_name(decorator: ast.expr) -> str:
    """``triton.jit`` for ``@triton.jit`` and ``@triton.jit(do_not_specialize=...)``."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target)


def _kernels() -> list[tuple[str, ast.FunctionDef, str]]:
    """(module, function, its jit decorator) of each function named ``*_kernel`` that a ``jit`` decorates."""
    found = []
    for module, tree in MODULES.items():
        for function in _functions(tree):
            jits = [name for name in map(_decorator_name, function.decorator_list) if name.endswith("jit")]
            if function.name.endswith("_kernel") and jits:
                found.append((module, function, jits[0]))
    return found


def _parameter_count(function: ast.FunctionDef) -> int:
    arguments = function.args
    return (len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
            + (arguments.vararg is not None) + (arguments.kwarg is not None))


def test_the_layout_is_read_from_the_package():
    """The limits below are checked on the real package: its modules, their functions and kernels
    of both languages (a wrong path or decorator pattern would make them pass vacuously)."""
    assert {"__init__.py", "interface.py", "_validation.py"} <= MODULES.keys()
    assert sum(len(_functions(tree)) for tree in MODULES.values()) > 100
    decorators = {decorator.split(".")[0] for _, _, decorator in _kernels()}
    assert {"triton", "gluon"} <= decorators


def test_no_module_is_over_700_lines():
    lines = {module: len((PACKAGE / module).read_text().splitlines()) for module in MODULES}
    assert {module: n for module, n in lines.items() if n > MODULE_LINES} == {}


def test_no_function_body_is_over_90_lines():
    long_bodies = {f"{module}:{function.lineno} {function.name}": _body_lines(function)
                   for module, tree in MODULES.items() for function in _functions(tree)}
    assert {name: n for name, n in long_bodies.items() if n > BODY_LINES} == {}


def test_body_lines_count_from_the_first_statement_after_the_docstring():
    function = ast.parse('def f(x):\n    """Doc\n    string."""\n    y = x\n\n    return y\n').body[0]
    assert _body_lines(function) == 3
    assert _body_lines(ast.parse("def g():\n    pass\n").body[0]) == 1


def test_no_kernel_takes_over_28_parameters():
    counts = {f"{module} {function.name}": _parameter_count(function) for module, function, _ in _kernels()}
    assert {name: n for name, n in counts.items() if n > KERNEL_PARAMETERS} == {}


def _public_bindings(tree: ast.Module) -> set[str]:
    """The names ``__init__`` binds at its top level that do not start with an underscore."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return {name for name in names if not name.startswith("_")}


def _declared_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    pytest.fail("__init__.py declares no __all__")


def test_the_public_api_is_exactly_all():
    tree = MODULES["__init__.py"]
    declared = _declared_all(tree)
    assert len(declared) == len(set(declared)), "a name is listed twice in __all__"
    assert _public_bindings(tree) == set(declared)
