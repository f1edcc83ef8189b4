"""A run has one owner: the process training it holds a lease on its checkpoint folder.

The lease is an exclusive ``flock`` on ``owner.lock`` in the folder, taken without waiting
and held for as long as the job trains the run. The kernel drops the lock when the owning
process ends, however it ends (SIGKILL included), so a lease is never left stale by a dead
process and taking it is atomic: of two processes trying at once, exactly one gets it. The
file also says who holds it (host, pid, since when), for the one line a second process prints,
and is emptied when its owner lets go, so a new owner can tell a clean release from an owner
that died holding it (its end is then recorded on the run).

The lock file itself is never removed: a process that opened it just before a removal would
lock a file nobody else sees, and two processes would own the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

LOCK_NAME = "owner.lock"


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    since: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} (since {self.since})"


class Owned(Exception):
    """The folder's run is being trained by another live process."""

    def __init__(self, folder: Path, owner: Owner | None):
        who = owner.describe() if owner else "another process"
        super().__init__(f"{folder} is in use by {who}")
        self.folder, self.owner = folder, owner


class Lease:
    """A held lease; ``previous``: an owner that died holding it (None: released cleanly)."""

    def __init__(self, folder: Path, fd: int, previous: Owner | None):
        self.folder, self.previous = folder, previous
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # a clean release: the next owner has nothing to record
        os.close(fd)  # closing drops the lock


class NoLease:
    """Nothing held (a rank that writes no checkpoints)."""

    folder = None
    previous = None

    def release(self) -> None: ...


def take(folder: Path) -> Lease:
    """The lease on ``folder`` (created if need be), or Owned if a live process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _read(fd)
        os.close(fd)
        raise Owned(folder, owner) from None
    except BaseException:
        os.close(fd)
        raise
    previous = _read(fd)
    me = Owner(socket.gethostname(), os.getpid(), datetime.now().isoformat(timespec="seconds"))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(asdict(me)).encode(), 0)
    return Lease(folder, fd, previous)


def held(folder: Path) -> Owner | None:
    """The live owner of ``folder``'s lease (None: nobody holds it). Asks with a shared lock,
    taken and dropped at once, and changes nothing in the file."""
    path = folder / LOCK_NAME
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or Owner("?", 0, "?")
    finally:
        os.close(fd)
    return None


def _read(fd: int) -> Owner | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
        return Owner(str(data["host"]), int(data["pid"]), str(data["since"]))
    except (ValueError, TypeError, KeyError, OSError):
        return None
