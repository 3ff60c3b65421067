"""Without CUDA, a plain test run skips the Hopper compile tests (minutes for a GPU the machine does
not have); ``-m sm90`` selects them."""

import os
import subprocess
import sys

import pytest
from conftest import HAS_CUDA, ROOT

HOPPER = "tests/gpu/test_hopper_compile.py"


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
