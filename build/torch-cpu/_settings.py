"""The kernel's tuning values: one frozen ``Settings``, read through ``current()`` by the plan
(``_plan``), which decides every choice of a call from them.

Five environment variables set values a user may need, read here only, once (the first call
that asks; ``reset()`` makes the next one read them again), and checked:

    FLCE_CHUNK_ROWS     a positive integer: the most rows a chunk takes (``Settings.chunk_rows``)
    FLCE_BUFFER_MIB     a positive integer: the chunk buffer's size cap in MiB (``buffer_mib``)
    FLCE_CHECK_TARGETS  a boolean: the target range check (``check_targets``)
    FLCE_TRITON         a boolean: 0 sends every tensor, CUDA ones too, to the PyTorch backend
                        (``triton``), for a user who hits a problem in the Triton kernels
    FLCE_KEEP_MIB       a non-negative integer: MiB the per-token forward keeps for its backward
                        (``keep_mib``); 0 keeps nothing (every row recomputed: the least memory)

A boolean is one of 0, 1, true, false, yes, no, on, off, in any case; an empty variable is an
unset one. Every other field (the A/B toggles and exploration values of tests and benchmarks) is
set only by the context manager ``override``::

    with override(gluon=False, autotune=False):
        loss = fused_linear_cross_entropy(hidden, weight, targets)

``override`` swaps a module-level value: it holds for every thread while the block runs, and is
not thread-local.
"""

import contextlib
import os
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Settings:
    """Every tuning value of the kernel. A field that is None takes the backend's default."""

    chunk_rows: int | None = None
    """Rows per chunk, at most (times P on a vocabulary slice of P ranks). None: 1536 for a
    Triton training step, 4096 for a forward and on the PyTorch backend. A value is a cap, so a
    training step's chunks then never grow past it (``grow_chunks``)."""

    buffer_mib: int | None = None
    """Size cap of the chunk buffer in MiB. None: 768 for a Triton training step (its logits),
    256 on the PyTorch backend (a chunk's fp32 logits and their temporaries together). 0 (an
    override only, for tests): the smallest chunks, 128 rows on Triton, 1 on PyTorch."""

    check_targets: bool = True
    """Whether a call checks that its targets are in range (one small kernel on CUDA and a host
    wait for its flag); skipped anyway while tracing or capturing a CUDA graph. Unchecked, an
    out-of-range target gives a non-finite loss instead of a ValueError."""

    keep_mib: int | None = None
    """MiB that a per-token forward with gradients (``fused_linear_log_probs`` under RL and
    preference losses) may keep for its backward, so that the rows it keeps make their gradient
    without recomputing their logits (``_kept``); 0: none, every row recomputed (the least memory).
    None: the memory that TRL's own head would take at the call's shape, less ours
    (``_kept.budget``)."""

    keep_rows: int | None = None
    """Rows a per-token forward keeps at most, on top of ``keep_mib`` (tests: a budget that keeps
    some chunks of a small call); None: no cap."""

    triton: bool = True
    """Whether CUDA tensors (and CPU ones under ``TRITON_INTERPRET=1``) take the Triton backend;
    False: every tensor takes the PyTorch backend (chunked fp32 logits, on any device)."""

    autotune: bool = True
    """Whether the logit kernels are autotuned on a GPU; False: their first configuration only."""

    tuned: bool = True
    """Whether a GPU with a shipped configuration (``_plan.TUNED``: sm_90) takes it instead
    of the autotuner; False: autotuned there too (to re-derive the table)."""

    precompile: bool = True
    """Whether the first call of a kind compiles its Triton kernels in parallel, forked processes,
    from the specialisations recorded on this GPU (``_precompile``); False: each kernel compiles at
    its first launch, one after another."""

    config: tuple[int, int, int, int, bool] | None = None
    """One forced configuration of the logit kernel on a GPU, (BLOCK_N, BLOCK_K, warps, stages,
    persistent); None: the autotuned ones (exploration)."""

    block_v: int | None = None
    """Vocabulary columns per logit tile. None: 32 in the interpreter, 64 for fp64, 128 for fp32,
    256 for 16-bit inputs (exploration)."""

    block_n: int = 16
    """Rows of the logit kernel's tile in the interpreter (exploration)."""

    block_k: int = 16
    """Hidden columns of a K step of the logit kernel's tile in the interpreter (exploration)."""

    persistent: bool = False
    """Whether the interpreter runs the logit kernel's persistent form (exploration)."""

    group_rows: int | None = None
    """Rows of a group of the logit kernel's tiles, swept together so that their hidden rows stay
    in L2. None: 4096, or fewer for hidden rows of more than 8 KiB (exploration)."""

    tma: bool = True
    """Whether the logit kernel loads through Hopper's copy engine (TMA) where rows are 16-byte
    aligned."""

    skip_ignored: bool = True
    """Whether the rows whose target is ``ignore_index`` are left out of the chunks; False: they
    are computed in place and masked, as during CUDA graph capture."""

    factored: bool = True
    """Whether a training chunk may keep exponentials and factor its gradient; False: logits
    relative to their tile max, turned into grad logits by one pass."""

    rare_target: int = 2
    """A factored step takes a row's target entry out of the 16-bit products when at most this
    many of the step's rows share its target (or p_t < 2^-10 and at most 64 do); 0: only the
    improbable ones; negative: none (every entry stays in)."""

    grow_chunks: bool = True
    """Whether a training step past ``weight_group`` chunks takes that many larger chunks
    instead of its planned ones and an fp32 sum of grad_weight."""

    weight_group: int = 8
    """Chunks summed into a 16-bit grad_weight before that sum goes to an fp32 sum (at least 1)."""

    weight_fp32_mib: int = 64
    """A grad_weight of V x H x 4 bytes at most this many MiB (or the chunk buffer's size) is
    summed in fp32 from the start."""

    working_set_rows: int = 2048
    """Rows of logits whose bytes bound a training chunk's working set (its buffer and the
    hidden-sized blocks beside it): a quarter of the logits of 8192 rows."""

    training_row_block: int | None = None
    """Rows in whose multiples a training step spreads its chunks after the first. None: the
    sweep's tile, 192 where the Gluon kernel takes it, else 128 (exploration)."""

    gluon: bool = True
    """Whether the Gluon kernel of 192-row tiles computes the statistics where it applies (Hopper,
    16-bit inputs, plain logits, no metrics); False: the logit kernel, for both sweeps."""

    gluon_training: bool = True
    """Whether a training step's factored sweep takes the Gluon kernel where it applies (with
    ``gluon``); False: the forward's sweep only."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not _is_a(value, f.type):
                raise TypeError(f"setting {f.name} must be {_type_name(f.type)}, got {value!r}")
        if self.chunk_rows is not None and self.chunk_rows < 1:
            raise ValueError(f"setting chunk_rows must be None or a positive integer, got {self.chunk_rows}")
        for name in ("keep_mib", "keep_rows"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"setting {name} must be None or a non-negative integer, got {getattr(self, name)}")
        if self.buffer_mib is not None and self.buffer_mib < 0:
            raise ValueError(f"setting buffer_mib must be None or a non-negative integer, got {self.buffer_mib}")


# ---- the environment -----------------------------------------------------------------------
ENVIRONMENT = {
    "FLCE_CHUNK_ROWS": "chunk_rows",
    "FLCE_BUFFER_MIB": "buffer_mib",
    "FLCE_CHECK_TARGETS": "check_targets",
    "FLCE_TRITON": "triton",
    "FLCE_KEEP_MIB": "keep_mib",
}
_ZERO_ALLOWED = ("FLCE_KEEP_MIB",)
_FIELDS = {f.name: f for f in fields(Settings)}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _positive_int(variable: str, text: str) -> int:
    least = 0 if variable in _ZERO_ALLOWED else 1
    if not text.strip().isdecimal() or int(text) < least:
        kind = "a non-negative" if least == 0 else "a positive"
        raise ValueError(f"{variable} must be {kind} integer, got {text!r}")
    return int(text)


def _boolean(variable: str, text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"{variable} must be a boolean (0, 1, true, false, yes, no, on or off, any case), got {text!r}")


def from_environment() -> Settings:
    """The defaults, with the values of the environment's FLCE_CHUNK_ROWS, FLCE_BUFFER_MIB,
    FLCE_CHECK_TARGETS, FLCE_TRITON and FLCE_KEEP_MIB (unset or empty: the default); raises ValueError naming
    the variable and the values it accepts for any other value."""
    values = {}
    for variable, name in ENVIRONMENT.items():
        text = os.environ.get(variable, "")
        if text != "":
            values[name] = _boolean(variable, text) if _FIELDS[name].type is bool else _positive_int(variable, text)
    return Settings(**values)


# ---- the current value -----------------------------------------------------------------------
_from_env: Settings | None = None  # read once, by the first current() after import or reset()
_overrides: dict = {}  # the fields of the overrides in force
_current: Settings | None = None  # _from_env with _overrides, rebuilt after a change


def current() -> Settings:
    """The settings in force: the environment's (read once), with the overrides in force."""
    settings = _current
    return settings if settings is not None else _rebuild()


def _rebuild() -> Settings:
    global _from_env, _current
    if _from_env is None:
        _from_env = from_environment()
    _current = replace(_from_env, **_overrides)
    return _current


def reset() -> None:
    """Makes the next ``current()`` read the environment again (the overrides in force stay)."""
    global _from_env, _current
    _from_env = _current = None


@contextlib.contextmanager
def override(**changes) -> Iterator[Settings]:
    """Sets fields of the settings for the duration of a block (tests and benchmarks), over the
    environment's and those of enclosing overrides, and restores them on exit, also on an
    exception; yields the settings in force. An unknown field or a value of the wrong type
    raises TypeError. Not thread-local: the block's values hold for every thread."""
    global _overrides, _current
    unknown = sorted(set(changes) - _FIELDS.keys())
    if unknown:
        raise TypeError(f"override() got unknown settings {unknown}; the settings are {sorted(_FIELDS)}")
    Settings(**changes)  # the values' types, checked before anything changes
    previous = _overrides
    _overrides, _current = {**previous, **changes}, None
    try:
        yield current()
    finally:
        _overrides, _current = previous, None


def _is_a(value, annotation) -> bool:
    """Whether ``value`` is of a field's type (bool is no int here, and an int no bool)."""
    if isinstance(annotation, types.UnionType):
        return any(_is_a(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation in (bool, int):
        return type(value) is annotation
    items = typing.get_args(annotation)  # a tuple of fixed types
    return (isinstance(value, tuple) and len(value) == len(items)
            and all(_is_a(v, a) for v, a in zip(value, items, strict=True)))


def _type_name(annotation) -> str:
    if isinstance(annotation, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if annotation is int:
        return "an int"
    if annotation is bool:
        return "a bool"
    return "a tuple (" + ", ".join(a.__name__ for a in typing.get_args(annotation)) + ")"
