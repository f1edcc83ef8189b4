"""report/quality.py on constructed runs: the time and steps to reach the quality target, from
the evaluations each run logged; "not reached" said as such; the column, finding and chart."""

from __future__ import annotations

from ampsweep.report import charts, render, sweeps
from unit.report.test_groups import run

START = 1_000_000  # ms: when each run started


def evaluated(mode, seed, job, evals, key="val/acc"):
    """A run that logged ``evals`` (seconds after its start, step, value) and ended there."""
    r = run(mode, seed, job, sps=1000.0, act=1.0)
    r.metrics[key] = evals[-1][2]
    r.started_ms = START
    r.timeline = {key: [(step, value, START + int(s * 1000)) for s, step, value in evals]}
    return r


def test_time_and_steps_to_the_default_target_with_not_reached_said():
    runs = [
        evaluated("fp32", 0, 0, [(10, 100, 0.90), (20, 200, 0.97), (30, 300, 0.98)]),
        evaluated("bf16", 0, 1, [(5, 100, 0.92), (9, 200, 0.976), (14, 300, 0.981)]),
        evaluated("fp16", 0, 2, [(40, 100, 0.50), (80, 200, 0.70), (120, 300, 0.80)]),
    ]
    rep = sweeps.make_report({"run_id": "p", "name": "s"}, runs)
    by = {r.precision: r for r in rep.rows}
    # target: within 0.5 points of fp32's final 0.980, so 0.975
    assert by["fp32"].target == 0.98 - 0.005
    assert (by["fp32"].target_s, by["fp32"].target_steps) == (30.0, 300)
    assert (by["bf16"].target_s, by["bf16"].target_steps) == (9.0, 200)
    assert by["fp16"].target_s is None and by["fp16"].to_target == "not reached"
    assert by["bf16"].to_target == "9.0 s"
    finding = next(f for f in rep.findings if f.startswith("Time to quality"))
    assert "val acc >= 0.975 (within 0.5 points of fp32's 0.980)" in finding
    assert "bf16 in 9.0 s (step 200, 0.30x fp32's time); fp32 in 30.0 s (step 300)" in finding
    assert "fp16 not reached in its 3 evaluation(s)" in finding
    headers, body = render.table_cells(rep, wide=False, width=render.CONSOLE_WIDTH)
    column = headers.index("to target")
    assert [row[column] for row in body] == ["30.0 s", "9.0 s", "not reached"]
    headers, body = render.table_cells(rep)  # the files: the steps too
    assert [row[headers.index("steps to target")] for row in body] == ["300", "200", "-"]


def test_a_given_target_and_a_language_model_lower_is_better(tmp_path):
    key = "val/perplexity"
    runs = [
        evaluated("fp32", 0, 0, [(10, 50, 20.0), (20, 100, 12.0)], key),
        evaluated("bf16", 0, 1, [(8, 50, 14.0), (16, 100, 11.0)], key),
    ]
    default = sweeps.make_report({"run_id": "p"}, runs)
    bf16 = next(r for r in default.rows if r.precision == "bf16")
    assert bf16.target == 12.0 * 1.02 and bf16.target_s == 16.0  # within 2% of 12.0
    given = sweeps.make_report({"run_id": "p"}, runs, target=15.0)
    by = {r.precision: r for r in given.rows}
    assert (by["bf16"].target_s, by["fp32"].target_s) == (8.0, 20.0)
    assert any("val perplexity <= 15.000 (--target)" in f for f in given.findings)
    made = charts.write_charts(given, tmp_path)
    chart = tmp_path / "time_to_quality.png"
    assert chart in made and chart.read_bytes()[:4] == b"\x89PNG"


def test_over_repeats_the_mean_of_the_runs_that_reached_it():
    runs = [
        evaluated("fp32", 0, 0, [(10, 100, 0.98)]),
        evaluated("bf16", 0, 1, [(6, 100, 0.98)]),
        evaluated("fp32", 1, 2, [(12, 100, 0.98)]),
        evaluated("bf16", 1, 3, [(8, 100, 0.90)]),  # this seed never got there
    ]
    rep = sweeps.make_report({"run_id": "p"}, runs)
    bf16 = next(r for r in rep.summary if r.precision == "bf16")
    assert (bf16.n, bf16.target_reached, bf16.target_s) == (2, 1, 6.0)
    assert bf16.to_target == "6.0 s (1/2)"
    fp32 = next(r for r in rep.summary if r.precision == "fp32")
    assert fp32.target_s == 11.0 and fp32.to_target == "11.0 s"
