"""tracking.py and runner.py: what one run leaves in a temporary SQLite MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampsweep.app import job as runner
from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError
from ampsweep.engine import loop
from ampsweep.tracking import store as mlflow_store

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


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run from a temporary folder (outputs/ lands there) with no store from the environment."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path


def run(store: str, quick: list[str], *overrides: str, command=None) -> runner.JobOutcome:
    cfg = config.load([*quick, f"tracking.uri={store}", *overrides])
    return runner.run_job(cfg, command=command)


def all_runs(store: str):
    client = mlflow_store.client_for(store)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


def test_a_run_records_every_metric_param_tag_and_artifact(in_tmp, store, quick):
    outcome = run(store, quick, "precision=fp16")
    assert outcome.status == "FINISHED" and outcome.exit_code == 0
    client = mlflow_store.client_for(store)
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
    resolved = config.load([*quick, f"tracking.uri={store}", "precision=fp16"])
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
    got = Path(client.download_artifacts(r.info.run_id, "summary.json", str(in_tmp)))
    summary = json.loads(got.read_text())
    assert summary["val/acc"] == pytest.approx(r.data.metrics["val/acc"])
    assert summary["train/steps"] == 6
    text = Path(client.download_artifacts(r.info.run_id, "config.yaml", str(in_tmp))).read_text()
    assert "name: fp16" in text and "dtype: fp16" in text

    # Artifacts land under outputs/ of the folder the run started in, not ./mlruns.
    exp = client.get_experiment(r.info.experiment_id)
    assert exp.artifact_location.startswith((in_tmp / "outputs" / "mlartifacts").as_uri())
    assert not (in_tmp / "mlruns").exists()


def test_auto_records_the_resolved_mode(in_tmp, store, quick):
    outcome = run(store, quick, "model=mlp")
    r = mlflow_store.client_for(store).get_run(outcome.run_id)
    assert r.data.params["precision.name"] == "fp32"
    assert r.data.tags["precision"] == "fp32"
    assert r.info.run_name == "fp32-mlp-digits"
    assert "amp/loss_scale" not in r.data.metrics  # no scaler, no scale metric


def test_run_name_override(in_tmp, store, quick):
    outcome = run(store, quick, "model=mlp", "tracking.run_name=mine")
    assert mlflow_store.client_for(store).get_run(outcome.run_id).info.run_name == "mine"


def test_a_failing_run_is_failed_with_its_error_tag(in_tmp, store, quick, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(loop, "fit", broken)
    outcome = run(store, quick, "model=mlp")
    assert outcome.status == "FAILED" and outcome.exit_code == runner.EXIT_FAILED
    r = mlflow_store.client_for(store).get_run(outcome.run_id)
    assert r.info.status == "FAILED"
    assert r.data.tags["error"] == "RuntimeError: boom second line"  # one line


def test_ctrl_c_ends_the_run_killed(in_tmp, store, quick, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "fit", interrupted)
    command = runner.CommandContext()
    with pytest.raises(KeyboardInterrupt):
        run(store, quick, "model=mlp", command=command)
    (r,) = all_runs(store)
    assert r.info.status == "KILLED"
    assert command.outcomes[-1].status == "KILLED"
    assert command.outcomes[-1].exit_code == runner.EXIT_KILLED


def test_a_config_the_hardware_or_data_refuses_leaves_no_run(in_tmp, store, quick):
    outcome = run(store, quick, "dataset=mnist", f"dataset.root={in_tmp / 'none'}")
    assert outcome.status == "FAILED" and outcome.exit_code == runner.EXIT_CONFIG
    assert "dataset=mnist" in outcome.error
    assert all_runs(store) == []
    outcome = run(store, quick, "precision=tf32")
    assert outcome.exit_code == runner.EXIT_CONFIG and "precision=tf32" in outcome.error
    assert all_runs(store) == []


def test_tracking_none_records_nothing(in_tmp, quick):
    outcome = runner.run_job(config.load([*quick, "model=mlp", "tracking=none"]))
    assert outcome.status == "FINISHED" and outcome.run_id is None
    # nothing tracked: no store, no artifacts (the end-of-training checkpoint is still written)
    written = (
        {p.name for p in (in_tmp / "outputs").iterdir()} if (in_tmp / "outputs").exists() else set()
    )
    assert written <= {"checkpoints"}


def test_resolve_uri(in_tmp, monkeypatch):
    assert mlflow_store.resolve_uri(None) == f"sqlite:///{in_tmp.resolve()}/outputs/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////somewhere/else.db")
    assert mlflow_store.resolve_uri(None) == "sqlite:////somewhere/else.db"
    assert mlflow_store.resolve_uri("sqlite:////given.db") == "sqlite:////given.db"  # the key wins


def test_default_store_folder_is_created(in_tmp):
    mlflow_store.check(mlflow_store.resolve_uri(None))
    assert (in_tmp / "outputs").is_dir()


@pytest.mark.parametrize(
    "uri,words",
    [
        ("sqlite:////no/such/folder/mlflow.db", "does not exist"),
        ("file:///tmp/mlruns", "plain-folder stores"),
        ("just/a/folder", "plain-folder stores"),
        ("http://127.0.0.1:9/", "does not answer"),  # the discard port: nothing listens
    ],
)
def test_check_store_errors(uri, words):
    with pytest.raises(ConfigError) as info:
        mlflow_store.check(uri)
    message = str(info.value)
    assert message.startswith(f"tracking.uri={uri}: ") and words in message
    assert "\n" not in message


def test_one_line():
    assert mlflow_store.one_line(ValueError("a\n  b")) == "ValueError: a b"
    assert mlflow_store.one_line(ConfigError("x=1: fix")) == "x=1: fix"
    assert mlflow_store.one_line(KeyError()) == "KeyError: KeyError"
