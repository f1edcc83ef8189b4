"""report/sweeps.py: each run's numbers against its baseline (the fp32 run whose config
differs only in precision), on known numbers, and the headline metrics of a report; the
numerics facts read into a run's row (the scaler's settings, a null one the mode's default; the
steps trained, else the last logged scale; an empty row without facts) and kept for a row of
repeats (the first origin, how many had one)."""

from __future__ import annotations

import pytest

from ampsweep.report import numerics, sweeps
from ampsweep.report.model import RunData
from unit.report.test_numerics import (
    TROUBLED,
    TROUBLED_TAGS,
    numeric_findings,
    report,
    three_fp16_seeds,
)
from unit.report.test_numerics import run as numerics_run

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
    rows = {r.precision: r for r in sweeps.compute_rows(runs)}
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
    rows = sweeps.compute_rows(runs)
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
    rows = {r.precision: r for r in sweeps.compute_rows(runs)}
    assert rows["bf16"].baseline is None and rows["bf16"].note == "no fp32 run of the same config"
    rows = {r.precision: r for r in sweeps.compute_rows(runs, "bf16")}
    assert rows["fp16"].speedup == pytest.approx(0.5)
    assert rows["fp16"].acc_delta == pytest.approx(0.01)
    assert rows["fp32"].status == "FAILED" and rows["fp32"].error == "boom"
    none = sweeps.compute_rows([run("bf16", acc=0.9)])
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
    rows = {r.run_id: r for r in sweeps.compute_rows(runs)}
    assert rows["fixed"].baseline_run_id == "fp32-cnn-0.001"
    assert rows["fixed"].speedup == pytest.approx(2.0)
    assert rows["fixed"].config == "keep_fp32=['fc2']"
    assert rows["bf16-cnn-0.001"].config == ""  # at its default: nothing to tell apart


def test_what_the_config_hash_leaves_out_neither_parts_runs_nor_shows_in_the_config_column():
    """A callback that watched one run, a resumed run, a checkpoint folder of its own: the
    config hash leaves these out (the run computes the same), so the report compares the runs
    and its config column shows only the setting that is in the hash (the learning rate)."""
    fp32, bf16, other_lr = run("fp32", sps=100.0), run("bf16", sps=200.0), run("bf16", lr="0.01")
    hooks = "[{'_target_': 'callbacks.RecordSteps', 'path': 'steps.jsonl'}]"
    for r, callbacks, resume, folder in [
        (fp32, "[]", "None", "None"),
        (bf16, hooks, "auto", "/tmp/ck"),
        (other_lr, "[]", "None", "None"),
    ]:
        r.params |= {
            "trainer.callbacks": callbacks,
            "trainer.resume": resume,
            "trainer.checkpoint_dir": folder,
        }
    rows = {r.run_id: r for r in sweeps.compute_rows([fp32, bf16, other_lr])}
    assert rows["bf16-cnn-0.001"].baseline_run_id == "fp32-cnn-0.001"
    assert rows["bf16-cnn-0.001"].speedup == pytest.approx(2.0)
    assert [r.varies for r in rows.values()] == ["lr=0.001", "lr=0.001", "lr=0.01"]


def test_a_scaler_setting_left_at_null_is_the_mode_s_default():
    static = report([numerics_run("fp16_static"), numerics_run("fp16", lr="0.1")]).rows
    assert [r.scale_dynamic for r in static] == [False, True]
    (told,) = report([numerics_run("fp16", params={"precision.scaler.dynamic": "False"})]).rows
    assert told.scale_dynamic is False
    assert (told.scale_min, told.scale_growth_interval) == (1.0, 2000.0)


def test_a_run_without_numerics_facts_has_an_empty_row_and_no_finding():
    (row,) = report([numerics_run("fp32", val__acc=0.9)]).rows
    assert (row.nonfinite_where, row.nonfinite_runs, row.probe) == ("", 0, {})
    assert row.scale_first is None and row.diverged is False
    assert numeric_findings([numerics_run("fp32", val__acc=0.9)]) == []


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
    runs = [numerics_run("fp16", amp__loss_scale=4096.0, amp__skipped_steps=30.0,
                history=[(10, 4096.0), (200, 8192.0), (220, 4096.0)])]  # fmt: skip
    (row,) = report(runs).rows
    assert row.steps == 220.0
    (text,) = numerics.scale_findings(report(runs).summary)
    assert "skipped 30 of 220 steps (13.64%, more than 5%)" in text
