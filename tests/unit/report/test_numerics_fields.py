"""report/numerics_fields.py: the numerics facts read into a run's row (the scaler's
settings, a null one the mode's default; the steps trained, else the last logged scale; an
empty row without facts) and kept for a row of repeats (the first origin, how many had one)."""

from __future__ import annotations

from ampsweep.report import numerics
from unit.report.test_numerics import (
    TROUBLED,
    TROUBLED_TAGS,
    numeric_findings,
    report,
    run,
    three_fp16_seeds,
)


def test_a_scaler_setting_left_at_null_is_the_mode_s_default():
    static = report([run("fp16_static"), run("fp16", lr="0.1")]).rows
    assert [r.scale_dynamic for r in static] == [False, True]
    (told,) = report([run("fp16", params={"precision.scaler.dynamic": "False"})]).rows
    assert told.scale_dynamic is False
    assert (told.scale_min, told.scale_growth_interval) == (1.0, 2000.0)


def test_a_run_without_numerics_facts_has_an_empty_row_and_no_finding():
    (row,) = report([run("fp32", val__acc=0.9)]).rows
    assert (row.nonfinite_where, row.nonfinite_runs, row.probe) == ("", 0, {})
    assert row.scale_first is None and row.diverged is False
    assert numeric_findings([run("fp32", val__acc=0.9)]) == []


def test_repeats_keep_the_first_origin_and_how_many_runs_had_one():
    rep = report(three_fp16_seeds(troubled_seed=1))
    (row,) = rep.summary
    assert row.n == 3 and row.nonfinite_runs == 1
    assert (row.nonfinite_where, row.nonfinite_module) == ("step 1: conv1", "conv1")
    assert row.probe == TROUBLED and row.fp16_overflow == TROUBLED_TAGS["numerics.fp16_overflow"]
    found = numerics.findings(rep.summary)
    assert (
        "fp16-cnn-digits (1 of 3 runs): step 1: conv1; fix: precision.keep_fp32=[conv1]." in found
    )
    assert sum(f.startswith("Numerics probe: fp16 overflows") for f in found) == 1


def test_a_run_without_train_steps_counts_to_its_last_logged_scale():
    runs = [run("fp16", amp__loss_scale=4096.0, amp__skipped_steps=30.0,
                history=[(10, 4096.0), (200, 8192.0), (220, 4096.0)])]  # fmt: skip
    (row,) = report(runs).rows
    assert row.steps == 220.0
    (text,) = numerics.scale_findings(report(runs).summary)
    assert "skipped 30 of 220 steps (13.64%, more than 5%)" in text
