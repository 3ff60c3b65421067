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
    # (the table's lines; a note on carried errors may follow them) escaped pipes are inside cells
    cells = [len(re.split(r"(?<!\\)\|", line)) for line in table if line.startswith("|")]
    assert cells == [cells[0]] * len(cells)
    without = {key: {k: v for k, v in r.items() if k != "step_joules"} for key, r in latest.items()}
    assert "step J" not in report.table(without, ["llama3"], "lm")


def test_an_anatomy_run_gives_its_traces_and_none_of_its_times(report, tmp_path, monkeypatch):
    """An ``anatomy-*.json`` run newer than the latest results of a row gives them its anatomy
    (named in the table) and leaves their times, which stay the same run's as the peers'; an
    older one gives nothing."""
    import json

    for path in report.RESULTS.glob("h200-*.json"):
        (tmp_path / path.name).write_text(path.read_text())
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    _, before = report.load()
    ours = before[("llama2", "lm", report.OURS)]
    anatomy = {"span_ms": 1.0, "busy_ms": 0.5, "kernel_ms": {"nvjet_x": 0.25}, "kernels_per_step": 1.0}
    trace = {**ours, "step_ms": 1.0, "fwd_ms": 0.5, "anatomy": anatomy}
    trace = {k: v for k, v in trace.items() if not k.startswith("_")}
    newer = {"environment": {"date": "9999-01-01T00:00:00+00:00"}, "results": [trace]}
    (tmp_path / "anatomy-new.json").write_text(json.dumps(newer))
    _, latest = report.load()
    r = latest[("llama2", "lm", report.OURS)]
    assert r["anatomy"] == anatomy and r["_anatomy_file"] == "anatomy-new.json"
    assert (r["step_ms"], r["fwd_ms"], r["_file"]) == (ours["step_ms"], ours["fwd_ms"], ours["_file"])
    assert "(anatomy-new.json)" in report.anatomy_table(latest, ["llama2"])
    (tmp_path / "anatomy-new.json").write_text(json.dumps({**newer, "environment": {"date": "1999-01-01"}}))
    _, latest = report.load()
    assert latest[("llama2", "lm", report.OURS)].get("_anatomy_file") == ours.get("_anatomy_file")


def test_a_run_of_laps_shows_the_step_ratio_lap_by_lap(report):
    """With each method's step timed in two laps of the same run, the ratio table gives the
    ratio of the medians and the span of the laps' ratios, each lap over its own fastest peer."""
    _, latest = report.load()
    latest = dict(latest)
    row = "llama2"
    peers = [m for m in report.methods_in(latest) if m != report.OURS
             and "step_ms" in latest.get((row, "lm", m), {})]
    ours = latest[(row, "lm", report.OURS)]
    latest[(row, "lm", report.OURS)] = {**ours, "step_ms": 9.0, "step_ms_laps": [8.8, 9.2]}
    for m in peers:  # every peer at 10 ms in lap 1 and 10.5 ms in lap 2, in the same run's file
        r = latest[(row, "lm", m)]
        latest[(row, "lm", m)] = {**r, "_file": ours["_file"], "step_ms": 10.25, "step_ms_laps": [10.0, 10.5]}
    assert report.lap_ratios(latest, row, "lm") == pytest.approx([0.88, 9.2 / 10.5])
    line = next(s for s in report.targets(latest, [row], "lm").splitlines() if s.startswith(f"| {row} |"))
    assert line.startswith(f"| {row} | {9.0 / 10.25:.3f} ✓ (laps 0.876–0.880) |")
