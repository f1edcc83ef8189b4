"""engine/measured.py: what a run measures once after training; here the step time
``ampsweep predict`` gives a run's mode on its GPU, recorded against the measured one."""

from __future__ import annotations

import json

import pytest
from conftest import all_runs

from ampsweep.config import compose as config
from ampsweep.engine import build as train
from ampsweep.engine import measured
from ampsweep.measure.roofline import gpu_spec


def test_a_run_on_a_gpu_of_the_table_records_the_step_predict_gives_its_mode(
    main, store, quick, monkeypatch
):
    """The CUDA device's name mapped to an H100 (the run itself on this CPU): the run records
    predict/step_ms, what ``ampsweep predict --gpu h100`` gives bf16 on the same model and
    batch, and its error against the measured median step."""
    monkeypatch.setattr(measured, "gpu_of", lambda device: gpu_spec("h100"))
    result = main("train", *quick, "precision=bf16", f"tracking.uri={store}")
    assert result.code == 0, result.err
    (run,) = all_runs(store)
    metrics = run.data.metrics
    step, measured_ms = metrics["predict/step_ms"], metrics["perf/step_time_ms"]
    expected = 100.0 * (step - measured_ms) / measured_ms
    assert metrics["predict/error_pct"] == pytest.approx(expected)
    result = main("predict", "--gpu", "h100", "--format", "json", *quick)
    assert result.code == 0, result.err
    assert step == pytest.approx(json.loads(result.out)["modes"]["bf16"]["step_ms"])


def test_nothing_is_traced_off_a_known_gpu_or_when_nothing_is_recorded(quick, monkeypatch):
    def trace(*args, **kwargs):
        raise AssertionError("traced")

    monkeypatch.setattr(measured, "trace_step", trace)
    tracked = train.build(config.load([*quick, "precision=bf16"]))
    assert measured.predicted(tracked, 8.0) == {}  # on the CPU: no GPU of the table
    monkeypatch.setattr(measured, "gpu_of", lambda device: gpu_spec("h100"))
    untracked = train.build(config.load([*quick, "precision=bf16", "tracking=none"]))
    assert measured.predicted(untracked, 8.0) == {}
    with pytest.raises(AssertionError, match="traced"):  # the guard above is what stopped it
        measured.predicted(tracked, 8.0)
