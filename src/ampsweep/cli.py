"""The ``ampsweep`` command: train, report, reproduce, ui.

Kept light at import time: torch and mlflow are imported only by the subcommands that need
them, so ``--help`` and config errors answer at once.
"""

from __future__ import annotations

import argparse
import signal
import sys

from ampsweep import __version__

HYDRA_FLAGS_WITH_VALUE = {
    "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
    "--cfg", "-c", "--package", "-p", "--experimental-rerun", "--shell-completion", "-sc",
    "--info", "-i",
}  # fmt: skip
HYDRA_INFO_FLAGS = {
    "--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i",
    "--shell-completion", "-sc", "--experimental-rerun", "--resolve",
}  # fmt: skip

TRAIN_HELP = """\
usage: ampsweep train [-m] [GROUP=OPTION | KEY=VALUE ...] [Hydra flags]

Train one configuration (or, with -m, sweep every combination) and record each run in MLflow.

  ampsweep train                                      # the default: cnn on digits, precision=auto
  ampsweep train precision=fp16 trainer.epochs=3      # one run
  ampsweep train -m precision=fp32,fp16,bf16          # a sweep: one parent run, a child per job
  ampsweep train -m experiment=precision_sweep        # the ready CPU sweep
  ampsweep train trainer.resume=auto                  # continue the newest checkpoint
  ampsweep train --config-path RUN_DIR/.hydra --config-name config   # rerun a run dir

Groups: precision, model, dataset, optimizer, trainer, tracking, experiment.
`ampsweep train --help` shows every option and the composed config (Hydra's help);
`ampsweep train --cfg job` prints the config a command would run.
"""


def split_train_args(args: list[str]) -> tuple[list[str], dict[str, str], set[str]]:
    """Hydra overrides, flags with their values, and bare flags of a train command line."""
    overrides, flags, bare = [], {}, set()
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-") and "=" in a and a.split("=", 1)[0] in HYDRA_FLAGS_WITH_VALUE:
            key, value = a.split("=", 1)
            flags[key] = value
        elif a in HYDRA_FLAGS_WITH_VALUE and i + 1 < len(args) and not args[i + 1].startswith("-"):
            flags[a] = args[i + 1]
            i += 1
        elif a.startswith("-"):
            bare.add(a)
        else:
            overrides.append(a)
        i += 1
    return overrides, flags, bare


def cmd_train(args: list[str]) -> int:
    if args and args[0] in ("--usage",):
        print(TRAIN_HELP)
        return 0
    from ampsweep import distributed

    overrides, flags, bare = split_train_args(args)
    informational = bool((bare | set(flags)) & HYDRA_INFO_FLAGS)
    multirun = bool(bare & {"-m", "--multirun"})
    rank = distributed.from_env()
    exclusive = (bare | set(flags)) & {"--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"}
    if multirun and exclusive:  # Hydra would raise a ValueError with a traceback
        from ampsweep import console

        console.error(
            f"{sorted(exclusive)[0]} cannot be combined with -m: drop -m to print the config of "
            "one job, e.g. ampsweep train --cfg job precision=fp16"
        )
        return 2
    if not informational:
        code, configs = _validate(overrides, flags, multirun, record=rank.is_main)
        if code:
            return code
        code = _check_nproc(configs, overrides, multirun, rank)
        if code is not None:
            return code
        nproc = configs[0].trainer.nproc
        if nproc > 1 and not rank.enabled and not multirun:
            return distributed.launch(args, nproc)  # each worker runs this command again
    # Under torchrun every rank runs Hydra; only rank 0 keeps a run dir and .hydra/ files.
    return run_hydra([*args, *distributed.rank_overrides(rank)], multirun, informational)


def _check_nproc(configs, overrides: list[str], multirun: bool, rank) -> int | None:
    """DDP is one training in N processes; a sweep's jobs get theirs from a launcher."""
    from ampsweep import console

    if rank.enabled and multirun:
        console.error(
            "-m under torchrun: a sweep cannot run inside one process group: run the sweep "
            "with hydra/launcher=ampsweep_slurm trainer.nproc=N instead"
        )
        return 2
    nproc = max(c.trainer.nproc for c in configs)
    own_launcher = any(
        o.startswith("hydra/launcher=") and o != "hydra/launcher=basic" for o in overrides
    )
    if multirun and nproc > 1 and not own_launcher:
        console.error(
            f"trainer.nproc={nproc} in a sweep: the jobs of a sweep run in this one process: "
            "add hydra/launcher=ampsweep_slurm (or ampsweep_local), which starts "
            "trainer.nproc processes per job, or run single jobs with trainer.nproc"
        )
        return 2
    return None


def _conf_of(flags: dict[str, str]):
    from pathlib import Path

    from ampsweep.config import config_dir

    path = flags.get("--config-path") or flags.get("-cp")
    name = flags.get("--config-name") or flags.get("-cn") or "config"
    return (Path(path).resolve() if path else config_dir()), name


def _validate(overrides: list[str], flags: dict[str, str], multirun: bool, record: bool = True):
    """Compose every job of the command before anything runs; open (create or migrate) each
    MLflow store once, here, before jobs in other processes start writing to it."""
    from ampsweep import console, tracking
    from ampsweep.config import validate_command
    from ampsweep.schema import ConfigError, Tracker

    conf, name = _conf_of(flags)
    try:
        configs = validate_command(overrides, multirun, conf, name)
        stores = {
            tracking.resolve_uri(c.tracking.uri): tracking.uri_key(c.tracking.uri)
            for c in configs
            if c.tracking.backend == Tracker.mlflow
        }
        for uri, key in sorted(stores.items()) if record else []:
            tracking.check_store(uri, key)  # an unreachable server fails here, before training
            tracking.prepare_store(uri)
    except ConfigError as err:
        console.error(str(err))
        return 2, []
    if multirun:
        from ampsweep.runner import expected_run_name
        from ampsweep.sweep import name_counts

        name_counts([expected_run_name(c) for c in configs if not c.tracking.run_name])
    return 0, configs


def run_hydra(args: list[str], multirun: bool, informational: bool) -> int:
    import hydra

    from ampsweep import console, runner, sweep
    from ampsweep.config import config_dir
    from ampsweep.schema import register_configs

    register_configs()
    main = hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(
        runner.hydra_task
    )
    argv = sys.argv
    sys.argv = ["ampsweep-train", *args]
    runner.OUTCOMES.clear()
    sweep.ACTIVE = None
    interrupted = False
    hydra_code = 0
    result = None
    # SIGTERM (a scheduler's stop) ends the command like Ctrl-C: the parent run is ended and
    # the exit is non-zero. Inside a job, runner.StopRequest first writes a checkpoint.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        main()
    except KeyboardInterrupt:
        interrupted = True
    except SystemExit as exc:  # Hydra exits on its own errors (already printed)
        hydra_code = exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.argv = argv
        # The callback's end hook normally ended the parent already; Hydra skips that hook
        # when a launcher raises, so end it here too (finish acts once).
        if sweep.ACTIVE is not None:
            result = sweep.finish(sweep.ACTIVE, interrupted)
    if interrupted:
        console.error("interrupted")
        return runner.EXIT_KILLED
    if informational:
        return hydra_code
    if multirun:
        return _sweep_exit(result, hydra_code)
    failed = [o for o in runner.OUTCOMES if o.status != "FINISHED"]
    if failed:
        return max(o.exit_code for o in failed)
    return hydra_code


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _sweep_exit(result, hydra_code: int) -> int:
    """Name every job that did not finish and return non-zero if any. The store is the
    source of truth (jobs may have run in other processes); outcomes of this process add
    the jobs that could not record a run at all."""
    from ampsweep import console, runner

    recorded = {r.info.run_id for r in result.runs} if result else set()
    problems = result.describe_failures() if result else []
    total = len(result.runs) + result.missing if result else len(runner.OUTCOMES)
    unrecorded = [o for o in runner.OUTCOMES if o.status != "FINISHED" and o.run_id not in recorded]
    problems += [f"#{o.job_num} {o.name} ({o.error or o.status}, not recorded)" for o in unrecorded]
    elsewhere = (result.missing if result else 0) - len(unrecorded)
    if elsewhere > 0:  # jobs in other processes that never reached the store
        problems.append(f"{elsewhere} job(s) recorded no run")
    if problems:
        console.error(f"{len(problems)} of {total} jobs failed: {'; '.join(problems)}")
        return 1
    return hydra_code


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
    from ampsweep import reproduce

    reproduce.add_parser(sub)
    store_help = "MLflow store (default: $MLFLOW_TRACKING_URI, else outputs/mlflow.db here)"
    rep = sub.add_parser(
        "report",
        help="compare the precision modes of a sweep against fp32",
        description="One row per run of a sweep, compared with the fp32 run of the same config, "
        "and findings in plain words.",
    )
    rep.add_argument("--sweep", default="latest", help="'latest' (default) or a parent run id")
    rep.add_argument("--experiment", help="look for the latest sweep only in this experiment")
    rep.add_argument(
        "--format", choices=["table", "markdown", "csv", "json"], default="table", dest="fmt"
    )
    rep.add_argument("--baseline", default="fp32", help="the mode to compare with (default fp32)")
    rep.add_argument("--tracking-uri", help=store_help)
    rep.set_defaults(func=cmd_report)
    ui = sub.add_parser("ui", help="open the MLflow UI over ampsweep's store")
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    ui.add_argument("--tracking-uri", help=store_help)
    ui.set_defaults(func=cmd_ui)
    return parser


def _open_store(uri_arg: str | None):
    """A client for an existing store (a report must not create an empty one)."""
    from pathlib import Path

    from ampsweep import tracking

    uri = tracking.resolve_uri(uri_arg)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        from ampsweep.report import ReportError

        raise ReportError(
            f"no MLflow store at {tracking.describe_store(uri)}: run a sweep first "
            "(ampsweep train -m experiment=precision_sweep), or pass --tracking-uri"
        )
    tracking.check_store(uri, key="--tracking-uri")
    return tracking.client_for(uri)


def cmd_report(args) -> int:
    from ampsweep import console, report
    from ampsweep.schema import ConfigError, Mode

    if args.baseline not in Mode.__members__ or args.baseline == "auto":
        modes = ", ".join(m for m in Mode.__members__ if m != "auto")
        console.error(f"--baseline {args.baseline}: not a precision mode: choose one of {modes}")
        return 2
    try:
        client = _open_store(args.tracking_uri)
        parent = report.find_sweep(client, args.sweep, args.experiment)
        sweep, runs = report.load_sweep(client, parent)
    except (report.ReportError, ConfigError) as err:
        console.error(str(err))
        return 2
    rep = report.make_report(sweep, runs, args.baseline)
    text = report.render(rep, args.fmt)
    if text is not None:
        sys.stdout.write(text)
    return 0


def cmd_ui(args) -> int:
    from ampsweep import console, tracking, ui
    from ampsweep.schema import ConfigError

    try:
        return ui.serve(tracking.resolve_uri(args.tracking_uri), args.host, args.port)
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
        return cmd_train(argv[1:])
    args = parser.parse_args(argv)
    return args.func(args)
