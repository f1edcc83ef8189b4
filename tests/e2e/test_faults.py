"""Faults a shared machine really has, through the ``ampsweep`` command: a store that is
locked mid-run (nothing lost, the run not left RUNNING), a damaged newest checkpoint (never
resumed: the newest good one is), a full disk during a checkpoint, a store that is not a
database, read-only or locked (one line each), and two identical sweeps launched together
(never one run trained by both)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import torch
from callbacks import signal_at_step
from conftest import all_runs, callback_env, resumable, run_cli, start_cli
from unit.engine.test_checkpoint_verify import damage

from ampsweep.config import compose as config
from ampsweep.runner import job
from ampsweep.runner.context import EXIT_FAILED
from ampsweep.tracking import journal, store


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def same_history(client, run, reference_id: str) -> None:
    for key in ("train/loss", "val/acc", "val/loss", "amp/skipped_steps"):
        assert history(client, run.info.run_id, key) == history(client, reference_id, key), key


def one_line_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def locked_store(db: Path, when: str) -> str:
    """The override that locks the store ``db`` from inside the run (fault_callbacks)."""
    return f"trainer.callbacks=[{{_target_: fault_callbacks.LockStore, db: {db}, {when}}}]"


def wait_unlocked(db: Path) -> None:
    c = sqlite3.connect(db, timeout=120, isolation_level=None)
    c.execute("BEGIN IMMEDIATE")
    c.execute("ROLLBACK")
    c.close()


# ---------------------------------------------------------------- a store outage


@pytest.mark.slow
def test_a_store_locked_mid_run_loses_nothing(tmp_path, store_uri):
    db = store.sqlite_path(store_uri)
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=24", "trainer.checkpoint_every=6"),
            f"tracking.uri={store_uri}", "tracking.metrics_flush_every=1"]  # fmt: skip
    outage = (
        f"trainer.callbacks=[{{_target_: fault_callbacks.LockStore, db: {db}, start: 4, end: 16}}]"
    )
    proc = run_cli(["train", *args, outage], tmp_path, env=callback_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = one_line_error(proc.stderr)
    assert f"the MLflow store {db} stayed locked by another process" in line
    assert "training goes on, its records wait in" in line
    (run,) = all_runs(store_uri)
    assert run.info.status == store.FINISHED
    folder = Path(run.data.tags[store.CHECKPOINT_DIR])
    assert not (folder / journal.NAME).exists()  # written, then removed
    reference = job.run_job(config.load([*args, "tracking.experiment=reference"]))
    same_history(store.client_for(store_uri), run, reference.run_id)


@pytest.mark.slow
def test_stop_on_store_failure_then_repair_ends_the_run_and_a_new_run_is_refused(
    tmp_path, store_uri, main
):
    """A store that stays locked by another process: a run with on_store_failure=stop stops
    with a checkpoint and its records wait for ``ampsweep repair``; a train command started
    while it is locked fails in one line and records nothing. (The two share the outage:
    SQLite waits 20 s, MLflow's busy timeout, before each write fails.)"""
    db = store.sqlite_path(store_uri)
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=40", "trainer.checkpoint_every=5"),
            f"tracking.uri={store_uri}", "tracking.metrics_flush_every=1",
            "tracking.on_store_failure=stop"]  # fmt: skip
    # locked from step 3 until the test lets go (both commands have ended by then)
    outage = locked_store(db, "start: 3, hold: 120")
    try:
        proc = start_cli(["train", *args, outage], tmp_path, env=callback_env())
        locked = db.with_suffix(".locked")
        while not locked.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        new = main("train", "trainer.max_steps=1", f"tracking.uri={store_uri}")
        out, err = proc.communicate(timeout=600)
    finally:
        db.with_suffix(".unlock").write_text("go")
    assert new.code == 1
    assert one_line_error(new.err).startswith(
        f"error: the MLflow store {db} stayed locked by another process"
    )
    assert proc.returncode == EXIT_FAILED, err[-3000:]
    assert "Traceback" not in err
    assert "stopping after this step, with a checkpoint (tracking.on_store_failure=stop)" in err
    assert "is still down" in err and "`ampsweep repair` writes them" in err
    (left,) = list((tmp_path / "ck").glob(f"*/*/{journal.NAME}"))
    assert list(left.parent.glob("step-*.pt"))  # the checkpoint it stopped with
    wait_unlocked(db)
    repair = ["repair", "--tracking-uri", store_uri, "--checkpoint-dir", str(tmp_path / "ck")]
    repaired = main(*repair)
    assert repaired.code == 0, repaired.err
    assert f"that waited in {left}" in repaired.out.replace("\n", "")
    (run,) = all_runs(store_uri)  # the refused command recorded nothing
    assert run.info.status == store.KILLED  # its end, from the journal
    assert "the MLflow store failed" in run.data.tags[store.ERROR]
    assert not left.exists()
    assert "nothing to repair" in main(*repair).out


@pytest.mark.slow
def test_repair_ends_a_run_whose_process_was_killed(tmp_path, store_uri, main):
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=20", "trainer.checkpoint_every=4"),
            f"tracking.uri={store_uri}"]  # fmt: skip
    killed = run_cli(["train", *args, signal_at_step(6, "SIGKILL")], tmp_path, callback_env())
    assert killed.returncode == -9
    (run,) = all_runs(store_uri)
    assert run.info.status == store.RUNNING
    repaired = main("repair", "--tracking-uri", store_uri)
    assert repaired.code == 0, repaired.err
    (run,) = all_runs(store_uri)
    assert run.info.status == store.KILLED
    assert "ended without ending the run: ended by ampsweep repair" in run.data.tags["error"]


# ---------------------------------------------------------------- checkpoints


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_never_resumed(tmp_path, store_uri, main):
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=24", "trainer.checkpoint_every=4"),
            f"tracking.uri={store_uri}"]  # fmt: skip
    killed = run_cli(["train", *args, signal_at_step(14, "SIGKILL")], tmp_path, callback_env())
    assert killed.returncode == -9
    older, newest = sorted((tmp_path / "ck").glob("*/*/step-*.pt"))
    size = newest.stat().st_size
    damage(newest)  # 256 bytes of the first weight tensor, the size unchanged
    assert newest.stat().st_size == size
    resumed = main("train", *args, "trainer.resume=auto")
    assert resumed.code == 0, resumed.err[-3000:]
    out = " ".join((resumed.out + resumed.err).split())
    assert f"{newest} is damaged: its contents no longer match its digest" in out
    assert f"resuming from {older}" in out
    (run,) = all_runs(store_uri)
    assert run.info.status == store.FINISHED and run.data.tags["resumed_at_step"] == "8"
    reference = job.run_job(config.load([*args, "tracking.experiment=reference"]))
    same_history(store.client_for(store_uri), run, reference.run_id)


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line(tmp_path, store_uri, main, monkeypatch):
    # DiskFull replaces torch.save in the process it runs in, this one: put it back after
    monkeypatch.setattr(torch, "save", torch.save)
    args = [*resumable(tmp_path / "ck", "trainer.max_steps=12", "trainer.checkpoint_every=4"),
            f"tracking.uri={store_uri}",
            "trainer.callbacks=[{_target_: fault_callbacks.DiskFull, step: 8}]"]  # fmt: skip
    res = main("train", *args)
    assert res.code == EXIT_FAILED
    line = one_line_error(res.err)
    assert line.startswith("error: no space left on /") and " for the checkpoint of " in line
    assert line.endswith(" MiB: free space or set trainer.checkpoint_dir")
    assert not list((tmp_path / "ck").rglob("*.tmp"))
    (run,) = all_runs(store_uri)
    assert run.info.status == store.FAILED
    assert run.data.tags["error"] == line.removeprefix("error: ")


# ---------------------------------------------------------------- the store, one line each


def test_a_store_that_is_not_a_database_is_one_line(tmp_path, main):
    bad = tmp_path / "notes.db"
    bad.write_text("my notes, not a database\n")
    uri = f"sqlite:///{bad}"
    train = main("train", "trainer.max_steps=1", f"tracking.uri={uri}")
    assert train.code == 2
    line = one_line_error(train.err)
    assert line == (
        f"error: tracking.uri={uri}: {bad} is not an MLflow store (not a SQLite database): "
        "point tracking.uri at another file, or move this one away"
    )
    report = main("report", "--tracking-uri", uri)
    assert report.code == 2
    assert f"{bad} is not an MLflow store" in one_line_error(report.err)
    assert bad.read_text() == "my notes, not a database\n"  # left as it was


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder nobody may write to: by its mode, or for root (whom modes do not stop) by
    the immutable attribute, where the file system has it."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("root, and no immutable attribute here: nothing denies a write")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_store_in_a_read_only_folder_is_one_line(read_only_folder, main):
    uri = f"sqlite:///{read_only_folder / 'mlflow.db'}"
    res = main("train", "trainer.max_steps=1", f"tracking.uri={uri}")
    assert res.code == 2
    assert one_line_error(res.err) == (
        f"error: tracking.uri={uri}: the MLflow store's folder {read_only_folder} is not "
        "writable: fix its permissions, or set tracking.uri to a store in a writable folder"
    )


# ---------------------------------------------------------------- one owner per run


@pytest.mark.slow
def test_two_identical_sweeps_launched_together_never_share_a_run(tmp_path, store_uri):
    args = ["train", "-m", "precision=fp32,bf16", *resumable(tmp_path / "ck"),
            "trainer.max_steps=20", "trainer.checkpoint_every=5", "tracking.log_model=true",
            f"tracking.uri={store_uri}"]  # fmt: skip
    client = store.client_for(store_uri)
    # Both commands forked warm at once, from two threads (run_cli waits for its command).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(2):  # the race showed in every try before runs had one owner
            for proc in pool.map(lambda _: run_cli(args, tmp_path), range(2)):
                assert proc.returncode == 0, proc.stderr[-3000:]
                assert "recorded no run" not in proc.stderr
    runs = all_runs(store_uri)
    parents = [r for r in runs if r.data.tags.get(store.SWEEP) == "true"]
    assert len({p.data.tags[store.SWEEP_DIR] for p in parents}) == len(parents) == 4
    children = [r for r in runs if r.data.tags.get(store.SWEEP) != "true"]
    exps = list({r.info.experiment_id for r in runs})
    models = client.search_logged_models(exps, max_results=1000)
    for run in children:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
        assert len(steps) == len(set(steps)), (run.info.run_id, steps)  # trained once
        assert run.info.status == store.FINISHED
        mine = [m for m in models if m.source_run_id == run.info.run_id]
        assert len(mine) == 1, run.info.run_id


def test_the_next_train_command_writes_a_journal_left_behind(tmp_path, store_uri, main, quick):
    client = store.client_for(store_uri)
    exp = store.get_or_create_experiment(client, "earlier", None)
    run_id = client.create_run(exp).info.run_id  # RUNNING: its process died with the store down
    folder = tmp_path / "ck" / "somehash" / run_id
    left = journal.Journal(folder / journal.NAME, store_uri, run_id)
    left.append({"op": "metrics", "items": [["train/loss", 0.5, 1000, 3]]})
    left.append({"op": "tags", "items": [["note", "kept"]]})
    left.append({"op": "end", "status": store.KILLED, "error": "interrupted", "time": 2000})
    left._file.close()  # noqa: SLF001 - the process died: nothing acknowledged, nothing removed
    ran = main(
        "train", *quick, f"tracking.uri={store_uri}", f"trainer.checkpoint_dir={tmp_path / 'ck'}"
    )
    assert ran.code == 0, ran.err
    assert f"wrote 3 records of run {run_id} that waited in {folder / journal.NAME}" in " ".join(
        (ran.out + ran.err).split()
    )
    run = client.get_run(run_id)
    assert run.info.status == store.KILLED and run.data.tags["note"] == "kept"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [
        (3, 0.5)
    ]
    assert not (folder / journal.NAME).exists()


def test_sweeps_of_the_same_second_claim_distinct_folders(tmp_path):
    from ampsweep.launch.sweep import claim_dir

    planned = tmp_path / "multirun" / "2026-12-01" / "12-00-00"
    claimed = [claim_dir(planned) for _ in range(3)]
    assert claimed == [planned, planned.with_name("12-00-00-2"), planned.with_name("12-00-00-3")]
    assert all(p.is_dir() for p in claimed)


@pytest.mark.slow
def test_a_tracking_server_down_mid_run_loses_nothing(tmp_path):
    """The server killed at step 4 and back at step 14 (MLflow's retries off, so the outage
    outlasts them at once): the run trains on, its records wait in the journal, and at the end
    the store has the same history as an uninterrupted run's, FINISHED. A run into a server
    never imports MLflow's database store (only the server uses it)."""
    import json
    import signal
    import sys

    from conftest import free_port

    from ampsweep.cli import ui

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
           "--serve-artifacts", "--artifacts-destination", str(tmp_path / "artifacts")]  # fmt: skip
    pidfile, cmdfile = tmp_path / "server.pid", tmp_path / "server.json"
    cmdfile.write_text(json.dumps(cmd))
    log = tmp_path / "server.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=ui.server_env(), start_new_session=True)  # fmt: skip
    pidfile.write_text(str(proc.pid))
    try:
        ui.wait_until_up(url, proc, 120, log)
        args = [*resumable(tmp_path / "ck", "trainer.max_steps=24", "trainer.checkpoint_every=6"),
                f"tracking.uri={url}", "tracking.metrics_flush_every=1"]  # fmt: skip
        imported = tmp_path / "imports.jsonl"
        outage = (
            f"trainer.callbacks=[{{_target_: fault_callbacks.ServerOutage, pidfile: {pidfile}, "
            f"cmdfile: {cmdfile}, url: '{url}', start: 4, end: 14}}, {{_target_: "
            f"callbacks.RecordImports, path: '{imported}', modules: [sqlalchemy, alembic]}}]"
        )
        env = {**callback_env(), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}  # fmt: skip
        # A process of its own: what it imports is part of what the test checks.
        run = run_cli(["train", *args, outage], tmp_path, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Traceback" not in run.stderr
        assert "training goes on, its records wait in" in run.stderr, run.stderr[-3000:]
        assert json.loads(imported.read_text()) == {"rank": 0, "sqlalchemy": False,
                                                     "alembic": False}  # fmt: skip
        (recorded,) = all_runs(url)
        assert recorded.info.status == store.FINISHED
        folder = Path(recorded.data.tags[store.CHECKPOINT_DIR])
        assert not (folder / journal.NAME).exists()  # written, then removed
        reference = job.run_job(config.load([*args, "tracking.experiment=reference"]))
        same_history(store.client_for(url), recorded, reference.run_id)
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pidfile.read_text()), signal.SIGKILL)
