"""Compiles a call's Triton kernels in parallel, before its first launch.

A training step launches about a dozen Triton kernels. Compiled one after another at their
first launch (Triton's passes, ptxas, then the C launcher that the system compiler builds for
each signature), they make a first call on a fresh machine take about 10 s. The compilations
are independent and spend most of their time outside Python's lock (MLIR's passes, ptxas and the
C compiler), so that a thread each overlaps them.

What to compile comes from ``_specializations``: for each kind of call, the specialisations
that its first calls compiled on a GPU (``scripts/record_specializations.py``), in the form of
Triton's ``JITFunction.preload``. Triton keys its compiled kernels by the arguments'
specialisation, so a preloaded kernel serves exactly the launches that would have compiled it;
one that no launch asks for costs a thread's work and nothing else. A call whose arguments
specialise otherwise (another GPU, Triton or dtype, a vocabulary that is not a multiple of 16)
compiles what it lacks at its launch, as without this module.
"""

import concurrent.futures
import json
import os
import threading

import torch
import triton

from . import _kernels
from ._settings import current as settings
from ._specializations import RECORDED

KINDS = ("loss", "metrics", "tokens")
_warmed: set[tuple[str, int]] = set()
_lock = threading.Lock()


def _kernel(module: str, name: str):
    if module == "_gluon_stats":
        from . import _gluon_stats as gluon  # sm_90 with a Triton whose Gluon it supports

        return getattr(gluon, name)
    return getattr(_kernels, name)


def _table(device: torch.device) -> dict | None:
    """The recorded specialisations of ``device``'s GPU, if recorded with this Triton (major.minor)."""
    major, minor = torch.cuda.get_device_capability(device)
    table = RECORDED.get(f"sm_{major}{minor}")
    if table is None or table["triton"].split(".")[:2] != triton.__version__.split(".")[:2]:
        return None
    return table


def _pending(kind: str, device: int, table: dict) -> list[tuple]:
    """(kernel, Triton's specialisation data) of ``kind`` that this process has not compiled."""
    pending = []
    for entry in table["kinds"][kind]:
        try:
            kernel = _kernel(entry["module"], entry["kernel"])
        except (ImportError, AttributeError):  # no Gluon here, or a kernel renamed since the recording
            continue
        # The kernel's per-device cache is made here, on one thread: two threads making it at once
        # would each fill their own.
        compiled = kernel.device_caches[device][0]
        if entry["key"] not in compiled:
            data = {**entry["data"], "name": kernel._fn_name, "key": entry["key"]}
            pending.append((kernel, json.dumps(data)))
    return pending


def _compile(kernel, data: str, device: int) -> None:
    torch.cuda.set_device(device)
    compiled = kernel.preload(data)
    # The launcher and the module's load, else the first launch's work on the main thread.
    init_handles = getattr(compiled, "_init_handles", None)
    if init_handles is not None:
        init_handles()


def warm(kind: str, device: torch.device) -> int:
    """Compiles, in parallel threads, the kernels that the first calls of ``kind`` ("loss",
    "metrics" or "tokens") compiled on this GPU, once per process and device; returns how many it
    compiled (0 after the first call, or where nothing is recorded for this GPU and Triton). A
    kernel that fails to compile here is left to its launch, which raises as it would have."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (kind, index) in _warmed or not settings().precompile or torch.compiler.is_compiling():
        return 0
    with _lock:
        if (kind, index) in _warmed:
            return 0
        _warmed.add((kind, index))
        table = _table(device)
        pending = _pending(kind, index, table) if table is not None else []
        if not pending:
            return 0
        workers = min(len(pending), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                      os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="flce-compile") as pool:
            futures = [pool.submit(_compile, kernel, data, index) for kernel, data in pending]
        return sum(future.exception() is None for future in futures)
