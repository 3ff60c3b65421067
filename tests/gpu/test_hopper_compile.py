"""The logit kernel compiles for Hopper (sm_90) in every mode, also on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts programs that the GPU
compiler refuses (seen: a branch on a tile-wide value inside the flattened persistent loop,
"'scf.if' op region control flow edge ... source has 1 operands, but target successor needs 6").
``scripts/compile_sm90.py`` compiles the kernel through Triton's own compiler instead; it runs in
a subprocess because this session's kernels are decorated for the interpreter.

Opt-in on a machine without CUDA (minutes of compiling for a GPU it does not have):
``python -m pytest -m sm90``; on a CUDA machine these run with the rest of the suite."""

import os
import subprocess
import sys

import pytest
from conftest import HAS_CUDA, ROOT

SCRIPT = ROOT / "scripts" / "compile_sm90.py"
pytestmark = pytest.mark.sm90


@pytest.fixture(autouse=True)
def _opt_in_without_cuda(request):
    if not HAS_CUDA and "sm90" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("compiles the kernels for Hopper, minutes on a CPU-only machine: opt in with pytest -m sm90")


def _compile(*args):
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("flags, modes", [
    ("", "0,1,2,3"),
    # mode 3 (factored) takes none of these options
    ("RETURN_METRICS=1,HAS_BIAS=1,HAS_SOFTCAP=1,HAS_LOGIT_SCALE=1,EVEN_V=0", "0,1,2"),
    ("HAS_SMOOTHING=1,HAS_Z_LOSS=1,HAS_CLASS_WEIGHT=1,EVEN_V=0", "0,1,2"),
    ("PICK_TARGET=0,RETURN_METRICS=1", "0,1"),  # the statistics sweeps without the target pick
])
def test_every_mode_compiles_for_sm90(flags, modes):
    run = _compile("--modes", modes, "--flags", flags)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": ok ") == len(modes.split(","))


def test_a_combination_the_launches_never_make_is_refused():
    """The factored mode with a bias fails its static assertion: the check can fail."""
    run = _compile("--modes", "3", "--flags", "HAS_BIAS=1")
    assert run.returncode == 1 and "one factor per row" in run.stdout


def test_the_row_kernels_compile_for_sm90():
    """The per-row kernels (merge, finalize, factors, the fused factored pass, the tensor-core
    target logit, the row scaling with its target terms, grad_weight's target segments and
    their sort keys, the target counts and flags, the range check, the rows' order, the skipped
    rows' zeros), flags off
    and on, at their launches' block sizes (the order's largest: 4096 rows at 8 warps) and with
    their launches' unit strides and divisibility; the target logit's product runs on wgmma, as
    the logit kernel's does (its rounding is what it must share), and the memory-bound passes
    do not; none spills registers to local memory (``_row_factors_kernel`` did, 5 KB, at 64 rows
    a program)."""
    run = _compile("--modes", "0", "--row-kernels")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": ok ") == 1 + 2 * 13
    lines = [line for line in run.stdout.splitlines() if line.startswith("_")]
    assert [" wgmma " in line for line in lines] == [name.startswith("_picked_logit_dot") for name in lines]
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["spills=0"] * len(lines)


def test_the_gluon_statistics_kernel_compiles_for_sm90():
    """``_gluon_stats``' kernel (the statistics in Gluon, which the interpreter cannot run) for
    bf16 and fp16, whole and partial vocabulary tiles, with and without the training sweep's
    stored exponentials: three warpgroups of four m64n256k16 products a K step, with their
    registers set by setmaxnreg, the forward's without a spill (the opt-in training sweep spills a
    few bytes with Triton 3.9, none with the 3.6 it is measured with), and the training sweep's
    staging tiles (48 KB) within an SM's 227 KB of shared memory beside the ring."""
    run = _compile("--modes", "0", "--gluon")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("_gluon_stats")]
    assert len(lines) == 8 and all(": ok " in line for line in lines), run.stdout
    assert all(" spills=0 " in line for line in lines if "STORE_EXP=0" in line), run.stdout
    shared = {int(line.split(": ok ")[1].split()[0]) for line in lines if "STORE_EXP=1" in line}
    assert len(shared) == 1 and shared.pop() <= 227 * 1024, run.stdout
    assert all(line.endswith("wgmma.m64n256k16=12 setmaxnreg=True") for line in lines), run.stdout
