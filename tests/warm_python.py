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
A shim that is itself killed leaves its command to finish on its own.
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
        with connection, connection.makefile("rwb") as stream:
            request = json.loads(stream.readline())
            with self._lock:
                self.served += 1
            try:
                done = self.forks.run(request["args"], request["cwd"], request["env"],
                                      self.timeout)  # fmt: skip
                reply = {"code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
            except Exception as err:  # e.g. past the timeout: the script sees a failed command
                reply = {"code": 1, "stdout": "", "stderr": f"warm_python: {err}\n"}
            try:
                stream.write(json.dumps(reply).encode() + b"\n")
                stream.flush()
            except OSError:  # the shim is gone (killed): nobody to tell
                pass


def _shim(address: str, real: str, argv: list[str]) -> int:
    """The ``python`` a script runs (see the module docstring)."""
    if argv[:2] != AMPSWEEP:
        os.execv(real, [real, *argv])
    request = {"args": argv[2:], "cwd": os.getcwd(), "env": dict(os.environ)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(address)
        with connection.makefile("rwb") as stream:
            stream.write(json.dumps(request).encode() + b"\n")
            stream.flush()
            reply = json.loads(stream.readline())
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
