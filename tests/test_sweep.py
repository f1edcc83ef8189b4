"""Sweeps in MLflow: one parent run per multirun, a nested child per job, the report at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli

from ampsweep.tracking import store as mlflow_store


def _runs(store: str):
    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name("ampsweep")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("ampsweep.sweep") == "true"]
    kids = [r for r in runs if mlflow_store.PARENT in r.data.tags]
    return client, parents, kids


def test_each_job_starts_from_clean_global_state(store, quick, tmp_path, monkeypatch):
    """Basic launcher: jobs share a process. A job that leaks TF32, RNG state and an active
    MLflow run must not change the next one."""
    import mlflow
    import torch

    from ampsweep.app import job as runner
    from ampsweep.config import compose as config
    from ampsweep.precision import policy as precision

    monkeypatch.chdir(tmp_path)  # artifacts go under ./outputs
    cfg = config.load(["precision=fp32", f"tracking.uri={store}", *quick])
    first = runner.run_job(cfg)
    precision.set_tf32(True)
    torch.manual_seed(1234)
    torch.rand(100)
    mlflow.set_tracking_uri(store)
    try:
        mlflow.start_run()  # a leaked fluent run
        second = runner.run_job(cfg)
        assert mlflow.active_run() is None
    finally:
        mlflow.set_tracking_uri(None)
    assert first.status == second.status == "FINISHED"
    assert precision.tf32_enabled() == (False, False)
    assert second.summary["val/loss"] == first.summary["val/loss"]
    assert second.summary["train/steps"] == first.summary["train/steps"]


@pytest.mark.slow
def test_three_mode_sweep_makes_one_parent_with_nested_children_and_a_report(
    tmp_path, store, quick
):
    res = run_cli(
        ["train", "-m", "precision=fp32,fp16,bf16", *quick],
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": store},  # the store comes from the environment here
    )
    assert res.returncode == 0, res.stderr
    assert "Findings" in res.stdout and "Fastest here" in res.stdout
    client, parents, kids = _runs(store)
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    tags = parent.data.tags
    assert tags["command"].startswith("ampsweep train -m precision=fp32,fp16,bf16")
    assert (tmp_path / "outputs" / "multirun").resolve() in Path(tags["sweep_dir"]).parents
    assert (tags["jobs_total"], tags["jobs_finished"], tags["jobs_failed"]) == ("3", "3", "0")
    assert {k.data.tags[mlflow_store.PARENT] for k in kids} == {parent.info.run_id}
    by_name = {k.info.run_name: k for k in kids}
    assert set(by_name) == {"fp32-cnn-digits", "fp16-cnn-digits", "bf16-cnn-digits"}
    assert all(k.info.status == "FINISHED" for k in kids)
    assert sorted(k.data.tags["job_num"] for k in kids) == ["0", "1", "2"]

    # The report logged to the parent matches the children's own metrics.
    files = {f.path for f in client.list_artifacts(parent.info.run_id)}
    assert {"report.md", "report.csv", "report.json", "charts"} <= files
    charts = {f.path for f in client.list_artifacts(parent.info.run_id, "charts")}
    assert {"charts/throughput.png", "charts/memory.png", "charts/accuracy.png"} <= charts
    assert {"charts/val_loss.png", "charts/loss_scale.png"} <= charts
    fp32, bf16 = by_name["fp32-cnn-digits"].data.metrics, by_name["bf16-cnn-digits"].data.metrics
    speedup = bf16["perf/samples_per_s"] / fp32["perf/samples_per_s"]
    assert parent.data.metrics["speedup/bf16"] == pytest.approx(speedup)
    ratio = bf16["mem/activation_mib"] / fp32["mem/activation_mib"]
    assert parent.data.metrics["activation_ratio/bf16"] == pytest.approx(ratio)
    assert parent.data.metrics["acc_delta/bf16"] == pytest.approx(bf16["val/acc"] - fp32["val/acc"])

    res = run_cli(["report", "--format", "json", "--tracking-uri", store], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["sweep"]["run_id"] == parent.info.run_id
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


@pytest.mark.slow
def test_a_failing_job_fails_its_child_and_the_parent_not_the_sweep(tmp_path, store, quick):
    # tf32 cannot run on a CPU; the fp32 jobs share a name, so they get their job numbers.
    args = ["train", "-m", "precision=fp32,tf32", "optimizer.lr=0.001,0.002"]
    res = run_cli([*args, f"tracking.uri={store}", "trainer.device=cpu", *quick], cwd=tmp_path)
    assert res.returncode != 0
    assert "2 of 4 jobs failed" in res.stderr
    # Hydra's basic sweeper runs the product in override order: fp32 jobs 0-1, tf32 jobs 2-3.
    assert "#2 tf32-cnn-digits-2 (FAILED); #3 tf32-cnn-digits-3 (FAILED)" in res.stderr
    # Each job's error is said once when it fails (and once more in the report's findings).
    assert res.stderr.count("precision=tf32 needs a CUDA GPU") == 2
    assert res.stdout.count("precision=tf32 needs a CUDA GPU") == 2
    assert "Traceback" not in res.stderr
    _, parents, kids = _runs(store)
    assert len(parents) == 1 and parents[0].info.status == "FAILED"
    tags = parents[0].data.tags
    assert (tags["jobs_total"], tags["jobs_finished"], tags["jobs_failed"]) == ("4", "2", "2")
    status = {k.info.run_name: k.info.status for k in kids}
    assert status == {
        "fp32-cnn-digits-0": "FINISHED",
        "fp32-cnn-digits-1": "FINISHED",
        "tf32-cnn-digits-2": "FAILED",
        "tf32-cnn-digits-3": "FAILED",
    }
    failed = next(k for k in kids if k.info.run_name == "tf32-cnn-digits-2")
    assert "needs a CUDA GPU" in failed.data.tags["error"]
    assert all(k.info.status != "RUNNING" for k in kids)


@pytest.mark.slow
def test_jobs_in_other_processes_join_the_parent(tmp_path, store, quick):
    """hydra-submitit-launcher's local launcher runs each job in its own process."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = ["train", "-m", "hydra/launcher=submitit_local", "precision=fp32,bf16"]
    res = run_cli([*args, f"tracking.uri={store}", *quick], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    _, parents, kids = _runs(store)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert {k.info.run_name: k.info.status for k in kids} == {
        "fp32-cnn-digits": "FINISHED",
        "bf16-cnn-digits": "FINISHED",
    }
    assert {k.data.tags[mlflow_store.PARENT] for k in kids} == {parents[0].info.run_id}


def test_report_says_what_is_missing_in_one_line(tmp_path, store):
    missing = f"sqlite:///{tmp_path / 'nowhere.db'}"
    res = run_cli(["report", "--tracking-uri", missing], cwd=tmp_path)
    assert res.returncode == 2
    assert "no MLflow store at" in res.stderr and "Traceback" not in res.stderr
    res = run_cli(["report", "--tracking-uri", store], cwd=tmp_path)  # a store, but empty
    assert res.returncode == 2 and "no sweep with runs in this store" in res.stderr
    res = run_cli(["report", "--baseline", "fp8"], cwd=tmp_path)
    assert res.returncode == 2 and "--baseline fp8: not a precision mode" in res.stderr


def test_a_sweep_whose_launcher_died_is_ended_by_the_next_launch(store):
    import socket
    import subprocess
    import sys

    from mlflow import MlflowClient

    from ampsweep.tracking import sweep

    client = MlflowClient(store)
    exp = client.create_experiment("orphans")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = gone.stdout.strip()  # that process has exited

    def parent(host: str, pid: str) -> str:
        tags = {
            "ampsweep.sweep": "true",
            mlflow_store.LAUNCHER_HOST: host,
            mlflow_store.LAUNCHER_PID: pid,
        }
        return client.create_run(exp, tags=tags).info.run_id

    orphan = parent(socket.gethostname(), dead_pid)
    alive = parent(socket.gethostname(), str(os.getpid()))
    elsewhere = parent("another-host", dead_pid)
    assert sweep.end_orphaned_sweeps(client, exp) == [orphan]
    assert client.get_run(orphan).info.status == "KILLED"
    assert "ended_by" in client.get_run(orphan).data.tags
    assert client.get_run(alive).info.status == "RUNNING"  # its launcher is still running
    assert client.get_run(elsewhere).info.status == "RUNNING"  # not ours to judge
