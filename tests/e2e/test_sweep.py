"""``ampsweep train -m``: one MLflow parent run per multirun, a nested child per job, and the
report printed and logged at the end; ``ampsweep report`` reads it back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import all_runs

from ampsweep.tracking import store

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("three_mode_sweep")]


def parents_and_children(uri: str):
    runs = all_runs(uri)
    parents = [r for r in runs if r.data.tags.get(store.SWEEP) == "true"]
    kids = [r for r in runs if store.PARENT in r.data.tags]
    return parents, kids


def test_three_mode_sweep_makes_one_parent_with_nested_children(three_mode_sweep):
    sweep = three_mode_sweep
    out = sweep.result.out  # a speed verdict, or why the busy machine's timings give none
    assert "Findings" in out and ("Fastest here" in out or "Timing contended" in out)
    parents, kids = parents_and_children(sweep.uri)
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    tags = parent.data.tags
    assert tags["command"].startswith("ampsweep train -m precision=fp32,fp16,bf16")
    assert (sweep.folder / "outputs" / "multirun").resolve() in Path(tags["sweep_dir"]).parents
    assert (tags["jobs_total"], tags["jobs_finished"], tags["jobs_failed"]) == ("3", "3", "0")
    assert "jobs_missing" not in tags
    assert {k.data.tags[store.PARENT] for k in kids} == {parent.info.run_id}
    by_name = {k.info.run_name: k for k in kids}
    assert set(by_name) == {"fp32-cnn-digits", "fp16-cnn-digits", "bf16-cnn-digits"}
    assert all(k.info.status == "FINISHED" for k in kids)
    assert sorted(k.data.tags["job_num"] for k in kids) == ["0", "1", "2"]


def test_the_report_logged_to_the_parent_matches_the_children(three_mode_sweep):
    client = store.client_for(three_mode_sweep.uri)
    (parent,), kids = parents_and_children(three_mode_sweep.uri)
    files = {f.path for f in client.list_artifacts(parent.info.run_id)}
    assert {"report.md", "report.csv", "report.json", "charts"} <= files
    charts = {f.path for f in client.list_artifacts(parent.info.run_id, "charts")}
    assert {"charts/throughput.png", "charts/memory.png", "charts/accuracy.png"} <= charts
    assert {"charts/val_loss.png", "charts/loss_scale.png", "charts/memory_breakdown.png"} <= charts
    path = client.download_artifacts(parent.info.run_id, "report.json", ".")
    report = json.loads(Path(path).read_text())
    assert all(r["memory"]["step_peak_mib"] > 0 for r in report["rows"])  # every run's parts
    by_name = {k.info.run_name: k for k in kids}
    fp32, bf16 = by_name["fp32-cnn-digits"].data.metrics, by_name["bf16-cnn-digits"].data.metrics
    speedup = bf16["perf/samples_per_s"] / fp32["perf/samples_per_s"]
    assert parent.data.metrics["speedup/bf16"] == pytest.approx(speedup)
    ratio = bf16["mem/activation_mib"] / fp32["mem/activation_mib"]
    assert parent.data.metrics["activation_ratio/bf16"] == pytest.approx(ratio)
    assert parent.data.metrics["acc_delta/bf16"] == pytest.approx(bf16["val/acc"] - fp32["val/acc"])


def test_ampsweep_report_reads_the_sweep_back(three_mode_sweep, main, monkeypatch):
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR
    from mlflow.utils import file_utils

    # MLflow draws a download bar whenever this variable says so as a transfer starts
    drawn = []
    original = file_utils.ArtifactProgressBar.__init__

    def spy(self, *args, **kwargs):
        drawn.append(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get())
        original(self, *args, **kwargs)

    monkeypatch.setattr(file_utils.ArtifactProgressBar, "__init__", spy)
    uri = three_mode_sweep.uri
    res = main("report", "--sweep", "latest", "--format", "json", "--tracking-uri", uri)
    assert res.code == 0, res.err
    assert len(drawn) == 3 and not any(drawn)  # each run's modules read, without a bar
    rep = json.loads(res.out)
    (parent,), kids = parents_and_children(three_mode_sweep.uri)
    by_name = {k.info.run_name: k for k in kids}
    assert rep["sweep"]["run_id"] == parent.info.run_id
    assert [row["precision"] for row in rep["rows"]] == ["fp32", "fp16", "bf16"]  # job order
    for row in rep["rows"]:
        m = by_name[row["name"]].data.metrics
        assert row["val_acc"] == m["val/acc"]
        assert row["samples_per_s"] == m["perf/samples_per_s"]
        assert row["activation_mib"] == m["mem/activation_mib"]
        assert row["skipped_steps"] == m["amp/skipped_steps"]
        assert row["loss_scale"] == m.get("amp/loss_scale")
        assert row["baseline"] == "fp32-cnn-digits"
    fp16_row = next(r for r in rep["rows"] if r["precision"] == "fp16")
    assert fp16_row["loss_scale"] is not None  # the dynamic scaler ran


def test_ampsweep_report_formats(three_mode_sweep, main):
    markdown = main("report", "--format", "markdown", "--tracking-uri", three_mode_sweep.uri)
    assert markdown.code == 0, markdown.err
    assert markdown.out.count("| bf16 | cnn | digits | FINISHED |") == 1
    assert "## Findings" in markdown.out
    csv_out = main("report", "--format", "csv", "--tracking-uri", three_mode_sweep.uri)
    assert csv_out.code == 0 and len(csv_out.out.strip().splitlines()) == 4  # header + 3 runs
    table = main("report", "--tracking-uri", three_mode_sweep.uri, "--baseline", "bf16")
    assert table.code == 0 and "bf16" in table.out
