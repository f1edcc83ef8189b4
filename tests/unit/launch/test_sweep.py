"""app/sweep.py: a sweep's parent run is ended from its jobs whatever its report does."""

from __future__ import annotations

from pathlib import Path

from conftest import all_runs

from ampsweep.launch import sweep
from ampsweep.report import sweeps as report_sweeps
from ampsweep.tracking import store

TINY = ["model=mlp", "model.width=8", "trainer.epochs=1", "trainer.max_steps=2"]
TINY += ["trainer.log_every=1", "trainer.progress=false", "trainer.timing_warmup_steps=0"]


def test_a_report_that_fails_leaves_the_sweep_finished(store_uri, main, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the disk is full")

    monkeypatch.setattr(report_sweeps, "build_report", broken)
    result = main("train", "-m", "precision=fp32,bf16", *TINY, f"tracking.uri={store_uri}")
    assert result.code == 0, result.err  # every job finished: the sweep succeeded
    assert result.err.strip() == (
        "error: could not write the sweep report: RuntimeError: the disk is full"
    )
    (parent,) = [r for r in all_runs(store_uri) if r.data.tags.get(store.SWEEP) == "true"]
    assert parent.info.status == store.FINISHED
    assert parent.data.tags["jobs_finished"] == "2"


def test_a_report_that_fails_leaves_a_failed_sweep_failed(store_uri, main, monkeypatch):
    monkeypatch.setattr(report_sweeps, "publish", lambda *a: 1 / 0)
    args = ["precision=fp32,tf32", "trainer.device=cpu", *TINY, f"tracking.uri={store_uri}"]
    result = main("train", "-m", *args)
    assert result.code == 1
    assert "could not write the sweep report: ZeroDivisionError" in result.err
    assert "1 of 2 jobs failed" in result.err
    (parent,) = [r for r in all_runs(store_uri) if r.data.tags.get(store.SWEEP) == "true"]
    assert parent.info.status == store.FAILED


def test_ctrl_c_while_reporting_ends_the_parent_killed_with_the_report_missing(
    store_uri, monkeypatch
):
    """Ctrl-C while the report is drawn: the parent is not left RUNNING, nor FINISHED without
    its report: KILLED, with the tag that says how to write it."""
    from ampsweep.config import compose as config

    cfgs = [config.load([f"tracking.uri={store_uri}", "precision=fp32"])]
    info = sweep.begin(cfgs, ["-m", "precision=fp32"], Path("multirun").resolve(), "sweep")
    client = store.client_for(store_uri)
    parent = client.get_run(info.parent_run_id)
    kid = client.create_run(
        parent.info.experiment_id, tags={store.PARENT: info.parent_run_id, store.JOB_NUM: "0"}
    )
    client.set_terminated(kid.info.run_id, store.FINISHED)

    def interrupted(info):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep, "publish_report", interrupted)
    result = sweep.finish(info, interrupted=False)
    assert result.report_missing and "ampsweep report --sweep" in result.report_missing
    parent = client.get_run(info.parent_run_id)
    assert parent.info.status == store.KILLED
    assert parent.data.tags[store.REPORT_MISSING] == result.report_missing
