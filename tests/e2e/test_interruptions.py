"""A signal at every phase of `ampsweep train` ends in a known state: exit 130, one line that
says what was left and what to type next, nothing RUNNING. Each phase is signalled
deterministically (a callback at a known step, or the phase's own function raising
KeyboardInterrupt), through the command in this process."""

from __future__ import annotations

import json
import shlex

import pytest
from callbacks import signal_at_step
from conftest import all_runs

from ampsweep.report import charts
from ampsweep.runner import job, plan
from ampsweep.tracking import store

TINY = ["model=mlp", "model.width=8", "trainer.epochs=1", "trainer.max_steps=4"]
TINY += ["trainer.log_every=1", "trainer.progress=false", "trainer.timing_warmup_steps=0"]


def one_error_line(err: str, stopping: bool = False) -> str:
    """The command's one line; ``stopping``: after the line the signal itself printed as
    training took it (it stops at the next step, with a checkpoint)."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err
    if stopping:
        assert lines[0] == "error: SIGINT: stopping after this step, with a checkpoint"
        lines = lines[1:]
    assert len(lines) == 1, err
    return lines[0]


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_a_signal_while_the_report_is_drawn_leaves_the_parent_killed_until_reported(
    store_uri, main, monkeypatch
):
    monkeypatch.setattr(charts, "write_charts", interrupt)  # the charts' savefig
    result = main("train", "-m", "precision=fp32,bf16", *TINY, f"tracking.uri={store_uri}")
    assert result.code == 130
    line = one_error_line(result.err)
    (parent,) = [r for r in all_runs(store_uri) if r.data.tags.get(store.SWEEP) == "true"]
    run_id = parent.info.run_id
    assert line.endswith(f"write it with: ampsweep report --sweep {run_id}")
    assert parent.info.status == store.KILLED
    assert f"ampsweep report --sweep {run_id}" in parent.data.tags[store.REPORT_MISSING]
    client = store.client_for(store_uri)
    assert "report.md" not in [a.path for a in client.list_artifacts(run_id)]

    monkeypatch.undo()
    report = main("report", "--tracking-uri", store_uri)
    assert report.code == 0, report.err
    assert "now logged to its parent run" in report.err
    parent = client.get_run(run_id)
    assert parent.info.status == store.FINISHED  # both jobs finished
    assert store.REPORT_MISSING not in parent.data.tags
    assert "report.md" in [a.path for a in client.list_artifacts(run_id)]
    assert main("report", "--tracking-uri", store_uri).err == ""  # logged once


@pytest.mark.parametrize("phase", ["planning", "building"])
def test_ctrl_c_before_training_says_nothing_was_trained(phase, store_uri, main, monkeypatch):
    if phase == "planning":
        monkeypatch.setattr(plan, "plan", interrupt)
    else:
        monkeypatch.setattr(job, "build_planned", interrupt)
    result = main("train", *TINY, f"tracking.uri={store_uri}")
    assert result.code == 130
    line = one_error_line(result.err)
    assert line.startswith("error: interrupted before training started: nothing was trained")
    assert "nothing is left RUNNING" in line
    assert [r for r in all_runs(store_uri) if r.info.status == store.RUNNING] == []


def test_ctrl_c_before_a_sweep_trains_says_nothing_was_trained(store_uri, main, monkeypatch):
    monkeypatch.setattr(job, "build_planned", interrupt)
    result = main("train", "-m", "precision=fp32,bf16", *TINY, f"tracking.uri={store_uri}")
    assert result.code == 130
    assert "before training started: nothing was trained" in one_error_line(result.err)
    assert [r for r in all_runs(store_uri) if r.info.status == store.RUNNING] == []


def test_ctrl_c_in_training_prints_the_checkpoint_and_the_command_that_resumes(
    tmp_path, store_uri, main
):
    args = [*TINY, f"tracking.uri={store_uri}", f"trainer.checkpoint_dir={tmp_path / 'ck'}"]
    result = main("train", *args, signal_at_step(2, "SIGINT"))
    assert result.code == 130
    line = one_error_line(result.err, stopping=True)
    assert "stopped with checkpoint " in line and "step-00000002.pt" in line
    command = line.split("resume it with: ")[1]
    assert command.endswith(" trainer.resume=auto")
    # the callback that stopped the run is not repeated: the run resumes without it
    assert "trainer.callbacks" not in command and "SignalAtStep" not in command
    assert "its trainer.callbacks left out (a run a callback stopped resumes without it)" in line
    (killed,) = all_runs(store_uri)
    assert killed.info.status == store.KILLED

    again = main(*shlex.split(command)[1:])  # the command as printed
    assert again.code == 0, again.err
    (run,) = all_runs(store_uri)
    assert run.info.run_id == killed.info.run_id and run.info.status == store.FINISHED
    assert run.data.tags["resumed_at_step"] == "2"


def test_ctrl_c_in_a_sweep_prints_the_relaunch_that_finishes_it(tmp_path, store_uri, main):
    args = ["-m", "precision=fp32,bf16", *TINY, f"tracking.uri={store_uri}"]
    result = main("train", *args, signal_at_step(2, "SIGINT", job=0))
    assert result.code == 130
    line = one_error_line(result.err, stopping=True)
    assert "fp32-mlp-digits stopped with checkpoint " in line
    command = line.split("relaunch the sweep to finish it (finished jobs are skipped, ")[1]
    command = command.split("): ", 1)[1]
    report = json.loads(main("report", "--tracking-uri", store_uri, "--format", "json").out)
    (unrun,) = [f for f in report["findings"] if "did not run" in f]
    assert unrun.startswith("1 job(s) of this sweep did not run (#1), so they have no row")
    assert unrun.endswith(f"(jobs that finished are skipped): {command}")
    assert "did not run (#1)" in " ".join(result.out.split())  # the report the sweep printed
    again = main(*shlex.split(command)[1:])
    assert again.code == 0, again.err
    kids = [r for r in all_runs(store_uri) if store.PARENT in r.data.tags]
    finished = {r.info.run_name for r in kids if r.info.status == store.FINISHED}
    assert finished == {"fp32-mlp-digits", "bf16-mlp-digits"}
