"""app/resume.py: a job resumed by run id continues the same run; every resume refusal
(no checkpoint, a FINISHED run, another store, no tracking, another config, an end
checkpoint) is one line that records nothing; a checkpoint holds no secret."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import all_runs, resumable

from ampsweep.config import compose as config
from ampsweep.engine import checkpoint
from ampsweep.runner import job
from ampsweep.runner.context import EXIT_CONFIG
from ampsweep.tracking import store


def test_resume_by_run_id_continues_the_same_run(tmp_path, store_uri):
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=9", "trainer.checkpoint_every=3")]
    args.append(f"tracking.uri={store_uri}")
    first = job.run_job(config.load(args))
    client = store.client_for(store_uri)
    # Pretend it was killed after step 6: drop the end checkpoint, mark it KILLED.
    folder = Path(client.get_run(first.run_id).data.tags["checkpoint_dir"])
    (folder / "step-00000009-end.pt").unlink()
    client.set_terminated(first.run_id, "KILLED")
    again = job.run_job(config.load([*args, f"trainer.resume={first.run_id}"]))
    assert again.status == "FINISHED" and again.run_id == first.run_id
    history = client.get_metric_history(first.run_id, "train/loss")
    steps = [m.step for m in history]
    assert sorted(steps) == [3, 6, 9]  # step 9 was already logged: not logged twice
    r = client.get_run(first.run_id)
    assert r.data.tags["resumed_at_step"] == "6"
    assert [x.info.run_id for x in all_runs(store_uri)] == [first.run_id]  # no second run


@pytest.fixture
def killed_run(tmp_path, store_uri):
    """A recorded run "killed" after step 3 of 6: KILLED, its step-3 checkpoint on disk."""
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=6", "trainer.checkpoint_every=3")]
    args.append(f"tracking.uri={store_uri}")
    first = job.run_job(config.load(args))
    client = store.client_for(store_uri)
    folder = Path(client.get_run(first.run_id).data.tags[store.CHECKPOINT_DIR])
    (folder / "step-00000006-end.pt").unlink()
    client.set_terminated(first.run_id, store.KILLED)
    return args, first.run_id, folder


def refused(args: list[str], capsys) -> str:
    """Run a job that must be refused before it records anything; its one-line error."""
    capsys.readouterr()  # the fixture's own output
    before = {r.info.run_id: r.info.status for r in all_runs(_uri_of(args))}
    outcome = job.run_job(config.load(args))
    assert outcome.status == "FAILED" and outcome.exit_code == EXIT_CONFIG
    after = {r.info.run_id: r.info.status for r in all_runs(_uri_of(args))}
    assert after == before  # no new run, nothing changed, nothing left RUNNING
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return outcome.error


def _uri_of(args: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith("tracking.uri="))


def test_a_run_with_no_checkpoint_is_refused(killed_run, capsys):
    args, run_id, folder = killed_run
    for path in folder.glob("step-*.pt"):
        path.unlink()
    error = refused([*args, f"trainer.resume={run_id}"], capsys)
    assert error.startswith(f"trainer.resume={run_id}: run {run_id} has no checkpoint")


def test_a_finished_run_is_refused(killed_run, store_uri, capsys):
    args, run_id, folder = killed_run
    store.client_for(store_uri).set_terminated(run_id, store.FINISHED)
    error = refused([*args, f"trainer.resume={folder / 'step-00000003.pt'}"], capsys)
    assert f"run {run_id} of {folder / 'step-00000003.pt'} already FINISHED" in error


def test_a_run_in_another_store_is_refused(killed_run, tmp_path, empty_store, capsys):
    args, run_id, folder = killed_run
    other = tmp_path / "other.db"
    other.write_bytes(empty_store.read_bytes())
    args = [a for a in args if not a.startswith("tracking.uri=")]
    args.append(f"tracking.uri=sqlite:///{other}")
    error = refused([*args, f"trainer.resume={folder / 'step-00000003.pt'}"], capsys)
    assert f"belongs to run {run_id}, which is not in the configured store {other}" in error
    error = refused([*args, f"trainer.resume={run_id}"], capsys)
    assert f"no such checkpoint path and no run {run_id} in the configured store" in error


def test_a_run_id_without_tracking_is_refused(killed_run, capsys):
    args, run_id, _ = killed_run
    args = [a for a in args if not a.startswith("tracking.uri=")]
    outcome = job.run_job(config.load([*args, "tracking=none", f"trainer.resume={run_id}"]))
    assert outcome.exit_code == EXIT_CONFIG
    assert "resuming by run id needs tracking=mlflow" in outcome.error


def test_a_checkpoint_of_another_config_is_refused(killed_run, capsys):
    args, run_id, folder = killed_run
    error = refused([*args, "optimizer.lr=0.5", f"trainer.resume={run_id}"], capsys)
    assert "was written by a different config: optimizer.lr=0.001 in the checkpoint" in error


def test_an_explicit_end_checkpoint_is_refused_by_the_job(tmp_path, store_uri, capsys):
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=3"), f"tracking.uri={store_uri}"]
    first = job.run_job(config.load(args))
    folder = Path(store.client_for(store_uri).get_run(first.run_id).data.tags["checkpoint_dir"])
    (end,) = folder.glob("*-end.pt")
    error = refused([*args, f"trainer.resume={end}"], capsys)
    assert f"{end} is the end of run {first.run_id}" in error


def test_a_checkpoint_holds_no_secret(tmp_path, store_uri, monkeypatch):
    secret = "s3cr3t-value-in-ckpt"
    monkeypatch.setenv("MY_API_TOKEN", secret)
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=3"), f"tracking.uri={store_uri}"]
    job.run_job(config.load([*args, "tracking.run_name=run-${oc.env:MY_API_TOKEN}"]))
    (end,) = (tmp_path / "ck").glob("*/*/step-*-end.pt")
    assert secret.encode() not in end.read_bytes()
    assert checkpoint.load(end)["config"]["tracking.run_name"] == "run-***"
