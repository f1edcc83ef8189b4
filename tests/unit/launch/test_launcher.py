"""app/launcher.py: waiting for every job of a SLURM sweep. Jobs and squeue's answers are
scripted here (with a clock that advances by itself) so each way a job can end is shown in a
second; the real cluster runs the same code in tests/e2e/test_slurm.py. Lost jobs end their runs
in a real (SQLite) MLflow store."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import cli_env
from hydra.core.utils import JobReturn, JobStatus
from mlflow import MlflowClient
from submitit.core.utils import FailedJobError

from ampsweep.launch import launcher, slurm
from ampsweep.runner.context import JobOutcome
from ampsweep.tracking import store as names
from ampsweep.tracking.sweep import SweepInfo


class FakeJob:
    """What the launcher uses of a submitit Job."""

    def __init__(self, job_id: str, folder: Path):
        self.job_id = job_id
        self.paths = type("Paths", (), {})()
        self.paths.result_pickle = folder / f"{job_id}_result.pkl"
        self.paths.stderr = folder / f"{job_id}_log.err"

    def task(self, i):
        return self

    def finish(self, value, status=JobStatus.COMPLETED) -> None:
        """What submitit's job writes: the JobReturn of Hydra's run_job."""
        ret = JobReturn(status=status)
        ret.return_value = value
        self.paths.result_pickle.write_bytes(pickle.dumps(ret))

    def crash(self, trace: str) -> None:
        """What submitit's job writes when it raised outside the task function."""
        self.paths.result_pickle.write_bytes(pickle.dumps(("error", trace)))

    def result(self):
        value = pickle.loads(self.paths.result_pickle.read_bytes())
        if isinstance(value, tuple):  # as submitit's Job.result raises it
            raise FailedJobError(f"Job failed during processing with trace:\n-----\n{value[1]}")
        return value


class Script:
    """A clock that moves one second per sleep, squeue's answers per second, and events."""

    def __init__(self, states, events=None):
        self.now, self.states, self.events = 0.0, states, events or {}
        self.queries = 0

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        for at in [t for t in self.events if t <= self.now]:
            self.events.pop(at)()

    def job_states(self, ids):
        self.queries += 1
        return {j: self.states(j, self.now) for j in ids}


@pytest.fixture
def sweep(store, tmp_path):
    """A sweep's parent run and a RUNNING child per SLURM job 7_0 and 7_1."""
    client = MlflowClient(store)
    exp = client.create_experiment("s", artifact_location=str(tmp_path / "art"))
    parent = client.create_run(exp, run_name="sweep", tags={names.SWEEP: "true"})
    pid = parent.info.run_id
    for job in ("7_0", "7_1"):
        client.create_run(exp, run_name=f"run-{job}",
                          tags={names.PARENT: pid, names.CLUSTER_JOB: job})  # fmt: skip
    return SweepInfo(pid, store, "s", str(tmp_path), "sweep"), client


def _track(tmp_path, *ids, ampsweep_job=True):
    return [
        launcher.Tracked(i, [f"precision=p{i}"], FakeJob(j, tmp_path), ampsweep_job)
        for i, j in enumerate(ids)
    ]


def _run_of(client, info, job):
    return names.run_of_cluster_job(client, client.get_run(info.parent_run_id), job)


def test_returned_and_cancelled_jobs_are_both_waited_for(sweep, tmp_path, monkeypatch, capsys):
    info, client = sweep
    a, b = _track(tmp_path, "7_0", "7_1")
    done = JobOutcome("run-7_0", names.FINISHED, "id0")
    # 7_1 is cancelled at 5 s and never writes a result; 7_0 returns at 30 s.
    script = Script(
        lambda j, t: "CANCELLED" if j == "7_1" and t >= 5 else "RUNNING",
        {30: lambda: a.job.finish(done)},
    )
    monkeypatch.setattr(slurm, "job_states", script.job_states)
    launcher.wait([a, b], info, script.clock, script.sleep)
    assert a.outcome == done and a.returned.return_value == done
    assert b.outcome.status == names.KILLED and b.outcome.job_num == 1
    assert b.outcome.error.startswith("SLURM job 7_1 ended CANCELLED without a result (log: ")
    assert b.returned.status == JobStatus.COMPLETED  # Hydra raises nothing: the sweep goes on
    run = _run_of(client, info, "7_1")
    assert (run.info.status, b.outcome.run_id) == (names.KILLED, run.info.run_id)
    assert run.data.tags[names.ERROR] == b.outcome.error
    assert run.data.tags[names.ENDED_BY] == "the sweep's launcher"
    assert _run_of(client, info, "7_0").info.status == names.RUNNING  # not the launcher's job
    err = capsys.readouterr().err
    assert "#1 (SLURM job 7_1) ended CANCELLED without a result: its run" in err
    assert script.now < 30 + 2  # no time wasted after the last result


def test_a_run_the_job_ended_itself_keeps_its_status_and_reason(sweep, tmp_path, monkeypatch):
    info, client = sweep
    run = _run_of(client, info, "7_0")
    client.set_tag(run.info.run_id, names.ERROR, "interrupted (stopped at step 8, checkpoint c)")
    client.set_terminated(run.info.run_id, status=names.KILLED)
    (t,) = _track(tmp_path, "7_0")
    script = Script(lambda j, now: "CANCELLED")
    monkeypatch.setattr(slurm, "job_states", script.job_states)
    launcher.wait([t], info, script.clock, script.sleep)
    assert (t.outcome.status, t.outcome.run_id) == (names.KILLED, run.info.run_id)
    assert t.outcome.error == "interrupted (stopped at step 8, checkpoint c)"
    assert names.ENDED_BY not in _run_of(client, info, "7_0").data.tags


def test_a_job_whose_result_shows_up_late_is_not_lost(sweep, tmp_path, monkeypatch):
    """SLURM says COMPLETED before a shared file system shows the result file."""
    info, client = sweep
    (t,) = _track(tmp_path, "7_0")
    done = JobOutcome("run-7_0", names.FINISHED, "id0")
    script = Script(
        lambda j, now: "COMPLETED" if now >= 3 else "RUNNING",
        {3 + launcher.RESULT_GRACE_S - 2: lambda: t.job.finish(done)},
    )
    monkeypatch.setattr(slurm, "job_states", script.job_states)
    launcher.wait([t], info, script.clock, script.sleep)
    assert t.outcome == done
    assert _run_of(client, info, "7_0").info.status == names.RUNNING


def test_a_requeued_job_is_waited_for_and_said_to_be_requeued(sweep, tmp_path, monkeypatch, capsys):
    info, _ = sweep
    (t,) = _track(tmp_path, "7_0")
    done = JobOutcome("run-7_0", names.FINISHED, "id0")

    def states(job, now):  # preempted at 10 s, pending until 20 s, running again
        return "RUNNING" if now < 10 or now >= 20 else ("REQUEUED" if now < 12 else "PENDING")

    script = Script(states, {40: lambda: t.job.finish(done)})
    monkeypatch.setattr(slurm, "job_states", script.job_states)
    launcher.wait([t], info, script.clock, script.sleep)
    out = capsys.readouterr().out
    assert "#0 (SLURM job 7_0): running" in out
    assert "#0 (SLURM job 7_0): requeued, to resume from its checkpoint" in out
    assert "#0 (SLURM job 7_0): running again" in out
    assert "#0 (SLURM job 7_0): run-7_0 FINISHED" in out
    assert t.outcome == done


def test_a_job_gone_from_the_queue_fails_and_a_silent_controller_is_asked_again(
    sweep, tmp_path, monkeypatch, capsys
):
    info, client = sweep
    (t,) = _track(tmp_path, "7_1")
    script = Script(lambda j, now: slurm.GONE)
    silent = {"left": 3}

    def job_states(ids):
        if silent["left"]:
            silent["left"] -= 1
            raise slurm.SlurmError("squeue: error: Unable to contact slurm controller")
        return script.job_states(ids)

    monkeypatch.setattr(slurm, "job_states", job_states)
    launcher.wait([t], info, script.clock, script.sleep)
    assert t.outcome.status == names.FAILED
    assert "is no longer in SLURM's queue and left no result" in t.outcome.error
    assert _run_of(client, info, "7_1").info.status == names.FAILED
    assert capsys.readouterr().err.count("could not ask SLURM about the sweep's jobs") == 3


def test_a_job_that_raised_outside_its_task_function_fails_and_the_sweep_goes_on(
    tmp_path, monkeypatch, capsys
):
    (t,) = _track(tmp_path, "9_0")
    t.job.crash("Traceback ...\nsubmitit.core.utils.UncompletedJobError: Job not requeued")
    monkeypatch.setattr(slurm, "job_states", Script(lambda j, now: "FAILED").job_states)
    launcher.wait([t], None, lambda: 0.0, lambda s: None)
    why = "SLURM job 9_0 failed: submitit.core.utils.UncompletedJobError: Job not requeued"
    assert (t.outcome.status, t.outcome.error) == (names.FAILED, why)
    assert t.returned.status == JobStatus.COMPLETED and t.returned.return_value == t.outcome
    assert f"#0 (SLURM job 9_0): {why}" in capsys.readouterr().err


def test_a_job_of_another_hydra_app_comes_back_as_it_returned(tmp_path, monkeypatch, capsys):
    # The launcher runs any Hydra app's task function: its JobReturn goes back to Hydra as the
    # job wrote it (a failed one's error is Hydra's sweeper's to raise), with no outcome.
    a, b = _track(tmp_path, "8_0", "8_1", ampsweep_job=False)
    a.job.finish(100)
    b.job.finish(KeyError("boo"), JobStatus.FAILED)
    script = Script(lambda j, now: "COMPLETED")
    monkeypatch.setattr(slurm, "job_states", script.job_states)
    launcher.wait([a, b], None, script.clock, script.sleep)
    assert a.returned.return_value == 100 and a.outcome is None
    assert b.returned.status == JobStatus.FAILED and b.outcome is None
    with pytest.raises(KeyError, match="boo"):
        b.returned.return_value  # noqa: B018 - Hydra's sweeper reads it so
    out = capsys.readouterr().out
    assert "#0 (SLURM job 8_0): returned" in out
    assert "#1 (SLURM job 8_1): its task function raised" in out


def test_a_job_cancelled_before_it_started_recorded_no_run(tmp_path, monkeypatch, capsys):
    (t,) = _track(tmp_path, "9_0")
    script = Script(lambda j, now: "CANCELLED")
    monkeypatch.setattr(slurm, "job_states", script.job_states)
    launcher.wait([t], None, script.clock, script.sleep)  # None: a sweep with tracking=none
    assert (t.outcome.status, t.outcome.run_id, t.outcome.name) == (names.KILLED, None, "job 0")
    assert "it recorded no run" in capsys.readouterr().err


def test_squeue_is_asked_less_often_as_the_wait_grows(tmp_path, monkeypatch):
    (t,) = _track(tmp_path, "7_0")
    script = Script(
        lambda j, now: "RUNNING", {600: lambda: t.job.finish(JobOutcome("x", "FINISHED"))}
    )
    monkeypatch.setattr(slurm, "job_states", script.job_states)
    launcher.wait([t], None, script.clock, script.sleep)
    assert 20 <= script.queries <= 60  # not 600: every 2 s at first, at most every 30 s later


HELP_THEN_SWEEP = """
import sys
from ampsweep.cli import main as cli
assert cli.main(["train", "--help"]) == 0
sys.exit(cli.main(["train", "-m", "precision=fp32,bf16", *sys.argv[1:]]))
"""


def test_a_sweep_after_train_help_in_one_process_starts_its_sweeper(tmp_path):
    # A new process, where Hydra has not scanned for plugins yet: `train --help` is the first
    # to register ampsweep's sweeper (the scan runs Hydra's own plugin modules again). As
    # installed, not from PYTHONPATH.
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}
    args = ["model=mlp", "trainer.max_steps=2", "trainer.epochs=1", "tracking=none"]
    proc = subprocess.run([sys.executable, "-c", HELP_THEN_SWEEP, *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp32-mlp-digits" in proc.stdout and "bf16-mlp-digits" in proc.stdout


def test_another_apps_job_that_left_no_return_fails_its_sweep(tmp_path, monkeypatch, capsys):
    # As with Hydra's own launcher: its sweeper raises the job's error, the app exits non-zero.
    # (Were it handed a JobOutcome, Hydra would take the job for one that returned.)
    crashed, lost = _track(tmp_path, "8_0", "8_1", ampsweep_job=False)
    crashed.job.crash("Traceback ...\nUncompletedJobError: Job not requeued")
    script = Script(lambda j, now: "CANCELLED")
    monkeypatch.setattr(slurm, "job_states", script.job_states)
    launcher.wait([crashed, lost], None, script.clock, script.sleep)
    assert crashed.returned.status == lost.returned.status == JobStatus.FAILED
    assert crashed.outcome is None and lost.outcome is None
    with pytest.raises(FailedJobError, match="UncompletedJobError: Job not requeued"):
        crashed.returned.return_value  # noqa: B018 - Hydra's sweeper reads it so
    with pytest.raises(launcher.JobLost, match="SLURM job 8_1 ended CANCELLED without a result"):
        lost.returned.return_value  # noqa: B018


def test_a_time_limit_within_the_requeue_warning_is_refused_for_any_app(capsys):
    # SLURM would signal the job from its start, every time its controller looks: requeued
    # over and over, then failed. Refused before anything is submitted.
    hydras = SimpleNamespace(params={"timeout_min": 2, "signal_delay_s": 120, "nodes": 1})
    with pytest.raises(SystemExit) as exit_:  # before the sweep dir, the executor, sbatch
        launcher.launch(hydras, [["x=1"]], 0)
    assert exit_.value.code == 2  # as ampsweep's own config errors
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: hydra.launcher.timeout_min=2: the job is signalled")
    assert "raise timeout_min above 2 minutes or lower signal_delay_s" in err
    assert len(err.splitlines()) == 1
    launcher._check_time_limit({"timeout_min": 2, "signal_delay_s": 30})  # 90 s before it
