"""The kernel's settings (``_settings``): the five environment variables, read once and checked,
and ``override``, the only way to set the other fields."""

import pytest
import torch
from conftest import DEVICE, assert_rel, make_inputs, submodule, tolerance
from reference import reference


@pytest.fixture
def settings(flce):
    return submodule(flce, "_settings")


@pytest.fixture
def environ(settings, monkeypatch):
    """``environ(FLCE_X="v", ...)`` sets variables and has the kernel read the environment again
    at its next call; after the test it reads the restored environment again."""
    def set_variables(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        settings.reset()

    yield set_variables
    settings.reset()  # (monkeypatch restores the variables after this: the next read sees them)


def _chunk_sizes(flce, monkeypatch, n_rows=200):
    """The rows of each chunk of a training step of CPU tensors on the PyTorch backend (a float32
    step of ``n_rows`` rows, none ignored), counted at its ``row_stats``."""
    backend = submodule(flce, "_torch_backend")
    sizes, row_stats = [], backend.row_stats

    def counted(hidden, *args, **kwargs):
        sizes.append(hidden.shape[0])
        return row_stats(hidden, *args, **kwargs)

    monkeypatch.setattr(backend, "row_stats", counted)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at each call: CPU tensors take the PyTorch backend
    hidden, weight, targets, _ = make_inputs(n_rows, 16, 50, torch.float32, seed=3, device="cpu")
    flce.fused_linear_cross_entropy(hidden, weight, targets).backward()
    return sizes


# ---- the environment ------------------------------------------------------------------------
@pytest.mark.parametrize("variable", ["FLCE_CHUNK_ROWS", "FLCE_BUFFER_MIB"])
@pytest.mark.parametrize("text", ["0", "-5", "abc", "1.5", "false"])
def test_integer_variables_must_be_positive_integers(settings, environ, variable, text):
    environ(**{variable: text})
    with pytest.raises(ValueError) as error:
        settings.current()
    assert str(error.value) == f"{variable} must be a positive integer, got '{text}'"


@pytest.mark.parametrize("text", ["-5", "abc", "1.5", "false"])
def test_keep_mib_must_be_a_non_negative_integer(settings, environ, text):
    environ(FLCE_KEEP_MIB=text)
    with pytest.raises(ValueError) as error:
        settings.current()
    assert str(error.value) == f"FLCE_KEEP_MIB must be a non-negative integer, got '{text}'"


def test_keep_mib_sets_the_kept_rows_budget(flce, settings, environ):
    """FLCE_KEEP_MIB: 0 keeps nothing (the least memory), 3 MiB keeps 3 MiB whatever the shape;
    unset, TRL's head's peak less ours: for a bf16 Llama-3 head at 8192 rows, (V + N) H 4 bytes
    plus TRL's 4096 x 32768 logit tile (``_kept`` derives it) less a margin, whether or not some
    rows are recomputed (a recomputed chunk never lives beside the kept rows)."""
    kept, plan = submodule(flce, "_kept"), submodule(flce, "_plan")

    def budget():  # (the plan reads the setting, the budget takes it)
        return kept.budget(8192, 128256, 4096, torch.bfloat16, plan.keep_budget()[0])

    environ(FLCE_KEEP_MIB="0")
    assert budget() == 0
    environ(FLCE_KEEP_MIB="3")
    assert budget() == 3 * 2**20
    environ(FLCE_KEEP_MIB="")
    # (64 MiB left free: _kept.MARGIN_BYTES)
    assert budget() == (128256 + 8192) * 4096 * 4 + 4096 * 32768 * 2 - 64 * 2**20


@pytest.mark.parametrize("variable", ["FLCE_CHECK_TARGETS", "FLCE_TRITON"])
@pytest.mark.parametrize("text", ["abc", "2", "-1", "nope"])
def test_boolean_variables_must_be_booleans(settings, environ, variable, text):
    environ(**{variable: text})
    with pytest.raises(ValueError) as error:
        settings.current()
    assert str(error.value) == (f"{variable} must be a boolean (0, 1, true, false, yes, no, on or off, any case), "
                                f"got '{text}'")


@pytest.mark.parametrize("text, value", [("0", False), ("false", False), ("OFF", False), ("No", False),
                                         ("1", True), ("TRUE", True), ("on", True), ("yes", True), ("", True)])
def test_boolean_spellings(settings, environ, text, value):
    """Every accepted spelling, any case; an empty variable is an unset one (the default, True)."""
    environ(FLCE_CHECK_TARGETS=text, FLCE_TRITON=text)
    assert settings.current().check_targets is value and settings.current().triton is value


def test_a_bad_variable_fails_the_first_call_naming_it(flce, environ):
    """The loss call that first reads the environment raises the variable's error, not an error
    deep in the chunk loop (a ZeroDivisionError for 0, a negative size for -5)."""
    environ(FLCE_CHUNK_ROWS="0")
    hidden, weight, targets, _ = make_inputs(8, 16, 20, torch.float32, seed=1)
    with pytest.raises(ValueError, match="^FLCE_CHUNK_ROWS must be a positive integer, got '0'$"):
        flce.fused_linear_cross_entropy(hidden, weight, targets)


def test_chunk_rows_sets_the_chunks(flce, settings, environ, monkeypatch):
    """FLCE_CHUNK_ROWS=64: 200 rows take chunks of 64, 64, 64 and 8 (the planner says 64); unset,
    one chunk of 200 (the PyTorch backend's default cap is 4096 rows)."""
    plan = submodule(flce, "_plan")
    assert plan.chunk_rows("torch", 200, 50, torch.float32, True) == 200
    assert _chunk_sizes(flce, monkeypatch) == [200]
    environ(FLCE_CHUNK_ROWS="64")
    assert settings.current().chunk_rows == 64
    assert plan.chunk_rows("torch", 200, 50, torch.float32, True) == 64
    assert _chunk_sizes(flce, monkeypatch) == [64, 64, 64, 8]


def test_buffer_mib_sets_the_buffer(flce, environ):
    """FLCE_BUFFER_MIB=1 on the PyTorch backend: fp32 logits and one fp32 temporary of 1000
    columns, 8000 bytes a row, so 131 rows in 1 MiB (2^20 // 8000); 256 MiB by default hold the
    4096-row cap."""
    plan = submodule(flce, "_plan")
    environ(FLCE_CHUNK_ROWS="")  # an empty variable is an unset one
    assert plan.chunk_rows("torch", 10**6, 1000, torch.float32, True) == 4096
    environ(FLCE_BUFFER_MIB="1")
    assert plan.chunk_rows("torch", 10**6, 1000, torch.float32, True) == 2**20 // 8000 == 131


@pytest.mark.parametrize("text", ["false", "0"])
def test_check_targets_off_skips_the_range_check(flce, environ, text):
    """A target out of range raises ValueError by default; FLCE_CHECK_TARGETS=false (which used
    to leave the check on: only "0" turned it off) gives that row a NaN loss instead."""
    hidden, weight, targets, _ = make_inputs(8, 16, 20, torch.float32, seed=2, requires_grad=False)
    targets[3] = 20
    with pytest.raises(ValueError, match=r"^targets must be in \[0, 20\) or ignore_index=-100, found 20$"):
        flce.fused_linear_cross_entropy(hidden, weight, targets)
    environ(FLCE_CHECK_TARGETS=text)
    losses = flce.fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    assert losses[3].isnan() and losses.isnan().sum() == 1


def test_triton_off_sends_every_tensor_to_the_pytorch_backend(flce, environ, monkeypatch):
    """FLCE_TRITON=0: CUDA tensors (and CPU tensors under the interpreter) take the PyTorch
    backend, which gives the float64 reference's loss and gradients on that device too."""
    chunked = submodule(flce, "_chunked")
    triton_backend, torch_backend = submodule(flce, "_triton_backend"), submodule(flce, "_torch_backend")
    assert chunked.backend_for(torch.device("cuda", 0)) is triton_backend
    environ(FLCE_TRITON="0")
    assert chunked.backend_for(torch.device("cuda", 0)) is torch_backend
    assert chunked.backend_for(torch.device(DEVICE)) is torch_backend
    calls = []

    def count(module, name):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            calls.append(f"{module.__name__.rsplit('.', 1)[1]}.{name}")
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for module, name in ((triton_backend, "row_stats"), (triton_backend, "factored_sweep"),
                         (torch_backend, "row_stats")):
        count(module, name)
    hidden, weight, targets, bias = make_inputs(24, 32, 60, torch.float32, seed=4, bias=True, ignore=0.2)
    loss = flce.fused_linear_cross_entropy(hidden, weight, targets, bias)
    loss.backward()
    assert calls and set(calls) == {"_torch_backend.row_stats"}, calls
    ref = reference(hidden, weight, targets, bias, grad_output=torch.tensor(1.0))
    assert_rel(loss, ref.loss, tolerance(torch.float32, "loss"), "loss")
    for name, t, expected in (("hidden", hidden, ref.grad_hidden), ("weight", weight, ref.grad_weight),
                              ("bias", bias, ref.grad_bias)):
        assert_rel(t.grad, expected, tolerance(torch.float32, "grad"), f"grad_{name}")


def test_the_environment_is_read_once(settings, environ, monkeypatch):
    """A variable changed after the first read is not seen until ``reset``."""
    environ(FLCE_CHUNK_ROWS="64")
    assert settings.current().chunk_rows == 64
    monkeypatch.setenv("FLCE_CHUNK_ROWS", "32")
    assert settings.current().chunk_rows == 64
    settings.reset()
    assert settings.current().chunk_rows == 32


# ---- override -------------------------------------------------------------------------------
def test_override_sets_fields_and_restores_them(settings):
    before = settings.current()
    with settings.override(gluon=False, chunk_rows=8) as inside:
        assert inside == settings.current()
        assert (inside.gluon, inside.chunk_rows, inside.tma) == (False, 8, before.tma)
        with settings.override(chunk_rows=16, tma=False):
            assert (settings.current().gluon, settings.current().chunk_rows, settings.current().tma) == (False, 16,
                                                                                                         False)
        assert settings.current() == inside
    assert settings.current() == before


def test_override_restores_on_an_exception(settings):
    before = settings.current()
    with pytest.raises(RuntimeError, match="inside"):
        with settings.override(weight_group=3):
            assert settings.current().weight_group == 3
            raise RuntimeError("inside")
    assert settings.current() == before


def test_override_outlives_a_reset(settings, environ):
    """``reset`` re-reads the environment under the overrides in force, which stay."""
    with settings.override(block_v=16):
        environ(FLCE_CHUNK_ROWS="12")
        assert (settings.current().block_v, settings.current().chunk_rows) == (16, 12)
    assert settings.current().block_v is None


def test_override_refuses_unknown_fields_and_wrong_types(settings):
    before = settings.current()
    with pytest.raises(TypeError, match=r"override\(\) got unknown settings \['glun'\]; the settings are \["):
        with settings.override(glun=False):
            pass
    with pytest.raises(TypeError, match="^setting gluon must be a bool, got 0$"):
        with settings.override(gluon=0):
            pass
    with pytest.raises(TypeError, match=r"^setting block_v must be an int or None, got '16'$"):
        with settings.override(block_v="16"):
            pass
    with pytest.raises(ValueError, match="^setting chunk_rows must be None or a positive integer, got 0$"):
        with settings.override(chunk_rows=0):
            pass
    assert settings.current() == before
