"""The ``ampsweep`` command: train, report, reproduce, capacity, doctor, ui.

Kept light at import time: torch and MLflow are imported only by the subcommands that need
them, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys

from ampsweep import __version__, console
from ampsweep.cli import capacity, doctor, predict, repair, reproduce, ui
from ampsweep.config.schema import ConfigError
from ampsweep.measure import roofline
from ampsweep.precision.modes import BASELINE, MODES
from ampsweep.report import render, sweeps
from ampsweep.report.sweeps import ReportError
from ampsweep.tracking import store
from ampsweep.tracking import sweep as tracked_sweep


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
    reproduce.add_parser(sub)
    repair.add_parser(sub)
    capacity.add_parser(sub)
    predict.add_parser(sub)
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
        help="the quality whose time to reach the report measures, in the unit of the runs' "
        "score (their task's: validation accuracy, perplexity for a language model), e.g. "
        "0.95; default: as near the baseline's final score as the score says (0.5 points of "
        "its accuracy, 2%% of its perplexity)",
    )
    rep.add_argument(
        "--gpu",
        metavar="NAME",
        help="add each mode's speed-up predicted on this GPU (h100, a100, l4, ...: ampsweep "
        "predict) for the baseline run's model and batch",
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
    if args.baseline not in MODES:
        choices = ", ".join(MODES)
        console.error(f"--baseline {args.baseline}: not a precision mode: choose one of {choices}")
        return 2
    try:
        gpu = roofline.gpu_spec(args.gpu) if args.gpu else None
    except ValueError as err:  # an unknown GPU: one line naming the known ones
        console.error(str(err))
        return 2
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
    if gpu is not None:  # builds the baseline's model: only when asked
        base = next((r for r in runs if r.precision == args.baseline), runs[0])
        rep.findings.append(predict.for_report(gpu, base.tags.get(store.OVERRIDES, "").split()))
    text = render.render(rep, args.fmt, console.console, wide=args.wide)
    if text is not None:
        sys.stdout.write(text)
    if store.REPORT_MISSING in parent.data.tags:  # a signal stopped it as the sweep ended
        sweeps.publish(client, rep)
        tracked_sweep.report_written(client, parent)
        console.note(
            f"the sweep's report was missing: now logged to its parent run "
            f"{parent.info.run_id} ({parent.info.run_name})"
        )
    return 0


def cmd_ui(args) -> int:
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
    # What the shell completion `ampsweep train -sc install=bash` installed calls back:
    # `ampsweep -sc query=bash`, with the line typed so far in COMP_LINE
    completion = argv[0].split("=")[0] in ("-sc", "--shell-completion")
    if argv[0] == "train" or completion:
        # Imported here: cli.train imports the engine (torch); report, ui and repair never
        # import torch.
        from ampsweep.cli.train import cmd_train

        return cmd_train(argv if completion else argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)


def run() -> None:
    """The ``ampsweep`` program (the console script and ``python -m ampsweep``): ``main()``,
    its return value the exit code."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (e.g. `ampsweep report | head`)
        # Python's own flush at exit would fail again, with a traceback: point stdout at
        # nothing first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
