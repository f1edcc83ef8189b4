"""``ampsweep train``: validate every job of the command, then run them through Hydra.

compose (Hydra) -> validate (``config``: the shared keys; ``engine.components``: each
builder's own settings) for every job of the command before anything runs or touches the
MLflow store -> for a sweep, its parent run -> Hydra runs each job (``app.job``) -> for a
sweep, its report and the parent's end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from ampsweep.app import console, scoped_env, trust
from ampsweep.app.job import EXIT_KILLED, CommandContext, TaskFunction
from ampsweep.config.schema import Config, ConfigError, Tracker
from ampsweep.errors import FaultError
from ampsweep.tracking.recorder import RunCloser
from ampsweep.tracking.secrets import refuse_in_name

HYDRA_FLAGS_WITH_VALUE = {
    "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
    "--cfg", "-c", "--package", "-p", "--experimental-rerun", "--shell-completion", "-sc",
    "--info", "-i",
}  # fmt: skip

TRAIN_HELP = """\
usage: ampsweep train [-m] [GROUP=OPTION | KEY=VALUE ...] [Hydra flags]

Train one configuration (or, with -m, sweep every combination) and record each run in MLflow.

  ampsweep train                                      # the default: cnn on digits, precision=auto
  ampsweep train precision=fp16 trainer.epochs=3      # one run
  ampsweep train -m precision=fp32,fp16,bf16          # a sweep: one parent run, a child per job
  ampsweep train -m experiment=precision_sweep        # the ready CPU sweep
  ampsweep train -m experiment=precision_sweep_lm     # the same for a small GPT on text
  ampsweep train --config-dir ./conf model=my_net dataset=my_data   # your own config folder
  ampsweep train -m experiment=precision_sweep sweep.repeats=3   # 3 seeds each: intervals
  ampsweep train trainer.resume=auto                  # continue the newest checkpoint
  ampsweep train --config-path RUN_DIR/.hydra --config-name config   # rerun a run dir
  ampsweep train --config-path RUN_DIR/.hydra --config-name config --trust mypkg
                                   # ... whose _target_ code is mypkg's, from another folder

Groups: precision, model, dataset, optimizer, task, loss, trainer, tracking, experiment.
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


CONFIG_PATH_FLAGS = {"--config-path", "-cp", "--config-dir", "-cd"}


def absolute_config_paths(args: list[str]) -> list[str]:
    """``--config-path``/``--config-dir`` made absolute: Hydra reads a relative config path
    relative to the module that calls it (inside ampsweep), not the folder the user is in."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        key, eq, value = a.partition("=")
        if eq and key in CONFIG_PATH_FLAGS:
            out.append(f"{key}={Path(value).expanduser().resolve()}")
        elif a in CONFIG_PATH_FLAGS and i + 1 < len(args):
            out += [a, str(Path(args[i + 1]).expanduser().resolve())]
            i += 1
        else:
            out.append(a)
        i += 1
    return out


def cmd_train(args: list[str], command: CommandContext | None = None) -> int:
    """The train command; ``command`` carries what a caller adds (e.g. reproduce's tags) and
    receives the jobs' outcomes."""
    if args and args[0] in ("--usage",):
        print(TRAIN_HELP)
        return 0
    from ampsweep.config.compose import (
        HYDRA_INFO_FLAGS,
        normalise_overrides,
        saved_config_overrides,
    )
    from ampsweep.engine import distributed

    command = command or CommandContext(extra_tags=_tags_from_launcher())
    args, trusted = trust.take_trust_flags(args)  # ours, not Hydra's
    args = absolute_config_paths(args)
    args = normalise_overrides(args)  # model.args.<key>=v: add or set, as the help says
    overrides, flags, bare = split_train_args(args)
    informational = bool((bare | set(flags)) & HYDRA_INFO_FLAGS)
    multirun = bool(bare & {"-m", "--multirun"})
    rank = distributed.from_env()
    exclusive = (bare | set(flags)) & {"--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"}
    if multirun and exclusive:  # Hydra would raise a ValueError with a traceback
        console.error(
            f"{sorted(exclusive)[0]} cannot be combined with -m: drop -m to print the config of "
            "one job, e.g. ampsweep train --cfg job precision=fp16"
        )
        return 2
    if informational:
        return run_hydra(args, command)
    conf, name, search = _conf_of(flags)
    command_args = args  # what the sweep's parent records: the command as typed
    saved = saved_config_overrides(conf, name, overrides)  # rerunning RUN_DIR/.hydra/config
    code = _check_saved_trust(conf, name, overrides, search, trusted)
    if code:
        return code
    args, overrides = [*args, *saved], [*overrides, *saved]
    if multirun:
        code, args, overrides = _repeats_as_seeds(args, overrides, conf, name, search)
        if code:
            return code
    code, configs = validate(overrides, conf, name, multirun, record=rank.is_main, search=search)
    if code:
        return code
    code = _check_nproc(configs, overrides, multirun, rank)
    if code is None and multirun:
        code = _check_launcher(overrides, configs, conf, name, search)
    if code is not None:
        return code
    nproc = configs[0].trainer.nproc
    if nproc > 1 and not rank.enabled and not multirun:
        code = _check_data(configs[0])  # in the parent: a config error before any rank starts
        if code:
            return code
        try:
            tags = json.dumps(command.extra_tags) if command.extra_tags else None
            with scoped_env.setenv(RANK_TAGS_ENV, tags):
                failure = distributed.launch(args, nproc)  # each worker runs this command again
        except distributed.LaunchError as err:
            console.error(str(err))
            return 1
        return _rank_exit(failure, nproc)
    # Under torchrun every rank runs Hydra; only rank 0 keeps a run dir and .hydra/ files.
    args = [*args, *distributed.rank_overrides(rank)]
    if not multirun:
        try:
            code = run_hydra(args, command)
            command.closer.wait()  # the run has ended (a no-op: single runs end at once)
            return _exit_code(command, code)
        except KeyboardInterrupt as err:
            who = f"rank {rank.rank}: " if rank.enabled else ""  # the launcher may have stopped it
            console.error(f"{who}interrupted" + (f" ({err})" if rank.enabled else ""))
            return EXIT_KILLED
    return run_sweep(
        args, overrides, configs, conf, name, command, rank.is_main, search, command_args
    )


def _check_data(cfg: Config) -> int:
    """Load the data set once, as each rank will: a missing one is the command's one-line
    config error here, not a race between a failing rank and the ones the launcher stops."""
    from ampsweep.engine import data

    try:
        data.load(cfg.dataset, cfg.task.name)
    except ConfigError as err:
        console.error(str(err))
        return 2
    return 0


def _rank_exit(failure, nproc: int) -> int:
    """The failing rank's exit code; it printed its own error (a config error's one line)."""
    if failure is None:
        return 0
    if failure.exit_code != 2:
        console.error(
            f"trainer.nproc={nproc}: rank {failure.rank} failed with exit code "
            f"{failure.exit_code} (its error is above); the launcher stopped the other ranks"
        )
    return failure.exit_code


def _check_saved_trust(
    conf: Path, name: str, overrides: list[str], search: list[str], named: list[str]
) -> int:
    """A run dir's saved config (no defaults list: Hydra wrote it, maybe on another machine)
    names only code this project trusts, checked before anything is imported."""
    from omegaconf import OmegaConf

    from ampsweep.config.compose import config_dir

    path = Path(conf) / f"{name}.yaml"
    if not path.is_file() or path.resolve().parent == config_dir().resolve():
        return 0
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # not YAML: Hydra says so when it composes
        return 0
    if not isinstance(saved, dict) or "defaults" in saved or "hydra" in saved:
        return 0  # a primary config the user wrote, not a saved one
    folders = [Path(e.removeprefix("file://")).parent for e in search if "://" not in
               e.removeprefix("file://")]  # the project a --config-dir belongs to  # fmt: skip
    try:
        trust.check(saved, trust.Trust.here(named, folders), skip=trust.overridden(overrides))
    except ConfigError as err:
        console.error(f"{path}: {err}")
        return 2
    return 0


def _repeats_as_seeds(
    args: list[str], overrides: list[str], conf: Path, name: str, search: list[str]
) -> tuple[int, list[str], list[str]]:
    """The command line with ``sweep.repeats=N`` turned into the seed sweep Hydra runs."""
    from ampsweep.config.compose import repeat_overrides

    try:
        drop, add, _ = repeat_overrides(overrides, conf, name, search)
    except ConfigError as err:
        console.error(str(err))
        return 2, args, overrides
    keep = [a for a in args if a not in drop]
    return 0, keep + add, [o for o in overrides if o not in drop] + add


def _check_nproc(configs, overrides: list[str], multirun: bool, rank) -> int | None:
    """DDP is one training in N processes; a sweep's jobs get theirs from a launcher."""
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


def _check_launcher(
    overrides: list[str], configs, conf: Path, name: str, search: list[str]
) -> int | None:
    """A sweep through SLURM is checked against the cluster before its parent run exists."""
    from ampsweep.app import slurm

    try:
        notes = slurm.check_sweep(overrides, configs, conf, name, search)
    except ConfigError as err:
        console.error(str(err))
        return 2
    for note in notes:
        console.note(note)
    return None


def _conf_of(flags: dict[str, str]) -> tuple[Path, str, list[str]]:
    """The primary config folder, the config's name, and the user's config folder
    (``--config-dir``: its group files sit beside ampsweep's) as a search path entry."""
    from ampsweep.config.compose import config_dir, search_entry

    path = flags.get("--config-path") or flags.get("-cp")
    name = flags.get("--config-name") or flags.get("-cn") or "config"
    extra = flags.get("--config-dir") or flags.get("-cd")
    search = [search_entry(extra)] if extra else []
    return (Path(path).resolve() if path else config_dir()), name, search


def validate(
    overrides: list[str],
    conf: Path,
    name: str,
    multirun: bool,
    record: bool = True,
    search: list[str] | None = None,
) -> tuple[int, list[Config]]:
    """Compose and check every job of the command before anything runs; open (create or
    migrate) each MLflow store once, here, before jobs in other processes write to it."""
    from ampsweep.app.repair import replay_journals
    from ampsweep.config.compose import validate_command
    from ampsweep.engine.checkpoint import root_of
    from ampsweep.tracking import access, store

    try:
        configs = validate_command(overrides, multirun, conf, name, search or ())
        refused = {refuse_in_name("tracking.experiment", c.tracking.experiment) for c in configs}
        if refused - {None}:
            raise ConfigError(sorted(refused - {None})[0])
        from ampsweep.engine import components  # torch: only once the shared keys are good
        from ampsweep.engine.build import preflight

        configs = [components.resolve(c) for c in configs]
        preflight(configs)  # e.g. fp8 without torchao, or on a model it would not change
        stores = {
            store.resolve_uri(c.tracking.uri): store.uri_key(c.tracking.uri)
            for c in configs
            if c.tracking.backend == Tracker.mlflow
        }
        for uri, key in sorted(stores.items()) if record else []:
            store.check(uri, key)  # an unreachable server fails here, before training
            store.prepare(uri)
            roots = [root_of(c) for c in configs if store.resolve_uri(c.tracking.uri) == uri]
            for line in replay_journals(uri, roots):  # what an outage kept, written now
                console.note(line)
        for uri, experiment in sorted(_experiments(configs)) if record else []:
            access.check_write(uri, experiment, stores[uri])  # a login the server refuses
    except ConfigError as err:
        console.error(str(err))
        return 2, []
    except FaultError as err:  # the store cannot be written (locked, full)
        console.error(str(err))
        return 1, []
    return 0, configs


def _experiments(configs: list[Config]) -> set[tuple[str, str]]:
    from ampsweep.tracking import store

    return {
        (store.resolve_uri(c.tracking.uri), c.tracking.experiment)
        for c in configs
        if c.tracking.backend == Tracker.mlflow
    }


# The tags a caller adds to the run (reproduce's ``reproduces=<run id>``) reach the ranks of a
# trainer.nproc>1 command through their environment: each rank runs `ampsweep train` anew, and
# rank 0 records the run.
RANK_TAGS_ENV = "AMPSWEEP_RUN_TAGS"


def _tags_from_launcher() -> dict[str, str]:
    text = os.environ.get(RANK_TAGS_ENV)
    return json.loads(text) if text else {}


def run_hydra(args: list[str], command: CommandContext) -> int:
    """Hand the command line to Hydra, which runs each job through ``TaskFunction``; the exit
    code of Hydra itself (its own errors are printed by Hydra)."""
    import hydra

    from ampsweep.app import launcher
    from ampsweep.config.compose import config_dir
    from ampsweep.config.schema import register_configs

    register_configs()
    launcher.register()
    main = hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(
        TaskFunction(command)
    )
    argv = sys.argv
    sys.argv = ["ampsweep-train", *args]
    # SIGTERM (a scheduler's stop) ends the command like Ctrl-C: a sweep's parent run is ended
    # and the exit is non-zero. Inside a job, the job's StopRequest first writes a checkpoint.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        main()
    except SystemExit as exc:  # Hydra exits on its own errors (already printed)
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        sys.argv = argv
    return 0


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _exit_code(command: CommandContext, hydra_code: int) -> int:
    failed = [o for o in command.outcomes if o.status != "FINISHED"]
    if failed:
        return max(o.exit_code for o in failed)
    return hydra_code


def run_sweep(
    args: list[str],
    overrides: list[str],
    configs: list[Config],
    conf: Path,
    name: str,
    command: CommandContext,
    is_main: bool,
    search: list[str] | None = None,
    command_args: list[str] | None = None,
) -> int:
    """A multirun: the parent run first (in the sweep dir Hydra is told to use), the jobs,
    then the report and the parent's end, whatever happened to the jobs. ``command_args``:
    the command line as typed (recorded on the parent), before ``sweep.repeats`` became seeds."""
    from ampsweep.app import sweep
    from ampsweep.config.compose import expand_sweep, is_hydra_override

    # Hydra's own settings (hydra.sweep.dir=..., a saved config's run settings) apply as given.
    hydra_settings = [o for o in overrides if is_hydra_override(o)]
    first_job = expand_sweep([o for o in overrides if not is_hydra_override(o)])[0]
    sweep_dir, label = sweep.plan_dir([*first_job, *hydra_settings], conf, name, search)
    typed = command_args or args
    if is_main:  # a mode known to be slow here is said before the sweep starts
        import torch

        from ampsweep.app import estimate

        for note in estimate.slow_mode_notes(
            configs, torch.cuda.is_available(), estimate.cpu_flags()
        ):
            console.note(note)
    command.plan = [c.precision.name for c in configs]  # each job's estimate of the rest
    command.sweep = sweep.begin(configs, typed, sweep_dir, label) if is_main else None
    # Jobs run in this process: each one's model is logged while the next trains. (A launcher
    # that runs jobs elsewhere gets a copy of the context that ends its runs at once.)
    command.closer = RunCloser(background=True)
    interrupted, hydra_code, result = False, 0, None
    try:
        hydra_code = run_hydra([*args, f"hydra.sweep.dir={sweep_dir}"], command)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        try:
            command.closer.wait()  # every job's run has ended before the sweep is concluded
        finally:  # (a second Ctrl-C while waiting still ends the parent)
            if command.sweep is not None:
                result = sweep.finish(command.sweep, interrupted)
    if interrupted:
        console.error("interrupted")
        return EXIT_KILLED
    return _sweep_exit(result, command, hydra_code)


def _sweep_exit(result, command: CommandContext, hydra_code: int) -> int:
    """Name every job that did not finish and return non-zero if any. The store is the
    source of truth (jobs may have run in other processes); outcomes of this process add
    the jobs that could not record a run at all."""
    outcomes = command.outcomes
    recorded = {r.info.run_id for r in result.runs} if result else set()
    problems = result.describe_failures() if result else []
    total = len(result.runs) + result.skipped + result.missing if result else len(outcomes)
    unrecorded = [o for o in outcomes if o.status != "FINISHED" and o.run_id not in recorded]
    problems += [f"#{o.job_num} {o.name} ({o.status}, not recorded)" for o in unrecorded]
    elsewhere = (result.missing if result else 0) - len(unrecorded)
    if elsewhere > 0:  # jobs in other processes that never reached the store
        problems.append(f"{elsewhere} job(s) recorded no run")
    if problems:
        console.error(f"{len(problems)} of {total} jobs failed: {'; '.join(problems)}")
        return 1
    return hydra_code
