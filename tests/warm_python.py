"""A ``python`` for the scripts a test runs: ``$PYTHON -m ampsweep ARGS`` is forked warm.

scripts/gpu_day.sh, and the scripts it runs, start every Python command as ``"$PYTHON" ...``.
Its dry run (tests/e2e/test_scripts_gpu_day.py) runs a dozen ``-m ampsweep`` commands, each a
fresh interpreter that spends about 2 CPU-seconds importing torch (and its recorder host as
long importing MLflow) before a few tiny steps. ``WarmPython`` gives the script a ``python``
whose ``-m ampsweep`` commands run as ``run_cli`` runs them (``warm_cli``: forked from the test
process's fork server, the command's real code in a process of its own, with the command's
folder, environment and argv, its own exit code). Anything else (``-c``, ``-m pytest``, a
script on standard input) execs the real interpreter, unchanged.

The shim is this file run as a script, with the standard library only. It sends the command
(argv, folder, environment) over a Unix socket to a thread of the test process and writes back
what the command printed, after it ends (not as it goes), then exits with its exit code, or
dies of its signal. Its standard input is not passed on (``warm_cli`` gives a command none).
The signals a parent sends to end a child (SIGTERM, SIGINT, SIGHUP, SIGQUIT: an elastic agent
ends a DDP run's other ranks so) are relayed to the command; a shim killed outright (SIGKILL)
ends its connection, and the command is killed then.

conftest also makes the shim every warm command's ``sys.executable``, so that the ``-m
ampsweep`` processes a command starts itself (a DDP or FSDP run's ranks) are forked warm too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
from pathlib import Path

AMPSWEEP = ["-m", "ampsweep"]


class WarmPython:
    """``with WarmPython(forks) as python:``: ``python.path`` is an executable to give a script
    as its interpreter, served by ``forks`` (a ``warm_cli.WarmForks``) while the block runs;
    ``python.served`` counts the ``-m ampsweep`` commands it forked."""

    def __init__(self, forks, timeout: float = 600):
        self.forks, self.timeout = forks, timeout
        self.served = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def __enter__(self) -> WarmPython:
        # A short folder of its own: a Unix socket's path may not exceed about 100 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="warm-python-"))
        self.path = self.folder / "python"
        address = str(self.folder / "socket")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(address)
        self._listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()
        # -I: the shim imports nothing of the checkout's, and reads no PYTHON* variable.
        self.path.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" -I "{Path(__file__).resolve()}" '
            f'"{address}" "{sys.executable}" "$@"\n'
        )
        self.path.chmod(self.path.stat().st_mode | stat.S_IXUSR)
        return self

    def __exit__(self, *exc) -> None:
        self._listener.close()
        for path in self.folder.iterdir():
            path.unlink()
        self.folder.rmdir()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed: the block ended
                return
            # One thread a command: a script may run several at once (`&`, then `wait`).
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as stream:
            request = json.loads(stream.readline())
            with self._lock:
                self.served += 1
            relay = None
            try:
                command = self.forks.start(request["args"], request["cwd"], request["env"])
                # A pidfd, not the pid: it names this process even after the waiting thread
                # has reaped it and its pid is reused (a signal then fails, harmlessly).
                pidfd = os.pidfd_open(command.process.pid)
                ended = threading.Event()
                relay = threading.Thread(target=_relay, args=(stream, pidfd, ended),
                                         daemon=True)  # fmt: skip
                relay.start()
                try:
                    done = command.wait(self.timeout)
                finally:
                    ended.set()
                reply = {"code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            except Exception as err:  # e.g. past the timeout: the script sees a failed command
                reply = {"code": 1, "stdout": "", "stderr": f"warm_python: {err}\n"}
            try:  # unbuffered: nothing left to flush into a closed connection
                connection.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:  # the shim is gone (killed): nobody to tell
                pass
            if relay:
                relay.join(10)  # until the shim, with its reply, closes the connection


def _relay(stream, pidfd: int, ended: threading.Event) -> None:
    """The signals the shim was sent, sent on to its command (``pidfd``); the command killed if
    the shim dies before it ends (SIGKILL: nothing to relay, the connection just ends). Only
    the pidfd is used here: the command's process object is the waiting thread's to poll.
    This thread closes the pidfd: the only one that uses it, however long it waits."""
    try:
        with contextlib.suppress(OSError, ValueError):  # the connection closed under the read
            for line in stream:  # one {"signal": N} a line, until the shim closes it
                if not ended.is_set():
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(pidfd, json.loads(line)["signal"])
        if not ended.is_set():  # the shim ended before its command: end the command too
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


# What the shim passes on to its command: what a parent sends to end a child (an elastic agent
# sends SIGTERM to a DDP run's other ranks when one fails, SIGKILL after its timeout).
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _shim(address: str, real: str, argv: list[str]) -> int:
    """The ``python`` a script runs (see the module docstring)."""
    if argv[:2] != AMPSWEEP:
        os.execv(real, [real, *argv])
    request = {"args": argv[2:], "cwd": os.getcwd(), "env": dict(os.environ)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(address)

        def relay(signum, frame) -> None:
            connection.sendall(json.dumps({"signal": signum}).encode() + b"\n")

        connection.sendall(json.dumps(request).encode() + b"\n")
        for signum in RELAYED:  # after the request: the server reads it first
            signal.signal(signum, relay)
        with connection.makefile("rb") as stream:
            reply = json.loads(stream.readline())
        for signum in RELAYED:  # the command has ended: a signal now is the shim's own
            signal.signal(signum, signal.SIG_DFL)
    sys.stdout.write(reply["stdout"])
    sys.stderr.write(reply["stderr"])
    sys.stdout.flush()
    sys.stderr.flush()
    code = reply["code"]
    if code < 0:  # killed by a signal: die of it too, as the command did
        with contextlib.suppress(OSError):  # SIGKILL's action cannot be set (nor needs to be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(_shim(sys.argv[1], sys.argv[2], sys.argv[3:]))
