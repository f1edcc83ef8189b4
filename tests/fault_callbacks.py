"""Callbacks that inject the faults of a shared machine into an ``ampsweep train`` command
(named in ``trainer.callbacks``; ``conftest.callback_env`` puts this folder on the path of a
subprocess)."""

from __future__ import annotations

import errno
import subprocess
import sys
import time
from pathlib import Path

import torch

from ampsweep.engine.loop import Callback

HOLD = """
import sqlite3, sys, time, pathlib
c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=60)
c.execute("BEGIN EXCLUSIVE")
pathlib.Path(sys.argv[2]).write_text("locked")
deadline = time.monotonic() + float(sys.argv[4])
while not pathlib.Path(sys.argv[3]).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
c.execute("ROLLBACK")
"""


class LockStore(Callback):
    """The SQLite store locked by another process from step ``start`` until step ``end``, or
    for ``hold`` seconds at most (an exclusive transaction: every write of the run fails with
    "database is locked" after SQLite's wait), as a long backup or a stuck writer does."""

    def __init__(self, db: str, start: int, end: int = 0, hold: float = 600.0):
        self.db, self.start, self.end, self.hold = db, start, end, hold
        self.proc = None
        self.flag = Path(db).with_suffix(".unlock")

    def after_step(self, state) -> None:
        if state.step == self.start:
            locked = Path(self.db).with_suffix(".locked")
            # without the command's pipes: a test reading them to the end would otherwise wait
            # for this holder too (up to ``hold`` seconds after the command ended)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", HOLD, self.db, str(locked), str(self.flag), str(self.hold)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            while not locked.exists():
                time.sleep(0.05)
        if state.step == self.end and self.proc is not None:
            self.flag.write_text("go")
            self.proc.wait()


class DiskFull(Callback):
    """Every checkpoint write from step ``step`` on fails as on a full disk (ENOSPC, after
    part of the file was written): ``torch.save`` is replaced for the rest of the process."""

    def __init__(self, step: int):
        self.step = step
        self.real = torch.save

    def after_step(self, state) -> None:
        if state.step == self.step - 1:
            torch.save = self._full

    def _full(self, obj, f, *args, **kwargs):
        Path(f).write_bytes(b"partial checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")


class ServerOutage(Callback):
    """The MLflow tracking server killed at step ``start`` (SIGKILL: it answers nothing, as a
    lost machine) and started again on the same port and store at step ``end``. ``pidfile``
    holds the server's pid and ``cmdfile`` its command (JSON), both written by the test; the
    restarted server's pid replaces the old one so the test can stop it."""

    def __init__(self, pidfile: str, cmdfile: str, url: str, start: int, end: int):
        self.pidfile, self.cmdfile, self.url = Path(pidfile), Path(cmdfile), url
        self.start, self.end = start, end

    def after_step(self, state) -> None:
        import json
        import os
        import signal

        from ampsweep.cli import ui

        if state.step == self.start:
            pid = int(self.pidfile.read_text())
            os.killpg(pid, signal.SIGKILL)  # the server and its workers (its own session)
            while _alive(pid):
                time.sleep(0.05)
        if state.step == self.end:
            cmd = json.loads(self.cmdfile.read_text())
            log = self.pidfile.with_suffix(".log")
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log.open("a"),
                                    stderr=subprocess.STDOUT, env=ui.server_env(),
                                    start_new_session=True)  # fmt: skip
            self.pidfile.write_text(str(proc.pid))
            ui.wait_until_up(self.url, proc, 120, log)


def _alive(pid: int) -> bool:
    """False once ``pid`` is gone or a zombie (killed, not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
