"""report/predicted.py: a sweep on a GPU of the table reads back each run's predicted step
against its measured one, as one finding and as columns of the full table."""

from __future__ import annotations

from ampsweep.report import predicted, sweeps
from ampsweep.report.model import RunData
from ampsweep.report.render import columns

CUDA = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}


def run(mode: str, **metrics: float) -> RunData:
    return RunData(
        run_id=mode,
        name=f"{mode}-gpt-pysource",
        status="FINISHED",
        params={"precision.name": mode, "model.name": "gpt"},
        tags={"precision": mode, "model": "gpt", "dataset": "pysource", **CUDA},
        metrics={"val/acc": 0.5, "perf/samples_per_s": 1000.0 / metrics["perf/step_time_ms"]}
        | metrics,
    )


def test_each_modes_predicted_step_is_read_against_its_measured_one():
    runs = [
        run(
            "fp32", **{"perf/step_time_ms": 2.0, "predict/step_ms": 1.5, "predict/error_pct": -25.0}
        ),
        run(
            "bf16", **{"perf/step_time_ms": 0.5, "predict/step_ms": 0.6, "predict/error_pct": 20.0}
        ),
    ]
    report = sweeps.make_report({"run_id": "p"}, runs)
    (found,) = [f for f in report.findings if f.startswith("Predicted against measured")]
    assert "fp32 1.5 ms against 2 ms (-25%); bf16 0.6 ms against 0.5 ms (+20%)" in found
    assert "negative: predicted faster than measured" in found
    keys = [c.key for c in columns(report)]
    assert "extra:predict/step_ms" in keys and "extra:predict/error_pct" in keys


def test_runs_that_recorded_no_prediction_give_no_finding():
    runs = [run("fp32", **{"perf/step_time_ms": 2.0}), run("bf16", **{"perf/step_time_ms": 1.0})]
    report = sweeps.make_report({"run_id": "p"}, runs)
    assert predicted.findings(report.summary) == []
    assert not any(f.startswith("Predicted against") for f in report.findings)


def test_a_row_with_a_precision_setting_is_named_by_it():
    times = {"perf/step_time_ms": 0.5, "predict/step_ms": 0.6, "predict/error_pct": 20.0}
    runs = [run("fp32", **times), run("bf16_pure", **times), run("bf16_pure", **times)]
    runs[2].run_id = "bf16_pure-masters"
    runs[2].params["precision.master_weights"] = "True"
    report = sweeps.make_report({"run_id": "p"}, runs)
    (found,) = [f for f in report.findings if f.startswith("Predicted against measured")]
    assert "; bf16_pure 0.6 ms against" in found
    assert "; bf16_pure (master_weights=true) 0.6 ms against 0.5 ms (+20%)." in found
