"""examples/demo.py --interpret without triton: a message that says what to install, not a traceback."""

import subprocess
import sys

import pytest
from conftest import ROOT

DEMO = ROOT / "examples" / "demo.py"


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
