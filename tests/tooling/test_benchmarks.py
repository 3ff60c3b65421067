"""The benchmark scripts' logic on the CPU. benchmarks/bench.py's laps: later laps time every
method again, in reversed order every other lap, and a method's times become the medians of its
laps; its TRL heads and per-row loss against PyTorch. benchmarks/report.py shows every method
found in the results, not a fixed list of peers: a new peer gets its README columns and, when
fastest, is named as the fastest peer; a failing method's error is shown whole; the driver string
stays on one line."""

import argparse
import importlib.util
import re
import sys

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_later_laps_alternate_the_order_and_take_the_medians(bench, monkeypatch):
    calls = []
    times = {"a": iter([(2.0, 20.0), (4.0, 40.0)]), "b": iter([(1.0, 10.0), (1.0, 30.0)])}

    def retime(fn, hidden, weight, targets, rep_ms, warmup_ms):
        calls.append(fn)
        return next(times[fn])

    monkeypatch.setattr(bench, "retime", retime)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    entries = {"a": {"row": "r", "inputs": "lm", "method": "a", "fwd_ms": 3.0, "step_ms": 30.0},
               "b": {"row": "r", "inputs": "lm", "method": "b", "fwd_ms": 1.5, "step_ms": 20.0},
               "c": {"row": "r", "inputs": "lm", "method": "c", "error": "ValueError: no"}}
    methods = [("a", "a"), ("b", "b"), ("c", "c")]
    bench.later_laps(methods, entries, (None, None, None), argparse.Namespace(laps=3, rep_ms=1, warmup_ms=1), 1e12)
    assert calls == ["b", "a", "a", "b"]  # lap 2 reversed, lap 3 in order; the failed method not retimed
    assert entries["a"]["step_ms_laps"] == [30.0, 20.0, 40.0] and entries["a"]["step_ms"] == 30.0
    assert entries["a"]["fwd_ms"] == 3.0 and entries["b"]["fwd_ms"] == 1.0 and entries["b"]["step_ms"] == 20.0
    assert entries["b"]["step_tflops_6nvh"] == pytest.approx(3e12 / 20.0 / 1e9)
    assert "step_ms_laps" not in entries["c"]


def test_the_glue_alone_keeps_the_heads_contract(bench):
    """``trl-glue``: TRL's head around a kernel that does no work still gathers, scatters and runs
    its backward to hidden and weight: its loss is 0, and the gradients are zero, of their shapes,
    on the rows with a label and the others alike (the CPU, without TRL)."""
    import torch

    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    targets = torch.tensor([1, -100, 4, 0, -100, 2])
    loss = bench.trl_head(bench.no_head, "sft")(hidden, weight, targets)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros(6, 4)) and torch.equal(weight.grad, torch.zeros(5, 4))


def test_grpo_heads_with_and_without_the_entropy_bonus(bench):
    """``*-grpo`` and ``*-grpo-coef0``: GRPO's advantage-weighted log-probs at temperature 0.7 over
    the rows with a label, minus the entropy bonus (coefficient 0.01) in the first only, checked in
    float64 against log_softmax with a plain PyTorch kernel in the head (the CPU, without TRL)."""
    import torch

    def plain_head(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        log_p = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        return log_p.gather(1, labels[:, None])[:, 0], entropy, None, None, None

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=g, dtype=torch.float64)
    targets = torch.tensor([1, -100, 4, 0, -100, 2])
    mask = targets != -100
    log_p = torch.log_softmax(hidden[mask] @ weight.T / bench.GRPO_TEMPERATURE, dim=-1)
    advantages = bench._advantages(6, hidden.device)[mask].double()
    policy = -(log_p.gather(1, targets[mask][:, None])[:, 0] * advantages).sum() / 4
    entropy = -(log_p.exp() * log_p).sum()
    assert bench.trl_head(plain_head, "grpo-coef0")(hidden, weight, targets).item() == pytest.approx(policy.item())
    assert bench.trl_head(plain_head, "grpo")(hidden, weight, targets).item() == pytest.approx(
        (policy - bench.GRPO_ENTROPY_COEF * entropy / 4).item())


def test_keep0_turns_the_budget_off_and_times_an_earlier_build_as_it_is(bench, flce, monkeypatch):
    """``flce-*-keep0`` runs its loss with the budget at 0 (read here from the settings in force
    during the call), and on an earlier build without kept rows (``--base``, whose settings have no
    such field) the loss as it is, so that the pair with ``@base`` compares the off switch with
    before; every keep0 method is among those ``--base`` times."""
    import types

    settings = sys.modules[flce.__name__ + "._settings"]
    seen = bench.without_kept_rows(flce, lambda h, w, t: settings.current().keep_mib)(None, None, None)
    assert seen == 0
    before = types.ModuleType("before_kept_rows")
    monkeypatch.setitem(sys.modules, "before_kept_rows._settings", types.SimpleNamespace(_FIELDS={"chunk_rows": None}))

    def loss(h, w, t):
        return "recomputed"

    assert bench.without_kept_rows(before, loss) is loss
    keep0 = {m for m in bench.KEPT_METHODS if m.endswith("-keep0")}
    assert keep0 and keep0 <= set(bench.BASE_METHODS)


def test_per_row_loss_weights_each_sequence(bench):
    """``flce-per-row``: the loss per row weighted by its sequence's advantage over the rows with a
    target, checked in float64 against cross_entropy with a plain loss in place of the kernel's
    (the CPU)."""
    import torch

    class Plain:  # the kernel's call, by PyTorch
        @staticmethod
        def fused_linear_cross_entropy(hidden, weight, targets, reduction):
            return torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction=reduction)

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=g, dtype=torch.float64)
    targets = torch.tensor([1, -100, 4, 0, -100, 2])
    advantages = bench._advantages(6, hidden.device).double()
    per_row = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="none")
    assert bench.per_row_loss(Plain)(hidden, weight, targets).item() == pytest.approx(
        (per_row * advantages).sum().item() / 4)


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("matplotlib")
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


def _kept_result(row, method, ms, kept=None):
    """One bench.py result of the kept-rows table: a (head, method) step, with the rows kept if any."""
    return {"row": row, "method": method, "step_ms": ms, "step_peak_mib": 1.0, "n_valid": 4,
            **({} if kept is None else {"kept_rows": kept})}


def test_the_kept_table_predicts_a_partial_share_from_the_step_with_none_kept(report, monkeypatch):
    """With ``kept_rows`` recorded, a row that keeps 3 of its 4 rows is predicted at the step with
    none kept times (6 * 3/4 + 8 * 1/4) / 8 = 13/16, and marked only past 1.05x that; a row that
    keeps all of its rows (predicted at 6/8) is marked against 0.8x TRL's step only."""
    monkeypatch.setattr(report, "_gpu_of", lambda name: "GPU")

    run = {"environment": {"date": "2026-01-01"}, "results": [
        _kept_result("gemma2", "trl-dpo", 105.0), _kept_result("gemma2", "flce-dpo-keep0", 96.0),
        _kept_result("gemma2", "flce-dpo", 82.0, kept=3),  # 0.781x TRL's, but 78.0 predicted: 1.051x of it, marked
        _kept_result("llama3", "trl-dpo", 100.0), _kept_result("llama3", "flce-dpo-keep0", 96.0),
        _kept_result("llama3", "flce-dpo", 79.0, kept=4)]}  # 72.0 predicted, but 0.79x TRL's: not marked
    lines = {line.split(" | ")[0]: line for line in report.token_trainers_section([("run.json", run)]).splitlines()
             if line.startswith("| ")}
    assert lines["| gemma2, 10%"].split(" | ")[4:9] == ["0.781", "96.0", "0.914", "75%", "78.0 (1.051 ✗)"]
    assert lines["| llama3, 10%"].split(" | ")[4:9] == ["0.790", "96.0", "0.960", "100%", "72.0 (1.097)"]


def test_the_kept_table_takes_each_row_from_the_newest_run_that_timed_it(report, monkeypatch):
    """A later run of one head's rows (a rerun with less noise) replaces that head's rows alone: its
    three times (TRL's, kept, none kept) all from the later run, the other head's from the earlier."""
    monkeypatch.setattr(report, "_gpu_of", lambda name: "GPU")

    early = {"environment": {"date": "2026-01-01"}, "results": [
        _kept_result("gemma2", "trl-dpo", 100.0), _kept_result("gemma2", "flce-dpo-keep0", 90.0),
        _kept_result("gemma2", "flce-dpo", 80.0, kept=3),
        _kept_result("llama3", "trl-dpo", 100.0), _kept_result("llama3", "flce-dpo-keep0", 96.0),
        _kept_result("llama3", "flce-dpo", 70.0, kept=4)]}
    late = {"environment": {"date": "2026-01-02"}, "results": [
        _kept_result("gemma2", "trl-dpo", 110.0), _kept_result("gemma2", "flce-dpo-keep0", 88.0),
        _kept_result("gemma2", "flce-dpo", 77.0, kept=3)]}
    lines = {line.split(" | ")[0]: line.split(" | ") for line in
             report.token_trainers_section([("late.json", late), ("early.json", early)]).splitlines()
             if line.startswith("| ")}
    assert lines["| gemma2, 10%"][2:6] == ["110.0", "77.0", "0.700", "88.0"]
    assert lines["| gemma2, 10%"][-1] == "`late.json` |"
    assert lines["| llama3, 10%"][2:6] == ["100.0", "70.0", "0.700", "96.0"]
    assert lines["| llama3, 10%"][-1] == "`early.json` |"


def test_the_hubs_benchmark_runs_and_verifies_every_workload():
    """``kernels benchmark`` on this checkout: its runner finds benchmarks/benchmark_hub.py, loads the
    kernel from the checkout and times each workload, whose result it checks against the script's
    PyTorch eager reference (torch.allclose, atol 1e-2: the loss and log-probs in fp32 on a CPU)."""
    try:  # where kernels keeps its runner: kernels.cli (0.17) or kernels._internals.cli (0.19)
        from kernels.cli.benchmark import run_benchmark_script
    except ImportError:
        from kernels._internals.cli.benchmark import run_benchmark_script
    results, _ = run_benchmark_script(ROOT / "benchmarks" / "benchmark_hub.py", iterations=1, warmup=0, cwd=ROOT,
                                      repo_id=str(ROOT), is_local=True, revision="local")
    workloads = {f"LossStep.{head}" for head in ("llama3", "gemma2", "qwen25", "llama2")}
    assert set(results) == workloads | {"TokenOutputs.sft", "TokenOutputs.grpo"}
    assert all(timing.verified is True and timing.ref_mean_ms is not None for timing in results.values())


def test_the_before_after_sentence_keeps_the_kept_rows_apart(report, monkeypatch):
    """The README's before/after sentence gives the methods whose path the change kept (here the loss, +1%,
    and GRPO's head at FLCE_KEEP_MIB=0, -2%) apart from those it gave kept rows (GRPO's head: -25%, +500 MiB)."""
    def result(method, before, after, mib=(100.0, 100.0)):
        common = {"row": "llama3", "inputs": "lm", "fwd_ms": 1.0}
        return [{**common, "method": f"{method}@base", "step_ms": before, "step_ms_laps": [before],
                 "step_peak_minus_grads_mib": mib[0]},
                {**common, "method": method, "step_ms": after, "step_ms_laps": [after],
                 "step_peak_minus_grads_mib": mib[1]}]

    run = {"environment": {"gpu": "NVIDIA GPU", "date": "2026-01-01"}, "base": {"revision": "abc1234"},
           "results": [*result("fused-linear-ce", 100.0, 101.0), *result("flce-grpo-keep0", 50.0, 49.0),
                       *result("flce-grpo", 40.0, 30.0, mib=(100.0, 600.0))]}
    monkeypatch.setattr(report, "before_after_runs", lambda: [("run.json", run)])
    text = report.before_after_sentence()
    assert "(abc1234)" in text and "3 rows and methods" in text
    assert ("for the loss and GRPO's head at FLCE_KEEP_MIB=0 the step's median time changed by -2.0% to +1.0% "
            "and a step's memory by +0 MiB") in text
    assert "GRPO's head, which now keep rows, -25.0% in time at +500 MiB" in text


def test_the_readme_summary_gives_a_partial_share_its_head_and_prediction(report, monkeypatch):
    """The README's kept-rows paragraph: rows that keep every row as ratios to TRL's step; a head whose
    budget keeps 3 of 4 rows named with its share and its time against the prediction (82 / 78 = 1.051)."""
    monkeypatch.setattr(report, "_gpu_of", lambda name: "GPU")
    monkeypatch.setattr(report, "grpo_step_sentence", lambda: "")

    run = {"environment": {"date": "2026-01-01"}, "results": [
        _kept_result("gemma2", "trl-dpo", 100.0), _kept_result("gemma2", "flce-dpo-keep0", 96.0),
        _kept_result("gemma2", "flce-dpo", 82.0, kept=3),
        _kept_result("llama3", "trl-dpo", 100.0), _kept_result("llama3", "flce-dpo-keep0", 96.0),
        _kept_result("llama3", "flce-dpo", 70.0, kept=4)]}
    text = report.token_summary([("run.json", run)])
    assert "the steps of DPO take 0.70× TRL's time where the budget keeps every row (Llama-3 at 10% ignored)" in text
    assert "and 0.82× on Gemma-2 at 10% ignored, where the budget keeps 75% of the rows: 1.051× the time" in text
