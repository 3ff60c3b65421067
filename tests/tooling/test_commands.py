"""The README's commands and the examples, run as subprocesses: examples/demo.py (with and without
the interpreter, and its message when the interpreter's packages are missing), .ci/run's test
command, what a plain test run selects (without CUDA it skips the Hopper compile tests, minutes for
a GPU the machine does not have; ``-m sm90`` selects them), and examples/distill_topk.py (the
student trained with ``fused_linear_sparse_kl`` on the teacher's stored top-k log-probs and the same
student trained with the loss on its materialised log-softmax log the same losses, and the loss
goes down)."""

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import HAS_CUDA, ROOT

DEMO = ROOT / "examples" / "demo.py"
HOPPER = "tests/gpu/test_hopper_compile.py"


def run_demo(*args: str, interpret: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it without CUDA
    if interpret:
        args = (*args, "--interpret")
    proc = subprocess.run([sys.executable, str(DEMO), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"demo exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def table(stdout: str) -> dict[str, list[float]]:
    """Rows of the demo's table: step (or "eval") -> [loss, loss, accuracy, accuracy, entropy, entropy],
    kernel first in each pair."""
    rows = {}
    for line in stdout.splitlines():
        fields = line.split()
        if len(fields) >= 7 and re.fullmatch(r"\d+|eval", fields[0]):
            rows[fields[0]] = [float(x) for x in fields[1:7]]
    return rows


def check_matches(stdout: str, steps: int, fp32: bool):
    rows = table(stdout)
    assert {"1", str(steps), "eval"} <= rows.keys(), stdout
    # fp32 on CPU: the same maths up to rounding; bf16 on a GPU: the kernel's logits are fp32
    # accumulators while PyTorch's are rounded to bf16, and the two trainings drift apart.
    loss_tol, metric_tol = (1e-4, 1e-3) if fp32 else (5e-2, 5e-2)
    for step, (loss_k, loss_t, acc_k, acc_t, ent_k, ent_t) in rows.items():
        assert math.isfinite(loss_k) and loss_k > 0, (step, stdout)
        assert loss_k == pytest.approx(loss_t, abs=loss_tol), (step, stdout)
        assert acc_k == pytest.approx(acc_t, abs=max(metric_tol, 2.5e-3)), (step, stdout)  # 1 token in 512 = 0.002
        assert ent_k == pytest.approx(ent_t, abs=metric_tol), (step, stdout)
    # The losses go down: training happened, on both sides.
    assert rows[str(steps)][0] < rows["1"][0] and rows[str(steps)][1] < rows["1"][1], stdout
    assert "max |loss kernel - loss torch|" in stdout


def test_demo_default_path():
    """The README's main command, shortened: CUDA (bf16) when there is a GPU, else the chunked PyTorch path."""
    stdout = run_demo("--steps", "3", "--log-every", "1")
    assert ("Triton kernels" if HAS_CUDA else "chunked PyTorch path") in stdout
    check_matches(stdout, steps=3, fp32=not HAS_CUDA)


@pytest.mark.slow
@pytest.mark.skipif(tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4),
                    reason="triton 3.6's interpreter turns 1-element arrays into ints, which numpy >= 2.4 refuses")
def test_demo_interpreter():
    """--interpret: the Triton kernels themselves, in the CPU interpreter."""
    stdout = run_demo("--steps", "2", "--batch", "4", "--seq", "32", interpret=True)
    assert "Triton interpreter" in stdout
    check_matches(stdout, steps=2, fp32=True)


def readme_commands() -> list[str]:
    """The one-line commands of the README's "Run it" section (the lines of its ```bash block)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Run it", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README: no ```bash block under '## Run it'"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_commands_match_ci():
    """Exactly two commands; .ci/run runs the second (the tests) verbatim, and the first runs the demo."""
    main, tests = readme_commands()
    assert "examples/demo.py" in main and "pytest" in tests
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(line == tests or line.startswith(tests + " ||") for line in ci_lines), (
        f".ci/run does not run the README's test command {tests!r}"
    )


@pytest.mark.parametrize("missing", [("triton",), ("triton", "numpy")])
def test_interpret_without_triton_says_what_to_install(missing):
    hide = "".join(f"sys.modules[{name!r}] = None; " for name in missing)  # import and find_spec fail
    code = f"import runpy, sys; {hide}sys.argv = [{str(DEMO)!r}, '--interpret']; runpy.run_path(sys.argv[0], " \
           f"run_name='__main__')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (  # (torch warns first when numpy is hidden)
        f"--interpret runs the Triton kernels in Triton's CPU interpreter, which needs {' and '.join(missing)}: "
        'pip install -e ".[demo,triton]" (or drop --interpret: CPU tensors then take the kernel\'s PyTorch path, '
        "which needs neither)")


def _pytest(*args):
    env = {**os.environ, "PYTEST_ADDOPTS": ""}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.skipif(HAS_CUDA, reason="on a CUDA machine the compile tests run by default")
def test_a_cpu_only_run_skips_the_hopper_compile_tests():
    run = _pytest(HOPPER, "-rs")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "7 skipped" in run.stdout and "opt in with pytest -m sm90" in run.stdout, run.stdout
    listed = _pytest(HOPPER, "-m", "sm90", "--collect-only")
    assert "7 tests collected" in listed.stdout, listed.stdout


def test_distillation_example_matches_the_materialised_loss():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the PyTorch path on CPU tensors
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "distill_topk.py"), "--device", "cpu",
                           "--steps", "5", "--teacher-steps", "10", "--batch", "4"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    rows = [line.split() for line in proc.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(1, 6)), proc.stdout
    fused, reference = ([float(r[i]) for r in rows] for i in (1, 2))
    # fp32, the same maths: the two differ by the order of their sums over the vocabulary (a few
    # ulps of each log-prob), carried through 5 AdamW steps of a 1-layer model
    for step, (a, b) in enumerate(zip(fused, reference, strict=True), start=1):
        assert abs(a - b) <= 1e-5 * abs(b), (step, proc.stdout)
    assert fused[-1] < 0.9 * fused[0], proc.stdout  # the student learns from the teacher's answers
