"""``python -m ampsweep ARGS`` in a process forked from a warm one, for the suite.

An ``ampsweep`` process spends about 2 s of CPU importing torch, and a tracked one as long
again importing MLflow (in its recorder host), before the few steps a test trains. The suite
runs a few hundred of them on two cores. ``run`` starts each one instead from multiprocessing's
fork server, which imported all of that once (``PRELOAD``: what ``app.startup`` preloads for a
tracked training command): the child takes the command's working directory, environment,
``sys.path`` (the folder, then ``PYTHONPATH``, then the interpreter's own, as ``python -m``
builds it), standard streams and argv, then runs the ``ampsweep`` module as ``python -m``
does. So the command runs its real code, with its own exit code, signals and output, in a
process of its own; what it skips is the interpreter's start and those imports. Its
``sys.executable`` is ``executable`` where one is given (conftest gives ``warm_python``'s shim,
so that the ranks a DDP command starts are forked warm as well).

What only a fresh interpreter shows is tested with real ones (``conftest.start_cli``, and
``real=True`` here): which modules a command imports at all (``tests/unit/app/test_startup.py``),
a process group signalled as a whole, the installed console script. Only the standard library
is imported here: this module is imported again in every child, before the command. (Under
``python -m pytest -n 0`` the child also imports ``pytest.__main__``, as multiprocessing
imports the parent's main module; an xdist worker's has nothing to import.)
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

# What a tracked training command imports (app.startup.modules and the recorder host's
# modules), imported once in the fork server. A module that fails to import is left out
# (multiprocessing ignores it), and the command then imports it itself.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "hydra",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "ampsweep.app.cli",
    "ampsweep.app.job",
    "ampsweep.engine.components",
    "ampsweep.tracking.sweep",
    "ampsweep.tracking.mlflow_calls",
]


class WarmForks:
    """The fork server of this test process, started on first use (a few seconds, once)."""

    def __init__(self):
        self._context = None
        self._base_path: list[str] | None = None
        # What a command sees as ``sys.executable`` (None: this interpreter): the python of
        # its own ``-m ampsweep`` subprocesses, such as a DDP run's ranks (conftest).
        self.executable: str | None = None

    def context(self):
        if self._context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            self._context = context
        return self._context

    def base_path(self) -> list[str]:
        """``sys.path`` of a fresh interpreter without PYTHONPATH, less its first entry (the
        script's folder, or the working directory under ``-m``)."""
        if self._base_path is None:
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            code = "import json, sys; print(json.dumps(sys.path[1:]))"
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True)  # fmt: skip
            self._base_path = json.loads(out.stdout)
        return self._base_path

    def start(self, args: list[str], cwd, env: dict) -> Forked:
        """``python -m ampsweep ARGS`` started in ``cwd`` with exactly ``env``, forked warm."""
        folder = tempfile.TemporaryDirectory()
        out, err = Path(folder.name, "stdout"), Path(folder.name, "stderr")
        for path in (out, err):  # there to read even if the child dies before it runs
            path.touch()
        child = self.context().Process(
            target=_command,
            args=(list(args), str(cwd), dict(env), out, err, self.base_path(), self.executable),
        )
        child.start()
        return Forked([sys.executable, "-m", "ampsweep", *args], child, folder)

    def run(self, args: list[str], cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """``python -m ampsweep ARGS`` run in ``cwd`` with exactly ``env``, forked warm."""
        return self.start(args, cwd, env).wait(timeout)


class Forked:
    """A command started by ``WarmForks.start``: ``process`` (multiprocessing's), then
    ``wait``."""

    def __init__(self, command: list[str], process, folder: tempfile.TemporaryDirectory):
        self.command, self.process, self._folder = command, process, folder

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its CompletedProcess (as ``subprocess.run`` gives), when it ends."""
        with self._folder as folder:
            self.process.join(timeout)
            if self.process.exitcode is None:  # still running: as subprocess.run on a timeout
                self.process.kill()
                self.process.join()
                raise subprocess.TimeoutExpired(self.command, timeout)
            out, err = (Path(folder, name) for name in ("stdout", "stderr"))
            stdout, stderr = (p.read_text(encoding="utf-8", errors="replace") for p in (out, err))
        return subprocess.CompletedProcess(self.command, self.process.exitcode, stdout, stderr)


def _command(args, cwd, env, out, err, base_path, executable) -> None:
    """In the forked child: become ``python -m ampsweep ARGS`` started in ``cwd`` with ``env``
    (and ``executable`` as ``sys.executable``, where given)."""
    if executable:
        sys.executable = executable
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [cwd, *extra, *base_path]
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["-m", *args]  # runpy puts the module's path first, as python -m does
    runpy.run_module("ampsweep", run_name="__main__", alter_sys=True)
