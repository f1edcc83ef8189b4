"""app/job.py: one job, run in this process, and what it leaves in a temporary SQLite store:
the recorded run, failures ended FAILED/KILLED, stop requests, resume by run id and every
resume refusal, divergence, secrets, clean global state between the jobs of a sweep."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from callbacks import signal_at_step
from conftest import all_runs

from ampsweep.config import compose as config
from ampsweep.engine import loop
from ampsweep.runner import job
from ampsweep.runner.context import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_KILLED,
    CommandContext,
    JobOutcome,
)
from ampsweep.tracking import store

METRICS_CPU = {
    "train/loss",
    "train/lr",
    "val/loss",
    "val/acc",
    "perf/step_time_ms",
    "perf/samples_per_s",
    "perf/wall_s",
    "mem/activation_mib",
    "mem/peak_rss_mib",
    "amp/skipped_steps",
}
METRICS_SCALER = {"amp/loss_scale"}
METRICS_CUDA = {"mem/peak_allocated_mib", "mem/peak_reserved_mib"}
TAGS = {
    "precision",
    "model",
    "dataset",
    "device",
    "device_name",
    "torch_version",
    "ampsweep_version",
    "git_commit",  # the tests run inside the git checkout
    "git_dirty",
    "host",
}


def run(uri: str, quick: list[str], *overrides: str, command=None) -> JobOutcome:
    cfg = config.load([*quick, f"tracking.uri={uri}", *overrides])
    return job.run_job(cfg, command=command)


def in_main_thread() -> None:
    # Signal handlers can only be installed (and signals only delivered) in the main thread.
    assert threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------- what a run records


def test_a_run_records_every_metric_param_tag_and_artifact(tmp_path, store_uri, quick):
    outcome = run(store_uri, quick, "precision=fp16")
    assert outcome.status == "FINISHED" and outcome.exit_code == 0
    client = store.client_for(store_uri)
    r = client.get_run(outcome.run_id)
    assert r.info.status == "FINISHED"
    assert r.info.run_name == "fp16-cnn-digits"

    assert set(r.data.metrics) >= METRICS_CPU | METRICS_SCALER
    assert not set(r.data.metrics) & METRICS_CUDA  # CPU run
    steps = [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")]
    assert steps == [2, 4, 6]  # every trainer.log_every=2 steps
    assert [m.step for m in client.get_metric_history(r.info.run_id, "val/acc")] == [6]
    assert 0.0 <= r.data.metrics["val/acc"] <= 1.0
    assert r.data.metrics["amp/loss_scale"] > 0

    # Params: the whole resolved config, flattened.
    resolved = config.load([*quick, f"tracking.uri={store_uri}", "precision=fp16"])
    # the resolved config, flattened, plus what ran (the world size is a param)
    assert set(r.data.params) == set(config.flatten(resolved)) | {"world_size"}
    assert r.data.params["precision.name"] == "fp16"
    assert r.data.params["precision.dtype"] == "fp16"  # filled in when the mode was resolved
    assert r.data.params["precision.autocast"] == "True"
    assert r.data.params["precision.scaler.enabled"] == "True"
    assert r.data.params["model.name"] == "cnn"
    assert r.data.params["trainer.max_steps"] == "6"

    assert set(r.data.tags) >= TAGS
    assert (r.data.tags["precision"], r.data.tags["model"], r.data.tags["dataset"]) == (
        "fp16",
        "cnn",
        "digits",
    )
    assert r.data.tags["device"] == "cpu"
    assert "error" not in r.data.tags

    names = {a.path for a in client.list_artifacts(r.info.run_id)}
    assert {"config.yaml", "summary.json"} <= names
    got = Path(client.download_artifacts(r.info.run_id, "summary.json", str(tmp_path)))
    summary = json.loads(got.read_text())
    assert summary["val/acc"] == pytest.approx(r.data.metrics["val/acc"])
    assert summary["train/steps"] == 6
    text = Path(client.download_artifacts(r.info.run_id, "config.yaml", str(tmp_path))).read_text()
    assert "name: fp16" in text and "dtype: fp16" in text

    # Artifacts land under outputs/ of the folder the run started in, not ./mlruns.
    exp = client.get_experiment(r.info.experiment_id)
    assert exp.artifact_location.startswith((tmp_path / "outputs" / "mlartifacts").as_uri())
    assert not (tmp_path / "mlruns").exists()


def test_auto_records_the_resolved_mode(store_uri, quick):
    outcome = run(store_uri, quick, "model=mlp")
    r = store.client_for(store_uri).get_run(outcome.run_id)
    assert r.data.params["precision.name"] == "fp32"
    assert r.data.tags["precision"] == "fp32"
    assert r.info.run_name == "fp32-mlp-digits"
    assert "amp/loss_scale" not in r.data.metrics  # no scaler, no scale metric


def test_a_run_too_short_to_time_or_log_says_why_in_mlflow(store_uri, quick):
    outcome = run(store_uri, quick, "model=mlp", "trainer.max_steps=1", "trainer.log_every=5")
    assert outcome.status == "FINISHED"
    blanks = store.client_for(store_uri).get_run(outcome.run_id).data.tags[store.BLANKS]
    assert "no samples/s: too few steps to time (1 trained, the first 1 untimed" in blanks
    assert "set trainer.max_steps above 1" in blanks
    assert "no train/loss curve: no point logged (1 steps, one logged every 5)" in blanks
    assert "trainer.log_every=1" in blanks
    # a run long enough to time and log records no such tag
    full = run(store_uri, quick, "model=mlp")
    tags = store.client_for(store_uri).get_run(full.run_id).data.tags
    assert store.BLANKS not in tags


def test_run_name_override(store_uri, quick):
    outcome = run(store_uri, quick, "model=mlp", "tracking.run_name=mine")
    assert store.client_for(store_uri).get_run(outcome.run_id).info.run_name == "mine"


def test_the_run_records_the_underflow_table_as_artifacts(store_uri, quick):
    outcome = run(store_uri, quick, "precision=fp16", "diagnostics.every=2")
    assert outcome.status == "FINISHED"
    client = store.client_for(store_uri)
    names = [a.path for a in client.list_artifacts(outcome.run_id, "diagnostics")]
    assert "diagnostics/grad_underflow.csv" in names
    history = client.get_metric_history(outcome.run_id, "amp/grad_underflow_frac_scaled")
    assert [m.step for m in history] == [2, 4, 6]


def test_tracking_none_records_nothing(tmp_path, quick):
    outcome = job.run_job(config.load([*quick, "model=mlp", "tracking=none"]))
    assert outcome.status == "FINISHED" and outcome.run_id is None
    # nothing tracked: no store, no artifacts (the end-of-training checkpoint is still written)
    written = (
        {p.name for p in (tmp_path / "outputs").iterdir()}
        if (tmp_path / "outputs").exists()
        else set()
    )
    assert written <= {"checkpoints"}


# ---------------------------------------------------------------- failures


def test_a_failing_run_is_failed_with_its_error_tag(store_uri, quick, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(loop, "fit", broken)
    outcome = run(store_uri, quick, "model=mlp")
    assert outcome.status == "FAILED" and outcome.exit_code == EXIT_FAILED
    r = store.client_for(store_uri).get_run(outcome.run_id)
    assert r.info.status == "FAILED"
    assert r.data.tags["error"] == "RuntimeError: boom second line"  # one line


def test_ctrl_c_ends_the_run_killed(store_uri, quick, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "fit", interrupted)
    command = CommandContext()
    with pytest.raises(KeyboardInterrupt):
        run(store_uri, quick, "model=mlp", command=command)
    (r,) = all_runs(store_uri)
    assert r.info.status == "KILLED"
    assert command.outcomes[-1].status == "KILLED"
    assert command.outcomes[-1].exit_code == EXIT_KILLED


def test_a_config_the_hardware_or_data_refuses_leaves_no_run(tmp_path, store_uri, quick):
    outcome = run(store_uri, quick, "dataset=mnist", f"dataset.root={tmp_path / 'none'}")
    assert outcome.status == "FAILED" and outcome.exit_code == EXIT_CONFIG
    assert "dataset=mnist" in outcome.error
    assert all_runs(store_uri) == []
    outcome = run(store_uri, quick, "precision=tf32")
    assert outcome.exit_code == EXIT_CONFIG and "precision=tf32" in outcome.error
    assert all_runs(store_uri) == []


def test_diverging_lr_stops_failed_and_the_sweep_goes_on(store_uri, quick):
    base = [*quick, "trainer.max_steps=60", f"tracking.uri={store_uri}"]
    bad = job.run_job(
        config.load([*base, "optimizer=sgd", "optimizer.lr=1e6", "trainer.max_nonfinite_steps=4"])
    )
    assert bad.status == "FAILED" and bad.exit_code == EXIT_FAILED
    client = store.client_for(store_uri)
    r = client.get_run(bad.run_id)
    assert r.data.tags["diverged"] == "true"
    assert r.data.tags["error"].startswith("Diverged: loss non-finite for 4 consecutive")
    steps = [m.step for m in client.get_metric_history(bad.run_id, "train/loss")]
    assert steps and max(steps) < 60  # stopped early, with the metrics up to then kept
    good = job.run_job(config.load(base))  # the next job of a sweep runs as usual
    assert good.status == "FINISHED"


# ---------------------------------------------------------------- stop requests


def test_a_callback_stops_a_run_that_resumes_without_it(store_uri, quick, capsys):
    """A callback from the config signals at step 3; the run, stopped with a checkpoint, is
    resumed by a command without the callback: the same run (callbacks are not in the hash)."""
    in_main_thread()
    command = CommandContext()
    with pytest.raises(KeyboardInterrupt):
        run(store_uri, quick, signal_at_step(3, "SIGTERM"), command=command)
    (r,) = all_runs(store_uri)
    assert r.info.status == "KILLED"
    assert r.data.tags["error"].startswith("interrupted (stopped at step 3, checkpoint ")
    assert "SIGTERM: stopping after this step" in capsys.readouterr().err
    assert command.outcomes[-1].exit_code == EXIT_KILLED
    again = run(store_uri, quick, "trainer.resume=auto")
    assert again.status == "FINISHED" and again.run_id == r.info.run_id
    assert store.client_for(store_uri).get_run(r.info.run_id).data.tags["resumed_at_step"] == "3"


def test_sigterm_after_the_last_step_keeps_the_run_finished_and_stops(
    store_uri, quick, monkeypatch, main
):
    """A signal that arrives after the loop's last check (here: during the final evaluation)
    lets the run finish and record, then stops the command with a non-zero exit."""
    in_main_thread()
    real = loop.evaluate

    def evaluate_then_signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", evaluate_then_signalled)
    result = main("train", *quick, "model=mlp", f"tracking.uri={store_uri}")
    assert result.code == EXIT_KILLED
    assert "SIGTERM: stopping after this step" in result.err
    last = result.err.strip().splitlines()[-1]
    assert last == (
        "error: interrupted after fp32-mlp-digits ended FINISHED: nothing is left RUNNING"
    )
    (r,) = all_runs(store_uri)
    assert r.info.status == "FINISHED" and "error" not in r.data.tags
    assert "fp32-mlp-digits finished" in result.out


def test_sigterm_while_the_run_is_recorded_ends_it_killed(store_uri, quick, monkeypatch, main):
    in_main_thread()
    from ampsweep.tracking.recorder import MlflowRecorder

    real = MlflowRecorder.log_json

    def log_json_then_signalled(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # outside the loop: stops at once
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowRecorder, "log_json", log_json_then_signalled)
    result = main("train", *quick, "model=mlp", f"tracking.uri={store_uri}")
    assert result.code == EXIT_KILLED
    (r,) = all_runs(store_uri)
    assert r.info.status == "KILLED" and r.data.tags["error"] == "interrupted (SIGTERM)"


def test_sigterm_while_a_failure_is_recorded_still_ends_the_run_failed(
    store_uri, quick, monkeypatch, main
):
    """A DDP rank whose peer died: its collective fails, and the elastic agent's SIGTERM
    arrives while the failure is being recorded. The run still ends FAILED, then the command
    stops."""
    in_main_thread()
    from ampsweep.tracking.recorder import MlflowRecorder

    def peer_died(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    real = MlflowRecorder.end

    def end_signalled(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loop, "fit", peer_died)
    monkeypatch.setattr(MlflowRecorder, "end", end_signalled)
    result = main("train", *quick, "model=mlp", f"tracking.uri={store_uri}")
    assert result.code == EXIT_KILLED
    (r,) = all_runs(store_uri)
    assert r.info.status == "FAILED"
    assert r.data.tags["error"] == "RuntimeError: Connection closed by peer"


# ---------------------------------------------------------------- secrets and global state


def test_secrets_from_the_environment_are_masked(store_uri, quick, monkeypatch, capsys):
    secret = "s3cr3t-value-42"
    monkeypatch.setenv("MY_API_TOKEN", secret)
    monkeypatch.setenv("DB_PASSWORD", "hunter22")
    cfg = config.load(
        [*quick, f"tracking.uri={store_uri}", "tracking.run_name=run-${oc.env:MY_API_TOKEN}"]
    )
    assert secret in cfg.tracking.run_name  # the config itself holds the value
    out = job.run_job(cfg)
    r = store.client_for(store_uri).get_run(out.run_id)
    everything = {**r.data.params, **r.data.tags}
    assert not [k for k, v in everything.items() if secret in v]
    assert r.data.params["tracking.run_name"] == "run-***"
    assert r.info.run_name == "run-***"
    shown = capsys.readouterr()
    assert secret not in shown.out + shown.err and "run-***" in shown.out  # the console too


def test_each_job_starts_from_clean_global_state(store_uri, quick):
    """Basic launcher: jobs share a process. A job that leaks TF32, RNG state and an active
    MLflow run must not change the next one."""
    import mlflow
    import torch

    from ampsweep.precision import policy as precision

    cfg = config.load(["precision=fp32", f"tracking.uri={store_uri}", *quick])
    first = job.run_job(cfg)
    precision.set_tf32(True)
    torch.manual_seed(1234)
    torch.rand(100)
    mlflow.set_tracking_uri(store_uri)
    try:
        mlflow.start_run()  # a leaked fluent run
        second = job.run_job(cfg)
        assert mlflow.active_run() is None
    finally:
        mlflow.set_tracking_uri(None)
    assert first.status == second.status == "FINISHED"
    assert precision.tf32_enabled() == (False, False)
    assert second.summary["val/loss"] == first.summary["val/loss"]
    assert second.summary["train/steps"] == first.summary["train/steps"]
