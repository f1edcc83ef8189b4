"""The ``ampsweep`` command: train, report, reproduce, capacity, doctor, ui.

Kept light at import time: torch and mlflow are imported only by the subcommands that need
them, so ``--help`` and config errors answer at once.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys
import threading

from ampsweep import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampsweep",
        description="Measure what mixed precision buys on your model, data and hardware.",
    )
    parser.add_argument("--version", action="version", version=f"ampsweep {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "train", help="train one config, or sweep with -m (Hydra overrides follow)", add_help=False
    )
    from ampsweep.app import capacity, doctor, repair, reproduce
    from ampsweep.precision.modes import BASELINE
    from ampsweep.tracking import store

    reproduce.add_parser(sub)
    repair.add_parser(sub)
    capacity.add_parser(sub)
    doctor.add_parser(sub)
    store_help = store.STORE_HELP
    rep = sub.add_parser(
        "report",
        help="compare the precision modes of a sweep against fp32",
        description="One row per run of a sweep, compared with the fp32 run of the same config, "
        "and findings in plain words.",
    )
    rep.add_argument("--sweep", default="latest", help="'latest' (default) or a parent run id")
    rep.add_argument("--experiment", help="look for the latest sweep only in this experiment")
    rep.add_argument(
        "--format",
        choices=["table", "markdown", "csv", "json"],
        default="table",
        dest="fmt",
        help="table (the default, at the console), markdown, csv or json (every column)",
    )
    rep.add_argument(
        "--wide", action="store_true", help="every column in the table (default: fits 100 columns)"
    )
    rep.add_argument(
        "--baseline", default=BASELINE, help=f"the mode to compare with (default {BASELINE})"
    )
    rep.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="the largest batch each mode fits in this memory, e.g. 80GiB (default on CUDA: "
        "the GPU's memory; on a CPU: no max batch column)",
    )
    rep.add_argument(
        "--target",
        type=float,
        help="the quality whose time to reach the report measures, in the runs' own metric "
        "(validation accuracy, or perplexity for a language model), e.g. 0.95; default: within "
        "0.5 points of the baseline's final accuracy, or 2%% of its final perplexity",
    )
    rep.add_argument("--tracking-uri", help=store_help)
    rep.set_defaults(func=cmd_report)
    ui = sub.add_parser("ui", help="open the MLflow UI over ampsweep's store")
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    ui.add_argument(
        "--allowed-hosts",
        help="Host headers other machines use to reach it, comma-separated (e.g. "
        "mlflow.lab.example:5000,10.0.0.7:5000); MLflow refuses others with 403",
    )
    ui.add_argument(
        "--cors-allowed-origins", help="browser origins allowed to call its API, comma-separated"
    )
    ui.add_argument("--tracking-uri", help=store_help)
    ui.add_argument(
        "--team",
        action="store_true",
        help="require logins (MLflow's basic-auth: users and per-experiment permissions in "
        "mlflow-auth.db beside the store; the first start needs MLFLOW_AUTH_ADMIN_PASSWORD)",
    )
    ui.set_defaults(func=cmd_ui)
    return parser


def _open_store(uri_arg: str | None):
    """A client for an existing store (a report must not create an empty one)."""
    from ampsweep.report.sweeps import ReportError
    from ampsweep.tracking import store

    uri = store.resolve_uri(uri_arg)
    path = store.sqlite_path(uri)
    if path is not None and not path.is_file():
        raise ReportError(
            f"no MLflow store at {store.describe(uri)}: run a sweep first "
            "(ampsweep train -m experiment=precision_sweep), or pass --tracking-uri"
        )
    store.check(uri, key="--tracking-uri")
    return store.client_for(uri)


def cmd_report(args) -> int:
    from ampsweep.app import capacity, console
    from ampsweep.config.schema import ConfigError
    from ampsweep.precision.modes import MODES
    from ampsweep.report import render, sweeps

    if args.baseline not in MODES:
        choices = ", ".join(MODES)
        console.error(f"--baseline {args.baseline}: not a precision mode: choose one of {choices}")
        return 2
    from ampsweep.tracking import store

    try:
        budget = capacity.parse_budget(args.memory_budget)
        client = _open_store(args.tracking_uri)
        parent, passed_over = sweeps.find_sweep(client, args.sweep, args.experiment)
        sweep, runs = sweeps.load_sweep(client, parent)
    except (sweeps.ReportError, ConfigError) as err:
        console.error(str(err))
        return 2
    except Exception as err:  # the store itself failed: its one line, if it is one we know
        known = store.fault(err, store.resolve_uri(args.tracking_uri), "--tracking-uri")
        if known is None:
            raise
        console.error(str(known))
        return 2 if isinstance(known, ConfigError) else 1
    for empty in passed_over:
        console.note(
            f"skipped the newer sweep {empty.info.run_name} ({empty.info.run_id}): it has no runs"
        )
    rep = sweeps.make_report(sweep, runs, args.baseline, budget, args.target)
    text = render.render(rep, args.fmt, console.console, wide=args.wide)
    if text is not None:
        sys.stdout.write(text)
    return 0


def cmd_ui(args) -> int:
    from ampsweep.app import console, ui
    from ampsweep.config.schema import ConfigError
    from ampsweep.tracking import store

    try:
        uri = store.resolve_uri(args.tracking_uri)
        return ui.serve(
            uri, args.host, args.port, args.allowed_hosts, args.cors_allowed_origins, args.team
        )
    except (ui.UIError, ConfigError) as err:
        console.error(str(err))
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] == "train":
        from ampsweep.app.train import cmd_train

        return cmd_train(argv[1:])
    if argv[0].split("=")[0] in ("-sc", "--shell-completion"):
        # What the shell completion `ampsweep train -sc install=bash` installed calls back:
        # `ampsweep -sc query=bash`, with the line typed so far in COMP_LINE
        from ampsweep.app.train import cmd_train

        return cmd_train(argv)
    args = parser.parse_args(argv)
    return args.func(args)


# What the commands that train import: torch with its compiler (the optimizer imports it),
# MLflow's store, Hydra. While they import, Python runs full garbage collections over the
# growing heap that find nothing: about 1.1 s of the 5.5 s of CPU of a default `ampsweep train`
# on 2 cores. Imported up front with the collector off, then frozen, no collection scans them.
# MLflow's SQLite store is among them: the default store (a 1-step run 3.12 s with it here,
# 3.33 s without), though runs with tracking=none or a server then import it for nothing (0.3 s).
# torch._dynamo is private to torch, and what its optimizers import (torch 2.14.1; the public
# torch.compiler does not import it): tests/unit/app/test_cli.py fails if it moves.
TRAINING_COMMANDS = ("train", "reproduce", "capacity", "doctor")
PRELOAD = (
    "torch", "torch._dynamo", "hydra", "mlflow", "mlflow.store.tracking.sqlalchemy_store",
    "ampsweep.engine.components", "ampsweep.tracking.sweep", "ampsweep.app.job",
)  # fmt: skip


def preload(argv: list[str]) -> None:
    """Import what a training command needs with the garbage collector off, then freeze it."""
    if not argv or argv[0] not in TRAINING_COMMANDS or "--usage" in argv:
        return
    from ampsweep.app.hydra_app import hydra_args, informational

    if argv[0] == "train" and informational(hydra_args(argv[1:])):
        return  # printing the config or a help trains nothing
    gc.disable()
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        gc.freeze()
        gc.enable()


def run() -> None:
    """The ``ampsweep`` program (the console script and ``python -m ampsweep``): ``main()``,
    then the interpreter's own way out minus its teardown.

    When ``main()`` has returned, every run is ended, every file written and every child
    process waited for. What CPython does next is, in order: join the non-daemon threads
    (``threading._shutdown``, which also stops idle executor workers), call the exit handlers
    (temporary folders removed, log handlers flushed), flush the standard streams, and then free
    every module and object one by one, which after importing torch (with dynamo), MLflow's
    store and Hydra takes about 1.4 s on a 2-core CPU: a quarter of a one-step run. The first
    three are done here as CPython does them; the last is skipped with ``os._exit`` (mypy ends
    the same way, for the same reason). An exception or SystemExit from ``main()`` takes
    Python's usual way out.
    """
    preload(sys.argv[1:])
    code = main()
    # Private, with no public equivalent: what the interpreter itself calls at exit (checked
    # on CPython 3.11; tests/unit/app/test_cli.py fails if they move).
    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader went away (e.g. `ampsweep report | head`)
        code = code or 1
    os._exit(code)
