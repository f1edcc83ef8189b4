"""How the ``ampsweep`` program starts and ends: the few seconds around a command.

A training command spends most of a short run importing torch (with ``torch._dynamo``, which
every torch optimizer imports when it is built), MLflow (with its SQLAlchemy store) and Hydra,
and, after the command, in CPython's teardown of all of it. Four pieces cut that, each switched
by a field of ``Startup`` so that ``scripts/bench_fixed_cost.py --startup`` measures a 1-step
``ampsweep train`` as a process with each one off in turn, paired and interleaved. What turning
each one off cost there (seconds of wall time, median of 3 rounds, tracked / ``tracking=none``;
a 2-core CPU, lightly shared, 2026-12-01, the recorder host 2026-12-02; docs/benchmarks.md):

- ``recorder_host`` (+0.9 s tracked): a tracked ``ampsweep train`` of one run (or ``ampsweep
  reproduce``) forks, first, the process that imports MLflow and makes the run's MLflow calls
  (``tracking.host``), so MLflow imports on the other core while this one imports torch; the
  command imports no MLflow (``recorder_modules``). It costs about 0.25 s more CPU in all (what
  both processes import). A sweep imports MLflow in the command, once for all its jobs.
- ``collector_off`` (+1.2 / +0.6 s): the modules a training command needs (``modules``) are
  imported up front with the garbage collector off. While they import, Python otherwise runs
  full collections over the growing heap that find nothing.
- ``freeze`` (+1.05 / +0.5 s): then ``gc.freeze()`` moves all of it out of the collector's reach,
  so that no later collection in the run scans it (the collector is on again for the command).
- ``fast_exit`` (+0.2 / +0.1 s): when the command has returned (runs ended, files written,
  child processes waited for), the program does what CPython's exit does first, in its order
  (joins the non-daemon threads, runs the exit handlers, flushes the output), then ends with
  ``os._exit`` instead of freeing every module and object one by one (mypy ends the same way
  for the same reason). An exception or ``SystemExit`` from the command takes Python's usual
  way out.

The first three off cost +2.9 / +1.3 s; all four +3.8 s tracked (2026-12-02).
``tracking=none`` (or ``tracking.backend=none``) on the command line leaves MLflow out of the
up-front imports, and nothing a run with tracking off runs imports it (the recorder loads its
MLflow modules on first use): a 1-step run in 2.2 s against 2.4 s tracked (3.45 s with
MLflow in the command). So does every rank but 0 of a DDP run, which records nothing (1.2 s
of CPU and the memory of MLflow, pandas and SQLAlchemy saved per rank). A run that records to
a tracking server (``tracking.uri=http://...`` or ``MLFLOW_TRACKING_URI``) leaves out MLflow's
database store, which only its server uses (about 0.5 s). Otherwise the start-up reads only
the command line: a config that turns tracking off some other way (an experiment file) still
has MLflow imported up front (by the recorder host, for a single run).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from ampsweep.cli import trust
from ampsweep.launch import command_line
from ampsweep.tracking import host, store

TRAINING_COMMANDS = ("train", "reproduce", "capacity", "doctor")
# What a training command imports, heaviest first. torch._dynamo: torch.optim imports it when an
# optimizer is built (Optimizer.add_param_group is wrapped by torch._disable_dynamo), compiled
# or not. The ampsweep modules bring Hydra, the registries and the recorder.
PRELOAD = ("torch", "torch._dynamo", "hydra", "ampsweep.engine.components", "ampsweep.runner.job")
# What a tracked run adds: the sweep records, and MLflow with the functions that use its classes
# (in the recorder host, for a single run); and, unless it records to a tracking server
# (http:// or https://), MLflow's database store (SQLAlchemy, alembic: about 0.5 s).
PRELOAD_TRACKING = ("ampsweep.tracking.sweep",)
PRELOAD_MLFLOW = ("mlflow", host.FUNCTIONS)
PRELOAD_DATABASE = ("mlflow.store.tracking.sqlalchemy_store",)
UNTRACKED = ("tracking=none", "tracking.backend=none")  # the command lines that record nothing


def modules(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The modules to import before the command ``argv`` runs (none for commands that train
    nothing: ``--help``, ``--cfg``, report, ui). A rank other than 0 of a DDP run
    (``environ`` as torchrun sets it) records nothing, so it imports no MLflow either."""
    if not argv or argv[0] not in TRAINING_COMMANDS or "--usage" in argv:
        return ()
    if argv[0] == "train" and command_line.informational(_read(argv[1:])):
        return ()  # printing the config or a help trains nothing
    if argv[0] != "train" and {"-h", "--help"} & set(argv):
        return ()
    if set(UNTRACKED) & set(argv) or _records_nothing(environ):
        return PRELOAD
    if store.is_server(_store_uri(argv, environ)):
        return PRELOAD + PRELOAD_TRACKING + PRELOAD_MLFLOW
    return PRELOAD + PRELOAD_TRACKING + PRELOAD_MLFLOW + PRELOAD_DATABASE


def recorder_modules(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> tuple:
    """What the recorder host imports (``tracking.host``), for a command that has one: a
    tracked ``ampsweep train`` of one run, or ``ampsweep reproduce`` (one run again); none
    for any other command (a sweep imports MLflow once for all its jobs and runs its report
    in the command's process; capacity and doctor run several trainings in theirs)."""
    if not argv or argv[0] not in ("train", "reproduce"):
        return ()
    if argv[0] == "train" and getattr(_read(argv[1:]), "multirun", True):
        return ()  # a sweep, or a line Hydra refuses
    return tuple(
        name for name in modules(argv, environ) if name in PRELOAD_MLFLOW + PRELOAD_DATABASE
    )


def _store_uri(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The store the command line names (its last ``tracking.uri=``), else MLflow's variable,
    as ``tracking.store.resolve_uri`` reads them; '' for the default (a SQLite file). A config
    file that names another store is not read here: what it needs is imported when used."""
    given = [a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("tracking.uri=")]
    return given[-1] if given else environ.get("MLFLOW_TRACKING_URI", "")


def _records_nothing(environ: Mapping[str, str]) -> bool:
    """A rank other than 0 under torchrun (what ``engine.distributed.from_env`` reads, without
    importing torch): only rank 0 records a DDP run."""
    return "WORLD_SIZE" in environ and environ.get("RANK", "0") != "0"


def _read(args: Sequence[str]):
    """The train command line as Hydra reads it (ampsweep's own ``--trust`` taken out, as the
    command does); a line Hydra's parser refuses trains nothing either: None, and the command
    itself then says why (argparse's message here is dropped, so it is said once)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return command_line.hydra_args(trust.take_trust_flags(list(args))[0])
    except SystemExit:
        return None


@dataclass(frozen=True)
class Startup:
    """Which of the pieces the program uses (all of them, but for a measurement)."""

    collector_off: bool = True
    freeze: bool = True
    fast_exit: bool = True
    recorder_host: bool = True

    def preload(self, argv: Sequence[str]) -> None:
        """Start the recorder host if the command has one, and import what the command
        ``argv`` needs, with the collector off, then freeze it."""
        names = modules(argv)
        there = recorder_modules(argv) if self.recorder_host else ()
        if there:
            uri = store.resolve_uri(_store_uri(argv, os.environ))
            warm = [uri] if store.holds_mlflow_tables(uri) else []  # to open, not to create
            recorder = host.Host.start(there, store.local_client, warm)
            host.serve_this_process(recorder)
            atexit.register(host.stop_serving)  # its last records are in when the command ends
            names = tuple(name for name in names if name not in there)
        if not names or not (self.collector_off or self.freeze):
            return  # the command imports them itself, as it goes
        if self.collector_off:
            gc.disable()
        try:
            for name in names:
                importlib.import_module(name)
        finally:
            if self.freeze:
                gc.freeze()
            gc.enable()

    def exit(self, code: int) -> NoReturn:
        """End the process with ``code`` once the command has returned."""
        if not self.fast_exit:
            sys.exit(code)
        threading._shutdown()  # what the interpreter calls first at exit  # noqa: SLF001
        atexit._run_exitfuncs()  # noqa: SLF001
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError:  # the reader went away (e.g. `ampsweep report | head`)
            code = code or 1
        os._exit(code)


def run(main: Callable[[], int], argv: Sequence[str], startup: Startup = Startup()) -> NoReturn:
    """Preload for ``argv``, run ``main()``, and end the process with its exit code."""
    startup.preload(argv)
    startup.exit(main())
