"""engine/checkpoint.py and the lease of engine/run_folder.py: a checkpoint proves itself (its
digest), a damaged or cut-short one is never resumed (the newest good one is), a failed write
leaves no temporary file (a full disk is one line), and a run's folder has one owner at a time."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import resumable

from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError
from ampsweep.engine import build as train
from ampsweep.engine import checkpoint, loop, resume_from, run_folder
from ampsweep.errors import FaultError


def damage(path: Path, n: int = 256) -> None:
    """Overwrite ``n`` bytes of the first tensor's data in place (the file's size unchanged),
    as a bad disk or a stray write would."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    with path.open("r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        start = info.header_offset + 30 + name_len + extra_len
        f.seek(start)
        old = f.read(min(n, info.file_size))
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in old))


@pytest.fixture
def run1(tmp_path):
    """A config and its run "run1" with checkpoints at steps 1, 2 and 3 (oldest first)."""
    cfg = config.load([*resumable(tmp_path / "ck", "trainer.max_steps=4"), "tracking=none"])
    folder = run_folder.folder_for(cfg, "run1")
    ckpts = checkpoint.Checkpointer(folder, cfg, "run1")
    ckpts.keep = 3
    setup = train.build(cfg)
    saved = []
    for step in (1, 2, 3):
        saved.append(ckpts.save(setup, loop.TrainState(step=step)))
        time.sleep(0.01)  # distinct modification times: "newest" is by time
    return cfg, folder, saved


def choose(cfg, choice: str):
    said: list[str] = []
    paths = resume_from.candidates(cfg, choice)[0]
    chosen = resume_from.choose(paths, choice, said.append)
    chosen.lease.release()
    return chosen, said


def test_a_checkpoint_carries_the_digest_of_its_contents(run1):
    _, _, saved = run1
    ckpt = checkpoint.load(saved[-1])
    assert ckpt[checkpoint.DIGEST] == checkpoint.digest(ckpt)
    ckpt["model"][next(iter(ckpt["model"]))][0] += 1.0  # any change is seen
    assert ckpt[checkpoint.DIGEST] != checkpoint.digest(ckpt)


def test_overwritten_bytes_are_refused_and_auto_falls_back(run1):
    cfg, folder, saved = run1
    size = saved[-1].stat().st_size
    damage(saved[-1])
    assert saved[-1].stat().st_size == size  # loads as a zip still; only the digest tells
    with pytest.raises(checkpoint.DamagedCheckpoint, match="no longer match its digest"):
        checkpoint.load(saved[-1])
    chosen, said = choose(cfg, "auto")
    assert chosen.path == saved[-2] and chosen.ckpt["state"]["step"] == 2
    assert said == [
        f"{saved[-1]} is damaged: its contents no longer match its digest (bytes changed on "
        "disk): not resuming from it"
    ]
    assert choose(cfg, str(folder))[0].path == saved[-2]  # a run's folder falls back too


def test_a_truncated_newest_falls_back(run1):
    cfg, _, saved = run1
    data = saved[-1].read_bytes()
    saved[-1].write_bytes(data[: len(data) // 2])
    chosen, said = choose(cfg, "auto")
    assert chosen.path == saved[-2]
    assert len(said) == 1 and "is not a readable ampsweep checkpoint" in said[0]


def test_a_damaged_file_named_explicitly_is_refused_in_one_line(run1):
    cfg, _, saved = run1
    for path in saved:
        damage(path)
    with pytest.raises(ConfigError) as err:
        choose(cfg, str(saved[-1]))
    assert str(err.value).startswith(f"trainer.resume={saved[-1]}: no undamaged checkpoint")
    chosen, said = choose(cfg, "auto")  # auto: nothing good left, a new run
    assert chosen.ckpt is None and len(said) == 3
    assert "starting afresh" in chosen.line


def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(run1, monkeypatch):
    cfg, folder, _ = run1

    def full(payload, f):
        Path(f).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(FaultError) as err:
        checkpoint.Checkpointer(folder, cfg, "run1").save(train.build(cfg), loop.TrainState(9))
    message = str(err.value)
    assert message.startswith("no space left on /") and "\n" not in message
    assert message.endswith("MiB: free space or set trainer.checkpoint_dir")
    assert not list(folder.glob(".*tmp"))
    assert not (folder / "step-00000009.pt").exists()


def test_torch_writers_disk_full_error_is_recognised(tmp_path, monkeypatch):
    def full(payload, f):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
            "file data/0: file write failed: No space left on device"
        )

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(FaultError, match="no space left on"):
        checkpoint.write({"x": torch.zeros(4)}, tmp_path / "step-1.pt")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the lease


def test_a_lease_has_one_holder_and_records_a_dead_one(tmp_path):
    held = run_folder.take(tmp_path / "run")
    assert held.previous is None
    with pytest.raises(run_folder.Owned) as owned:
        run_folder.take(tmp_path / "run")  # a second holder, even in the same process
    assert owned.value.owner.pid == os.getpid()
    assert run_folder.held(tmp_path / "run").pid == os.getpid()
    held.release()
    assert run_folder.held(tmp_path / "run") is None
    again = run_folder.take(tmp_path / "run")
    assert again.previous is None  # released cleanly: nothing to record
    again.release()
    # a process that dies holding it: the lock goes with it, its record stays
    folder = tmp_path / "run"
    code = (
        "from ampsweep.engine import run_folder; import os; "
        f"run_folder.take(__import__('pathlib').Path({str(folder)!r})); os._exit(9)"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False)
    assert proc.returncode == 9
    taken = run_folder.take(tmp_path / "run")
    assert taken.previous is not None and taken.previous.pid != os.getpid()
    taken.release()


def test_auto_leaves_a_run_that_is_being_trained_to_its_owner(run1):
    cfg, folder, _ = run1
    owner = run_folder.take(folder)
    try:
        chosen, said = choose(cfg, "auto")
        assert chosen.ckpt is None and "is being trained by pid" in said[0]
        with pytest.raises(ConfigError, match="is being trained by pid .*: wait for it to end"):
            choose(cfg, str(folder))
    finally:
        owner.release()
    assert choose(cfg, "auto")[0].ckpt is not None
