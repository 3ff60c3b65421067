"""The cold start: eager calls that import no torch._dynamo, the recorded specialisations
(``specializations.json``) against the kernels' parameters, and on a recorded GPU, a first call
whose kernels are all compiled by the parallel warm-up, none at their launches."""

import ast
import json
import os
import subprocess
import sys
import tempfile
import time
import types

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, ROOT, submodule

SOURCES = ROOT / "torch-ext" / "fused_linear_ce"
KINDS = ("loss", "metrics", "tokens:entropy,is_top1,log_probs", "tokens:entropy,log_probs", "tokens:log_probs")
SFT = "tokens:entropy,is_top1,log_probs"


EAGER_CHILD = r"""
import sys, torch
from kernels import get_kernel
flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
hidden = torch.randn(24, 32, device={device!r}, requires_grad=True)
weight = torch.randn(40, 32, device={device!r}, requires_grad=True)
targets = torch.randint(0, 40, (24,), device={device!r})
flce.fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)[0].backward()
flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none").sum().backward()  # recomputed
out = flce.fused_linear_log_probs(hidden, weight, targets, outputs=("log_probs", "entropy"))
(out.log_probs.sum() + out.entropy.sum()).backward()
print("torch._dynamo" in sys.modules)
"""


def test_eager_calls_import_no_dynamo():
    """Eager calls of both functions, with their backwards, run the operators' implementations
    directly: a torch.library operator's first eager call imports torch._dynamo (and sympy), which
    took 3 s of the H200's cold start."""
    run = subprocess.run([sys.executable, "-c", EAGER_CHILD.format(device=DEVICE)], env=dict(os.environ),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "False"


def _parameters(module: str) -> dict[str, list[str]]:
    tree = ast.parse((SOURCES / f"{module}.py").read_text())
    return {node.name: [a.arg for a in node.args.args] for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def _recorded() -> dict:
    return json.loads((SOURCES / "specializations.json").read_text())


def test_recorded_specializations_match_the_kernels():
    """Every entry names a kernel that still takes the parameters it was recorded with: a kernel
    whose parameters change needs ``scripts/record_specializations.py`` again (on the GPU), or its
    first calls compile it at the launch again."""
    recorded = _recorded()
    assert "sm_90" in recorded  # the GPU the package ships a table for (Hopper)
    for gpu, table in recorded.items():
        for kind in KINDS:
            entries = table["kinds"][kind]
            assert entries, (gpu, kind)
            for entry in entries:
                parameters = _parameters(entry["module"])
                assert entry["kernel"] in parameters, (gpu, kind, entry["kernel"])
                assert list(entry["data"]["signature"]) == parameters[entry["kernel"]], (gpu, kind, entry["kernel"])
                assert entry["compile_s"] > 0, (gpu, kind, entry["kernel"])  # the warm-up's shares
                # the launcher's facts: a descriptor's metadata for each tensor-descriptor argument
                descriptors = [t for t in entry["data"]["signature"].values() if str(t).startswith("tensordesc")]
                assert len(entry["tensordesc_meta"]) == len(descriptors), (gpu, kind, entry["kernel"])
                twins = [e for e in entries if (e["kernel"], e["key"]) == (entry["kernel"], entry["key"])]
                assert len(twins) == 1, (gpu, kind, entry["kernel"], "twice")


CHILD = r"""
import importlib, json, os, subprocess, sys, torch
sys.path.insert(0, {bench!r})
from bench import ROWS, load_flce, make_inputs
flce, _ = load_flce()
# ptxas and the C compiler (its launcher) run for a kernel compiled here; for one found in the cache, neither.
parent, compiled, popen = os.getpid(), {{"warm-up": 0, "launch": 0}}, subprocess.Popen.__init__
def counting(self, args, *rest, **kwargs):
    tool = os.path.basename(str(args[0]))
    if os.getpid() == parent and ("ptxas" in tool and "-o" in args or any("__triton_launcher" in str(a) for a in args)):
        compiled["launch"] += 1
    return popen(self, args, *rest, **kwargs)
subprocess.Popen.__init__ = counting
precompile = importlib.import_module(flce.__name__ + "._precompile")
warm = precompile.warm
def counted_warm(*args):
    compiled["warm-up"] += warm(*args)
    return 0
precompile.warm = counted_warm
hidden_size, vocab_size, n_rows, dtype = ROWS["llama3"]
hidden, weight, targets = make_inputs(n_rows, hidden_size, vocab_size, getattr(torch, dtype), "lm")
h, w = hidden.requires_grad_(), weight.requires_grad_()
if {kind!r} == {sft!r}:
    out = flce.fused_linear_log_probs(h, w, targets, outputs=("log_probs", "entropy", "is_top1"))
    loss = -out.log_probs.sum() / (targets != -100).sum()
else:
    loss = flce.fused_linear_cross_entropy(h, w, targets, return_metrics={kind!r} == "metrics")
    loss = loss[0] if isinstance(loss, tuple) else loss
loss.backward()
torch.cuda.synchronize()
print(json.dumps(compiled))
"""


@pytest.mark.skipif(not HAS_CUDA, reason="compiles for a GPU")
@pytest.mark.parametrize("kind", ["loss", "metrics", SFT])
def test_first_call_compiles_in_the_warm_up_only(kind):
    """A fresh process with an empty Triton cache: the first training call of each kind on the
    recorded head (Llama-3, bf16) runs neither ptxas nor the C compiler itself: the warm-up's
    children compiled every kernel it launches, and their launchers."""
    major, minor = torch.cuda.get_device_capability()
    if f"sm_{major}{minor}" not in _recorded():
        pytest.skip(f"no specialisations recorded for sm_{major}{minor}")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        run = subprocess.run([sys.executable, "-c", CHILD.format(bench=str(ROOT / "benchmarks"), kind=kind, sft=SFT)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = json.loads(run.stdout.strip().splitlines()[-1])
    assert compiled["warm-up"] > 0 and compiled["launch"] == 0, compiled


class _StubKernel:
    """What the warm-up reads of a kernel in this process: its compiled keys and its hashes."""

    cache_key = "source hash"

    def __init__(self):
        self.device_caches = {0: ({}, None, None, types.SimpleNamespace(hash=lambda: "backend hash"), None)}


def test_split_balances_the_work(flce):
    """The warm-up's groups (one forked child each), shared out by expected seconds (compiles as
    recorded, launcher builds as gcc's): every job in exactly one group, and the children's longest
    work that of the longest job alone, the least possible here, where a count of parameters (the
    Gluon sweep's 13 against the Triton sweep's 28) would pair the longest compile with another
    job, and a launcher built after its compile would add a gcc run to it."""
    precompile = submodule(flce, "_precompile")
    seconds = [1.7, 1.3, 1.0, 0.4, 0.1, 0.1]
    jobs = [precompile._Job(precompile._compile, f"kernel{i}", {}, s) for i, s in enumerate(seconds)]
    jobs += [precompile._Job(precompile._build_launcher, f"kernel{i}", {}, precompile._LAUNCHER_S)
             for i in range(len(seconds))]
    groups = precompile._split(jobs, 4)
    shared = [job for group in groups for job in group]
    assert len(shared) == len(jobs) and all(job in shared for job in jobs)
    assert max(sum(job.seconds for job in group) for group in groups) == pytest.approx(max(seconds))
    assert [group for group in groups if jobs[0] in group] == [[jobs[0]]]


def test_each_distinct_launcher_is_built_once_apart_from_its_compile(flce, monkeypatch):
    """The jobs of a kind: a compile for each entry that this process has not compiled, and a
    launcher build for each distinct launcher (argument types and descriptors' metadata; two
    entries that differ only in a constexpr share one), none for an entry already compiled."""
    precompile = submodule(flce, "_precompile")
    gluon, rows, done = _StubKernel(), _StubKernel(), _StubKernel()
    done.device_caches[0][0]["compiled key"] = object()
    kernels = {"gluon": gluon, "rows": rows, "done": done}
    monkeypatch.setattr(precompile, "_kernel", lambda module, name: kernels[name])
    descriptors = [{"swizzle": 3, "elem_size": 2, "block_size": [64, 64]}]

    def entry(kernel, key, signature, tensordesc_meta, compile_s):
        return {"module": "m", "kernel": kernel, "key": key, "data": {"signature": signature},
                "tensordesc_meta": tensordesc_meta, "compile_s": compile_s}

    entries = [entry("gluon", "store", {"h": "tensordesc<bf16[64, 64]>", "STORE": "constexpr"}, descriptors, 1.6),
               entry("gluon", "stats", {"h": "tensordesc<bf16[64, 64]>", "STORE": "constexpr"}, descriptors, 1.1),
               entry("rows", "rows", {"x": "*fp32", "n": "i32"}, [], 0.2),
               entry("done", "compiled key", {"x": "*fp32"}, [], 0.1)]
    jobs = precompile._pending("loss", 0, {"kinds": {"loss": entries}})
    compiles = [(job.kernel, job.entry["key"], job.seconds) for job in jobs if job.build is precompile._compile]
    launchers = [(job.kernel, job.seconds) for job in jobs if job.build is precompile._build_launcher]
    assert compiles == [(gluon, "store", 1.6), (gluon, "stats", 1.1), (rows, "rows", 0.2)]
    assert launchers == [(gluon, precompile._LAUNCHER_S), (rows, precompile._LAUNCHER_S)]
    assert len(jobs) == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the warm-up forks (POSIX)")
def test_children_compile_every_group_and_are_killed_past_the_deadline(flce, tmp_path, monkeypatch):
    """The fork and wait of the warm-up, with a stand-in for the compilation: every entry is
    handled in a child (not this process), each child's success is counted, and a child still
    running at the deadline is killed, its entries left to their launches."""
    precompile = submodule(flce, "_precompile")

    def compile_into_cache(work, device):
        for job in work:
            if job.entry["hang"]:
                time.sleep(120)
            (tmp_path / job.entry["name"]).write_text(str(os.getpid()))

    monkeypatch.setattr(precompile, "_compile_into_cache", compile_into_cache)
    pending = [precompile._Job(precompile._compile, _StubKernel(), {"name": f"entry{i}", "hang": False}, 0.1)
               for i in range(5)]
    assert precompile._fork_and_compile(pending, 0) == min(5, precompile._cpus())
    written = {path.name: path.read_text() for path in tmp_path.iterdir()}
    assert sorted(written) == [f"entry{i}" for i in range(5)]
    assert str(os.getpid()) not in written.values()
    start = time.monotonic()
    hung = [precompile._Job(precompile._compile, _StubKernel(), {"name": "hung", "hang": True}, 0.1)]
    assert precompile._fork_and_compile(hung, 0, timeout_s=0.5) == 0
    assert time.monotonic() - start < 10 and not (tmp_path / "hung").exists()


IMPORT_CHILD = r"""
import sys, torch
if {blocked}:
    sys.modules["triton"] = None  # as for a missing package
torch.backends.cuda.is_built = lambda: True  # a CUDA build of torch, on any machine
from kernels import get_kernel
flce = get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)
precompile = sys.modules.get(flce.__name__ + "._precompile")
if precompile is None:
    print("no thread")
else:
    from triton.runtime.cache import triton_key
    precompile._triton_key_thread.join(timeout=120)
    print(triton_key.cache_info().currsize == 1 and triton_key() == triton_key.__wrapped__())
"""


@pytest.mark.parametrize("blocked, expected", [(False, "True"), (True, "no thread")])
def test_import_makes_the_triton_key_in_a_thread(blocked, expected):
    """Imported with a CUDA build of torch, the package makes Triton's cache key in a thread: Triton's
    own cache then holds the key that a fresh computation gives. Without Triton, it imports all the
    same, with no thread."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", IMPORT_CHILD.format(blocked=blocked)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == expected
