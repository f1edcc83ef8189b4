"""report/rows.py: each run's numbers against its baseline (the fp32 run whose config differs
only in precision), on known numbers; and the headline metrics of a report."""

from __future__ import annotations

import pytest

from ampsweep.report import rows as report_rows
from ampsweep.report import sweeps
from ampsweep.report.model import RunData

CPU = {"device": "cpu", "device_name": "x86_64", "cpu_threads": "2", "torch_version": "2.14.1"}
CUDA = {"device": "cuda", "device_name": "NVIDIA H200", "compute_capability": "9.0"}


def run(mode, *, model="cnn", lr="0.001", status="FINISHED", device=CPU, error=None, **metrics):
    params = {"precision.name": mode, "precision.dtype": mode[:4], "model.name": model}
    params["optimizer.lr"] = lr
    tags = {"precision": mode, "model": model, "dataset": "digits", **device}
    if error:
        tags["error"] = error
    names = {"acc": "val/acc", "sps": "perf/samples_per_s", "act": "mem/activation_mib"}
    names |= {"peak": "mem/peak_allocated_mib", "skipped": "amp/skipped_steps"}
    names |= {"scale": "amp/loss_scale", "underflow": "amp/grad_underflow_frac"}
    return RunData(
        run_id=f"{mode}-{model}-{lr}",
        name=f"{mode}-{model}-digits",
        status=status,
        params=params,
        tags=tags,
        metrics={names[k]: v for k, v in metrics.items()},
    )


def test_ratios_and_deltas_on_known_numbers():
    runs = [
        run("fp32", acc=0.98, sps=1000.0, act=4.0, peak=800.0, skipped=0.0),
        run("bf16", acc=0.97, sps=2500.0, act=2.0, peak=500.0, skipped=0.0),
        run("fp16", acc=0.985, sps=2000.0, act=2.2, peak=520.0, skipped=3.0, scale=8192.0),
    ]
    rows = {r.precision: r for r in report_rows.compute_rows(runs)}
    assert rows["fp32"].speedup == 1.0 and rows["fp32"].acc_delta == 0.0
    assert rows["bf16"].speedup == pytest.approx(2.5)
    assert rows["bf16"].acc_delta == pytest.approx(-0.01)
    assert rows["bf16"].activation_ratio == pytest.approx(0.5)
    assert rows["bf16"].peak_ratio == pytest.approx(0.625)
    assert rows["fp16"].speedup == pytest.approx(2.0)
    assert rows["fp16"].activation_ratio == pytest.approx(0.55)
    assert rows["fp16"].skipped_steps == 3.0 and rows["fp16"].loss_scale == 8192.0
    assert rows["bf16"].baseline == "fp32-cnn-digits"
    head = sweeps.make_report({"run_id": "p"}, runs).headline_metrics()
    assert head["speedup/bf16"] == pytest.approx(2.5)
    assert head["acc_delta/fp16"] == pytest.approx(0.005)
    assert head["activation_ratio/fp16"] == pytest.approx(0.55)
    assert head["peak_ratio/bf16"] == pytest.approx(0.625)


def test_baseline_is_the_fp32_run_whose_config_differs_only_in_precision():
    runs = [
        run("fp32", model="cnn", acc=0.9, sps=100.0, act=1.0),
        run("fp32", model="mlp", acc=0.8, sps=400.0, act=0.5),
        run("bf16", model="mlp", acc=0.8, sps=200.0, act=0.25),
        run("bf16", model="cnn", acc=0.9, sps=300.0, act=0.5),
        run("bf16", model="cnn", lr="0.01", acc=0.7, sps=300.0, act=0.5),  # no fp32 at lr=0.01
    ]
    rows = report_rows.compute_rows(runs)
    by_id = {r.run_id: r for r in rows}
    assert by_id["bf16-mlp-0.001"].baseline_run_id == "fp32-mlp-0.001"
    assert by_id["bf16-mlp-0.001"].speedup == pytest.approx(0.5)
    assert by_id["bf16-cnn-0.001"].baseline_run_id == "fp32-cnn-0.001"
    assert by_id["bf16-cnn-0.001"].speedup == pytest.approx(3.0)
    orphan = by_id["bf16-cnn-0.01"]
    assert orphan.baseline is None and orphan.speedup is None and orphan.acc_delta is None
    assert orphan.note == "no fp32 run of the same config"
    # Two runs share a mode, so headline metrics are keyed by run name there.
    head = sweeps.make_report({"run_id": "p"}, runs).headline_metrics()
    assert "speedup/bf16-mlp-digits" in head and "speedup/bf16" not in head


def test_baseline_mode_can_be_chosen_and_failed_baselines_are_not_used():
    runs = [
        run("fp32", status="FAILED", error="boom"),
        run("bf16", acc=0.9, sps=300.0, act=0.5),
        run("fp16", acc=0.91, sps=150.0, act=0.5),
    ]
    rows = {r.precision: r for r in report_rows.compute_rows(runs)}
    assert rows["bf16"].baseline is None and rows["bf16"].note == "no fp32 run of the same config"
    rows = {r.precision: r for r in report_rows.compute_rows(runs, "bf16")}
    assert rows["fp16"].speedup == pytest.approx(0.5)
    assert rows["fp16"].acc_delta == pytest.approx(0.01)
    assert rows["fp32"].status == "FAILED" and rows["fp32"].error == "boom"
    none = report_rows.compute_rows([run("bf16", acc=0.9)])
    assert none[0].note == "no fp32 run in this sweep"


def test_a_prescribed_run_named_by_its_option_compares_with_fp32_and_shows_its_keep_fp32():
    """ampsweep doctor's prescriptions: the same mode with precision.keep_fp32 and a run name
    of their own. The name is a label (still comparable with fp32); keep_fp32 tells the two
    bf16 rows apart."""
    fixed = run("bf16", acc=0.9, sps=200.0)
    fixed.run_id = "fixed"
    fixed.params |= {"precision.keep_fp32": "['fc2']", "tracking.run_name": "doctor_bf16"}
    runs = [run("fp32", acc=0.9, sps=100.0), run("bf16", status="FAILED"), fixed]
    for r in runs[:2]:
        r.params |= {"precision.keep_fp32": "[]", "tracking.run_name": "None"}
    rows = {r.run_id: r for r in report_rows.compute_rows(runs)}
    assert rows["fixed"].baseline_run_id == "fp32-cnn-0.001"
    assert rows["fixed"].speedup == pytest.approx(2.0)
    assert rows["fixed"].varies == "keep_fp32=['fc2']"
    assert rows["bf16-cnn-0.001"].varies == "keep_fp32=[]"
