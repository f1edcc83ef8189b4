"""report/trials.py: a search's trials grouped by mode, each mode's best by the lowest final
val/loss (the objective the search minimised), only where a mode ran several settings."""

from __future__ import annotations

from ampsweep.report import render, trials
from unit.report.test_numerics import report, run


def test_each_mode_names_its_best_trial():
    runs = [
        run("fp32", lr="0.01", job=0, val__loss=2.1, val__acc=0.3),
        run("bf16", lr="0.01", job=1, val__loss=1.9, val__acc=0.4),
        run("fp32", lr="0.001", job=2, val__loss=1.7, val__acc=0.5),
        run("bf16", lr="0.001", job=3, val__loss=2.3, val__acc=0.2, status="FAILED"),
    ]
    rep = report(runs)
    best = {m.precision: (m.best.run_id, m.trials, m.loss) for m in trials.best_by_mode(rep)}
    assert best == {"fp32": ("fp32-0-0.001", 2, 1.7), "bf16": ("bf16-0-0.01", 1, 1.9)}
    (fp32_line,) = [ln for ln in trials.lines(rep) if ln.startswith("fp32:")]
    assert fp32_line == (
        "fp32: best of 2 trial(s) is fp32-cnn-digits-2 (fp32-0-0.001): val/loss 1.7 with lr=0.001"
    )
    assert "## Best of each mode" in render.to_markdown(rep)


def test_a_grid_of_one_setting_per_mode_or_its_repeats_is_no_search():
    runs = [run(m, seed=s, job=2 * s + i, val__loss=2.0) for s in (0, 1)
            for i, m in enumerate(("fp32", "bf16"))]  # fmt: skip
    rep = report(runs)
    assert trials.best_by_mode(rep) == [] and trials.lines(rep) == []
    assert "## Best of each mode" not in render.to_markdown(rep)
