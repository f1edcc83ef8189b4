"""A run's checkpoint folder: where it is, keyed by the hash of the run's config, and who owns
it, the one process that holds its lease.

A run's config identity: the keys that may differ on resume (``NOT_HASHED``), the hash of
the rest, and the checkpoint folder it keys; how a checkpoint's stored config differs from
this one.

Where: ``<trainer.checkpoint_dir or outputs/checkpoints>/<config hash>/<run id>/step-N.pt``.
Keying the folder by the config hash lets ``trainer.resume=auto`` find the newest checkpoint of
the same config after a relaunch, and lets sweep jobs with different configs never collide.

A run has one owner: the process training it holds a lease on its checkpoint folder.

The lease is an exclusive ``flock`` on ``owner.lock`` in the folder, taken without waiting
and held for as long as the job trains the run. The kernel drops the lock when the owning
process ends, however it ends (SIGKILL included), so a lease is never left stale by a dead
process and taking it is atomic: of two processes trying at once, exactly one gets it. The
file also says who holds it (host, pid, since when), for the one line a second process prints,
and is emptied when its owner lets go, so a new owner can tell a clean release from an owner
that died holding it (its end is then recorded on the run).

The lock file itself is never removed: a process that opened it just before a removal would
lock a file nobody else sees, and two processes would own the run.

No torch here: it is plain config and files (``ampsweep repair`` and the SLURM launcher import
it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from ampsweep.config.compose import flatten
from ampsweep.config.schema import Config

DEFAULT_ROOT = Path("outputs") / "checkpoints"
# Keys that say only where things are written, how often, how they are shown, or what
# watches the run (trainer.callbacks: a run a callback stopped resumes without it): they may
# differ between a checkpoint and the command resuming it, and they are left out of the hash.
NOT_HASHED = (
    "trainer.resume",
    "trainer.callbacks",
    "trainer.checkpoint_dir",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.progress",
    "tracking.uri",
    "tracking.artifact_root",
    "tracking.metrics_flush_every",
    "tracking.metrics_flush_seconds",
    "tracking.skip_finished",
    "tracking.log_model",
    "tracking.register_model",
    "tracking.system_metrics",
    "tracking.system_metrics_interval",
    "tracking.on_store_failure",
)


class _ComparableByValue:
    """``comparable`` of the last few configs, by value. A job asks for its config's hash
    about seven times (its tags, the finished-twin look-up, the checkpoint folder twice, each
    save), and each is a flatten through OmegaConf (slow, as OmegaConf is) of a config that
    does not change. The key is the config's repr: a dataclass's repr spells every field's
    value, so a config changed in between is a new key, never a stale hash."""

    def __init__(self, size: int = 16):
        self.size = size
        self._seen: dict[str, dict[str, str]] = {}

    def __call__(self, cfg: Config) -> dict[str, str]:
        key = repr(cfg)
        if key not in self._seen:
            if len(self._seen) >= self.size:
                self._seen.pop(next(iter(self._seen)))  # the oldest
            self._seen[key] = {k: v for k, v in flatten(cfg).items() if k not in NOT_HASHED}
        return dict(self._seen[key])  # a copy: callers may change theirs


_comparable = _ComparableByValue()  # a memo of a pure function: no state a caller sees


def comparable(cfg: Config) -> dict[str, str]:
    """The flattened config without the keys that may differ on resume."""
    return _comparable(cfg)


def config_hash(cfg: Config) -> str:
    """A short hash of what determines the result (resolved precision included)."""
    text = json.dumps(comparable(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def root_of(cfg: Config) -> Path:
    return Path(cfg.trainer.checkpoint_dir or DEFAULT_ROOT).expanduser().resolve()


def folder_for(cfg: Config, run_id: str | None) -> Path:
    """This run's checkpoint folder (absolute)."""
    name = run_id or f"untracked-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    return root_of(cfg) / config_hash(cfg) / name


def unmasked(text: str) -> str:
    return text


def differences(saved: dict[str, str], cfg: Config, mask: Callable[[str], str] = unmasked):
    """Where the config stored in a checkpoint (masked by ``mask``) differs from ``cfg``."""
    now = {k: mask(v) for k, v in comparable(cfg).items()}
    keys = sorted(set(saved) | set(now))
    return [
        f"{k}={saved.get(k, '<absent>')} in the checkpoint, {now.get(k, '<absent>')} now"
        for k in keys
        if saved.get(k) != now.get(k) and k not in NOT_HASHED
    ]


# ---------------------------------------------------------------- the lease

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
