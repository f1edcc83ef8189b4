"""tracking/recorder.py: one run's recorder: batched asynchronous metrics, params and tags
masked, artifacts uploaded with their secrets masked, and a run that is always ended, even
when a background write failed."""

from __future__ import annotations

import json
from pathlib import Path

from ampsweep.config.schema import TrackingConfig
from ampsweep.tracking import journal, store
from ampsweep.tracking.recorder import MlflowRecorder


def recorder(uri: str, **kw) -> MlflowRecorder:
    return MlflowRecorder.start(TrackingConfig(uri=uri, **kw), "r", tags={"t": "1"}, uri=uri)


def failing_metric_writes(rec: MlflowRecorder) -> None:
    real = rec.client.log_batch

    def log_batch(run_id, metrics=(), **kwargs):
        if metrics:
            raise RuntimeError("database is locked")
        return real(run_id, metrics=metrics, **kwargs)

    rec.client.log_batch = log_batch


def test_metrics_are_batched_and_written_at_flush(store_uri):
    rec = recorder(store_uri, metrics_flush_seconds=3600)
    for step in range(1, 6):
        rec.log_metrics({"train/loss": 1.0 / step}, step)
    client = store.client_for(store_uri)
    assert client.get_metric_history(rec.run_id, "train/loss") == []  # still buffered
    rec.end(store.FINISHED)
    history = client.get_metric_history(rec.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / s) for s in range(1, 6)]
    assert client.get_run(rec.run_id).info.status == store.FINISHED


def test_metrics_the_store_refuses_wait_in_the_journal_and_the_run_still_ends(store_uri, tmp_path):
    rec = recorder(store_uri, metrics_flush_every=1)
    path = tmp_path / "run" / journal.NAME
    rec.keep_journal(path)
    real = rec.client.log_batch
    failing_metric_writes(rec)
    rec.log_metrics({"train/loss": 1.0}, 1)  # its write fails on the writer thread
    rec.flush()  # the store is down: training goes on, nothing raised
    assert rec.down and "stayed locked by another process" in rec.down
    rec.log_metrics({"train/loss": 0.5}, 2)
    rec.end(store.FINISHED)
    assert rec.unsent == 3  # two metric batches and the end
    client = store.client_for(store_uri)
    run = client.get_run(rec.run_id)
    assert run.info.status == store.FAILED  # ended ahead of what waits, not left RUNNING
    assert run.data.tags[store.ERROR].startswith(f"3 records wait in {path}")
    rec.client.log_batch = real  # the store answers again
    run_id, n = journal.replay(path, client)
    assert (run_id, n) == (rec.run_id, 3) and not path.exists()
    run = client.get_run(rec.run_id)
    assert run.info.status == store.FINISHED and store.ERROR not in run.data.tags
    history = client.get_metric_history(rec.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5)]


def test_a_job_whose_metrics_cannot_be_written_fails_and_ends_its_run(
    store_uri, quick, monkeypatch
):
    from ampsweep.config import compose as config
    from ampsweep.runner import job
    from ampsweep.runner.context import EXIT_FAILED

    real_start = MlflowRecorder.start

    def start(*args, **kwargs):
        rec = real_start(*args, **kwargs)
        failing_metric_writes(rec)
        return rec

    monkeypatch.setattr(MlflowRecorder, "start", start)
    outcome = job.run_job(config.load([*quick, f"tracking.uri={store_uri}", "model=mlp"]))
    assert outcome.status == store.FAILED and outcome.exit_code == EXIT_FAILED
    run = store.client_for(store_uri).get_run(outcome.run_id)
    assert run.info.status == store.FAILED
    assert "stayed locked by another process" in run.data.tags[store.ERROR]
    assert "`ampsweep repair` writes them" in run.data.tags[store.ERROR]


def test_a_resumed_run_does_not_log_a_step_twice(store_uri):
    rec = recorder(store_uri)
    rec.log_metrics({"train/loss": 3.0}, 3)
    rec.log_metrics({"train/loss": 6.0}, 6)  # logged after the checkpoint at step 3
    rec.end(store.KILLED)
    again = MlflowRecorder.attach(store_uri, rec.run_id, after_step=3)
    assert store.client_for(store_uri).get_run(rec.run_id).info.status == store.RUNNING
    again.log_metrics({"train/loss": 6.5}, 6)  # the resumed run reaches step 6 again
    again.log_metrics({"train/loss": 9.0}, 9)
    again.end(store.FINISHED)
    history = store.client_for(store_uri).get_metric_history(rec.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(3, 3.0), (6, 6.0), (9, 9.0)]


def test_params_tags_and_artifacts_are_masked(store_uri, tmp_path, monkeypatch):
    secret = "s3cr3t-for-the-recorder"
    monkeypatch.setenv("MY_API_TOKEN", secret)
    rec = recorder(store_uri)
    rec.log_params({"tracking.run_name": f"run-{secret}"})
    rec.set_tags({"overrides": f"tracking.run_name=run-{secret}"})
    hydra = tmp_path / ".hydra"
    hydra.mkdir()
    (hydra / "overrides.yaml").write_text(f"- tracking.run_name=run-{secret}\n")
    rec.log_artifact(hydra, ".hydra")
    rec.log_json({"name": f"run-{secret}"}, "summary.json")
    rec.end(store.FINISHED)
    client = store.client_for(store_uri)
    run = client.get_run(rec.run_id)
    assert run.data.params["tracking.run_name"] == "run-***"
    assert run.data.tags["overrides"] == "tracking.run_name=run-***"
    got = Path(client.download_artifacts(rec.run_id, ".hydra/overrides.yaml", str(tmp_path / "d")))
    assert got.read_text() == "- tracking.run_name=run-***\n"
    summary = client.download_artifacts(rec.run_id, "summary.json", str(tmp_path / "d"))
    assert json.loads(Path(summary).read_text()) == {"name": "run-***"}
    assert secret in (hydra / "overrides.yaml").read_text()  # the local file is left as it was
