"""Compiles a call's Triton kernels in parallel, before its first launch.

A training step launches about a dozen Triton kernels. Compiled one after another at their
first launch (Triton's passes, ptxas, then the C launcher that the system compiler builds for
each signature), they make most of a first call's time on a fresh machine. The compilations
are independent, but much of their time holds Python's lock, so threads barely overlap them
(docs/design.md, "The cold start"): forked processes compile them instead, into Triton's disk
cache, where each kernel's first launch then finds it. A child only compiles (no CUDA call:
its parent's CUDA state is not valid in it) and leaves with ``os._exit``.

What to compile comes from ``specializations.json`` (read on first use): for each kind of call (the loss, with metrics,
or per-token outputs, a kind for each set of outputs that TRL's trainers ask for), the
specialisations that its first calls compiled on a GPU (``scripts/record_specializations.py``), in the form of
Triton's ``JITFunction.preload``. Triton keys its compiled kernels by the arguments'
specialisation, so a compiled entry serves exactly the launches that would have compiled it;
one that no launch asks for costs a child's work and nothing else. A call whose arguments
specialise otherwise (another GPU, Triton or dtype, a vocabulary that is not a multiple of 16)
compiles what it lacks at its launch, as without this module. Each entry carries its compile
time (``compile_s``, timed by the recording script), by which the children's work is shared out, and
its tensor descriptors' metadata (``tensordesc_meta``, from the same compile), from which another
child builds its launcher meanwhile: the launcher is made from the argument types and that metadata
alone, and building it after the longest compile would lengthen the longest child by a gcc run.
"""

import contextlib
import functools
import importlib
import json
import os
import signal
import threading
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from . import _plan

_warmed: set[tuple[str, int]] = set()
_lock = threading.Lock()
_triton_key_thread: threading.Thread | None = None


def start_triton_key() -> None:
    """Makes Triton's cache key (``triton_key``: a hash of Triton's sources and of its 400 MiB
    library, 0.4 s or more, which a process's first compile waits for) in a daemon thread, so that
    the first call finds it made. The package calls it at its import on a CUDA build of torch; the
    warm-up joins the thread before it forks."""
    global _triton_key_thread
    from triton.runtime.cache import triton_key

    _triton_key_thread = threading.Thread(target=triton_key, name="triton_key", daemon=True)
    _triton_key_thread.start()


def _kernel(module: str, name: str):
    """The kernel ``name`` of this package's ``module`` (``_gluon_stats`` only with a Triton whose
    Gluon it supports, on sm_90)."""
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


@functools.cache
def recorded() -> dict:
    """The recorded specialisations, per GPU (``sm_90``: gpu, triton, torch, date, kinds)."""
    return json.loads(Path(__file__).with_name("specializations.json").read_text())


def _table(device: torch.device) -> dict | None:
    """The recorded specialisations of ``device``'s GPU, if recorded with this Triton (major.minor)."""
    major, minor = torch.cuda.get_device_capability(device)
    table = recorded().get(f"sm_{major}{minor}")
    if table is None or table["triton"].split(".")[:2] != triton.__version__.split(".")[:2]:
        return None
    return table


class _Job(NamedTuple):
    """A child's piece of work: ``build`` (``_compile`` or ``_build_launcher``) of one recorded
    entry of ``kernel``, and its expected seconds."""

    build: Callable[[Any, dict, int], None]
    kernel: Any
    entry: dict
    seconds: float


# A launcher's build: gcc, about the same time for every kernel, as timed where the table's compiles
# were (docs/design.md, "The cold start").
_LAUNCHER_S = 0.15


def _pending(kind: str, device: int, table: dict) -> list[_Job]:
    """The compiles of ``kind``'s entries that this process has not compiled, and the builds of
    their launchers, one for each distinct launcher."""
    jobs, launchers = [], set()
    for entry in table["kinds"].get(kind, ()):
        try:
            kernel = _kernel(entry["module"], entry["kernel"])
        except (ImportError, AttributeError):  # no Gluon here, or a kernel moved or renamed since the recording
            continue
        if entry["key"] in kernel.device_caches[device][0]:
            continue
        jobs.append(_Job(_compile, kernel, entry, entry["compile_s"]))
        # Triton makes a launcher's source from the argument types and the descriptors' metadata:
        # entries that agree in both (constexpr values aside) share one.
        launcher = json.dumps([list(entry["data"]["signature"].values()), entry["tensordesc_meta"]])
        if launcher not in launchers:
            launchers.add(launcher)
            jobs.append(_Job(_build_launcher, kernel, entry, _LAUNCHER_S))
    return jobs


def _source(kernel, data: dict):
    """Triton's ASTSource of ``kernel`` for one recorded specialisation (as ``JITFunction.preload``
    reads it, without its call for the current device)."""
    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(data["constant_keys"], data["constant_vals"], strict=True)}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"], strict=True)}
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in data["signature"].items()}
    return kernel.ASTSource(kernel, signature, constexprs, attrs)


def _options(backend, data: dict):
    """``backend``'s compile options for one recorded specialisation (the options its launch set)."""
    return backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})


def _compile(kernel, entry: dict, device: int) -> None:
    """In a forked child: Triton's compile of one recorded entry, into its cache."""
    _, _, target, backend, _ = kernel.device_caches[device]
    options = _options(backend, entry["data"])
    kernel.compile(_source(kernel, entry["data"]), target=target, options=options.__dict__)


def _build_launcher(kernel, entry: dict, device: int) -> None:
    """In a forked child: the C launcher of one recorded entry, built by gcc into Triton's cache
    without its compile. Only ``tensordesc_meta`` of the compile's metadata enters the launcher's
    source; the other fields that the launcher's constructor reads set attributes of an object
    that is dropped here."""
    facts = types.SimpleNamespace(tensordesc_meta=entry["tensordesc_meta"], num_ctas=1, global_scratch_size=0,
                                  global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
                                  launch_cooperative_grid=False, launch_pdl=False)
    driver.active.launcher_cls(_source(kernel, entry["data"]), facts)


def _compile_into_cache(work: list[_Job], device: int) -> None:
    """In a forked child: each job of ``work``, into Triton's cache."""
    for job in work:
        job.build(job.kernel, job.entry, device)


def _split(jobs: list[_Job], parts: int) -> list[list[_Job]]:
    """``jobs`` in ``parts`` groups of about equal seconds, the longest first, each to the group
    with the least so far: the children finish together, none held up by a second long job."""
    groups: list[list[_Job]] = [[] for _ in range(parts)]
    work = [0.0] * parts
    for job in sorted(jobs, key=lambda job: -job.seconds):
        least = work.index(min(work))
        groups[least].append(job)
        work[least] += job.seconds
    return [group for group in groups if group]


def _cpus() -> int:
    """CPUs this process may use, shared with the other ranks of its node (``LOCAL_WORLD_SIZE``,
    as torchrun sets it), which warm up at the same time."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, cpus // int(ranks)) if ranks.isdigit() and int(ranks) > 0 else cpus


def _fork_and_compile(pending: list[_Job], device: int, timeout_s: float = 60.0) -> int:
    """Runs ``pending`` in forked children, one group each; returns how many of them
    succeeded. Past ``timeout_s`` (a compile takes seconds) the children left are killed: their
    kernels then compile at their launch."""
    for job in pending:  # hashes that every child would compute, computed once here
        _ = job.kernel.cache_key
        job.kernel.device_caches[device][3].hash()
    from triton.runtime.cache import triton_key  # (a table is used only with the Triton it names)

    if _triton_key_thread is not None:
        _triton_key_thread.join()
    triton_key()
    children = []
    with warnings.catch_warnings():  # Python warns that forking a threaded process may deadlock
        warnings.simplefilter("ignore", DeprecationWarning)  # in the child: it takes no lock of theirs
        for group in _split(pending, min(len(pending), _cpus())):
            try:
                pid = os.fork()
            except OSError:  # no memory or process left for a child: the rest compile at their launches
                break
            if pid == 0:
                status = 1
                try:
                    _compile_into_cache(group, device)
                    status = 0
                finally:
                    os._exit(status)
            children.append(pid)
    deadline = time.monotonic() + timeout_s
    succeeded = 0
    while children:
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (SIGCHLD ignored): its status is lost
                children.remove(pid)
                continue
            if done:
                children.remove(pid)
                succeeded += os.waitstatus_to_exitcode(status) == 0
        if children and time.monotonic() > deadline:
            for pid in children:
                with contextlib.suppress(ProcessLookupError, ChildProcessError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    return succeeded


def warm(kind: str, device: torch.device) -> int:
    """Compiles, in forked children, the kernels that the first calls of ``kind`` ("loss",
    "metrics", or "tokens:" and the per-token outputs asked for, e.g. SFT's
    "tokens:entropy,is_top1,log_probs") compiled on this GPU, once per process and device;
    returns how many children succeeded (0 after the first call, or where nothing is recorded
    for this kind, GPU and Triton). A kernel that failed to compile there compiles at its launch, which raises as it
    would have."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (kind, index) in _warmed or not _plan.precompiles() or torch.compiler.is_compiling():
        return 0
    with _lock:
        if (kind, index) in _warmed:
            return 0
        _warmed.add((kind, index))
        table = _table(device)
        pending = _pending(kind, index, table) if table is not None and hasattr(os, "fork") else []
        return _fork_and_compile(pending, index) if pending else 0
