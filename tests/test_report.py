"""benchmarks/report.py shows every method found in the results, not a fixed list of peers: a new
peer gets its README columns and, when fastest, is named as the fastest peer; a failing method's
error is shown whole; the driver string stays on one line."""

import importlib.util
import re

import pytest
from conftest import ROOT

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_new_peer_is_compared_everywhere(report):
    runs, latest = report.load()
    latest = dict(latest)
    ours = latest[("llama3", "lm", report.OURS)]
    # a peer twice as fast as this kernel, with a tenth of its memory, on one row only
    latest[("llama3", "lm", "new-peer")] = {**ours, "method": "new-peer", "step_ms": ours["step_ms"] / 2,
                                            "fwd_ms": ours["fwd_ms"] / 2,
                                            "step_peak_minus_grads_mib": ours["step_peak_minus_grads_mib"] / 10}
    latest[("llama2", "lm", "new-peer")] = {"method": "new-peer", "error": "RuntimeError: a | b\nthe traceback"}
    assert report.methods_in(latest)[-1] == "new-peer"

    readme = report.readme_table(latest)
    header = next(line for line in readme.splitlines() if line.startswith("| head"))
    assert header.rstrip(" |").endswith("new-peer")
    llama3_row = next(line for line in readme.splitlines() if line.startswith("| llama3"))
    assert llama3_row.endswith(f"| {ours['step_ms'] / 2:.1f} ms, {ours['step_peak_minus_grads_mib'] / 10:.0f} MiB |")
    assert next(line for line in readme.splitlines() if line.startswith("| llama2")).endswith("| fails |")
    assert "new-peer on llama3" in report.summary(latest)

    table = report.table(latest, ["llama2"], "lm")
    assert "fails: RuntimeError: a \\| b |" in table and "traceback" not in table


def test_runs_list_the_driver_on_one_line(report):
    runs, _ = report.load()
    lines = report.environment(runs).splitlines()
    assert len(lines) == len(runs) and all(line.startswith("- `") for line in lines)


def test_the_step_energy_gets_a_column_where_recorded(report):
    """Runs with NVML's joules a step show them; the other rows keep their cells aligned."""
    _, latest = report.load()
    latest = dict(latest)
    ours = latest[("llama3", "lm", report.OURS)]
    latest[("llama3", "lm", report.OURS)] = {**ours, "step_joules": 24.875}
    table = report.table(latest, ["llama3"], "lm").splitlines()
    assert table[0].endswith("| step J |")
    ours_row = next(line for line in table if f"**{report.OURS}**" in line)
    assert ours_row.endswith("| 24.88 |")
    cells = [len(re.split(r"(?<!\\)\|", line)) for line in table]  # escaped pipes are inside cells
    assert cells == [cells[0]] * len(cells)
    without = {key: {k: v for k, v in r.items() if k != "step_joules"} for key, r in latest.items()}
    assert "step J" not in report.table(without, ["llama3"], "lm")
