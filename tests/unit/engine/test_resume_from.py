"""engine/resume_from.py: which checkpoint ``trainer.resume`` resumes (auto, a folder, a file,
a run's folder; none at the end of a run), and every refusal in one line: another config, the
end of a run, another run, an empty folder, a run without checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError
from ampsweep.engine import build as train
from ampsweep.engine import checkpoint, loop, resume_from, run_folder
from unit.engine.test_checkpoint import refusal, small


def test_resume_refuses_other_config_with_one_line(tmp_path):
    cfg = config.load(small(tmp_path, "trainer.max_steps=2"))
    path = checkpoint.Checkpointer(tmp_path / "f", cfg, None).save(
        train.build(cfg), loop.TrainState(step=1)
    )
    other = config.load(small(tmp_path, "trainer.max_steps=2", "optimizer.lr=0.01"))
    with pytest.raises(ConfigError) as err:
        resume_from.check(checkpoint.load(path), other, path, str(path))
    msg = str(err.value)
    assert "optimizer.lr=0.001 in the checkpoint, 0.01 now" in msg and "\n" not in msg
    # Output locations may differ: the same config under another checkpoint_dir is accepted.
    moved = config.load(small(tmp_path / "x", "trainer.max_steps=2", "trainer.checkpoint_every=5"))
    resume_from.check(checkpoint.load(path), moved, path, str(path))


def picked(cfg, choice: str, said: list | None = None) -> Path | None:
    """The checkpoint ``trainer.resume=choice`` resumes (None: afresh), its lease let go."""
    paths, _ = resume_from.candidates(cfg, choice)
    chosen = resume_from.choose(paths, choice, (said if said is not None else []).append)
    chosen.lease.release()
    return chosen.path


def test_resume_choices(tmp_path):
    cfg = config.load(small(tmp_path, "trainer.max_steps=2"))
    assert picked(cfg, "auto") is None  # nothing yet: start afresh
    assert not resume_from.is_path("0123abcd")  # a run id: the job looks it up in the store
    with pytest.raises(ConfigError, match="run 0123abcd has no checkpoint"):
        resume_from.candidates_of_run("0123abcd", None)
    with pytest.raises(ConfigError, match="no such file"):
        resume_from.candidates(cfg, str(tmp_path / "nope.pt"))
    folder = run_folder.folder_for(cfg, "run1")
    ckpts = checkpoint.Checkpointer(folder, cfg, "run1")
    first = ckpts.save(train.build(cfg), loop.TrainState(step=1))
    assert picked(cfg, "auto") == first
    assert picked(cfg, str(folder)) == first  # a folder: its newest
    assert resume_from.candidates_of_run("run1", folder) == [first]
    time.sleep(0.01)
    ckpts.save(train.build(cfg), loop.TrainState(step=2), complete=True)
    assert picked(cfg, "auto") is None  # newest ended its run


@pytest.fixture
def saved(tmp_path):
    """A config and the two checkpoints of its run "run1": step 1, and the end (step 2)."""
    cfg = config.load(small(tmp_path, "trainer.max_steps=2"))
    ckpts = checkpoint.Checkpointer(run_folder.folder_for(cfg, "run1"), cfg, "run1")
    setup = train.build(cfg)
    mid = ckpts.save(setup, loop.TrainState(step=1))
    end = ckpts.save(setup, loop.TrainState(step=2), complete=True)
    return cfg, mid, end


def test_an_explicit_end_checkpoint_is_refused(saved):
    cfg, _, end = saved
    message = refusal(lambda: resume_from.check(checkpoint.load(end), cfg, end, str(end)))
    assert f"trainer.resume={end}" in message and "is the end of run run1" in message
    assert "nothing to resume" in message


def test_a_checkpoint_of_another_run_is_refused(saved):
    cfg, mid, _ = saved
    ckpt = checkpoint.load(mid)
    message = refusal(lambda: resume_from.check(ckpt, cfg, mid, "run2", run_id="run2"))
    assert message == f"trainer.resume=run2: {mid} belongs to run run1, not run2"


def test_an_empty_folder_is_refused(tmp_path, saved):
    cfg, _, _ = saved
    (tmp_path / "empty").mkdir()
    message = refusal(lambda: resume_from.candidates(cfg, str(tmp_path / "empty")))
    assert f"trainer.resume={tmp_path / 'empty'}: no step-*.pt checkpoint in" in message


def test_a_run_whose_folder_holds_no_checkpoint_is_refused(tmp_path):
    (tmp_path / "run-folder").mkdir()
    message = refusal(lambda: resume_from.candidates_of_run("abc123", tmp_path / "run-folder"))
    assert message.startswith("trainer.resume=abc123: run abc123 has no checkpoint")
    assert str(tmp_path / "run-folder") in message
