"""``ampsweep train``: plan every job of the command, then run them through Hydra.

The command line is read by Hydra's own parser. A single run is composed once, by Hydra's own
loader (``launch.hydra_app.composed_run``), then checked and planned (``runner.plan``), then run by
Hydra from that composition. A sweep is expanded by Hydra's sweeper (ampsweep's by
default, any other with ``hydra/sweeper=...``), which composes each job once and hands each
batch to this command's checks (``runner.plan.SweepChecks``) before launching it: every
problem is said before the sweep's parent run exists -> Hydra runs each job (``runner.job``) as
planned -> for a sweep, its report and the parent's end.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
from pathlib import Path

import torch
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ampsweep import console
from ampsweep.cli import trust
from ampsweep.config.compose import config_dir, override_key, saved_config_overrides
from ampsweep.config.messages import CALLBACKS
from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine import data, distributed
from ampsweep.errors import FaultError
from ampsweep.launch import slurm, sweep
from ampsweep.launch.hydra_app import (
    SingleRun,
    composed_run,
    config_of,
    hydra_args,
    informational,
    run_hydra,
    setenv,
)
from ampsweep.runner import estimate, plan
from ampsweep.runner.context import EXIT_KILLED, CommandContext, PlannedJob
from ampsweep.tracking import store

TRAIN_HELP = """\
usage: ampsweep train [-m] [GROUP=OPTION | KEY=VALUE ...] [Hydra flags]

Train one configuration (or, with -m, sweep every combination) and record each run in MLflow.

  ampsweep train                                      # the default: cnn on digits, precision=auto
  ampsweep train precision=fp16 trainer.epochs=3      # one run
  ampsweep train -m precision=fp32,fp16,bf16          # a sweep: one parent run, a child per job
  ampsweep train -m experiment=precision_sweep        # the ready CPU sweep
  ampsweep train -m 'precision=glob(*,exclude=[fp8*,tf32,auto])'   # Hydra's sweep grammar
  ampsweep train -m hydra/sweeper=optuna 'precision=choice(fp32,bf16)' \\
      'optimizer.lr=interval(1e-4,1e-2)' hydra.sweeper.n_trials=20   # a search (ampsweep[optuna])
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


def cmd_train(args: list[str], command: CommandContext | None = None) -> int:
    """The train command; ``command`` carries what a caller adds (e.g. reproduce's tags) and
    receives the jobs' outcomes."""
    if args and args[0] in ("--usage",):
        print(TRAIN_HELP)
        return 0
    command = command or CommandContext(extra_tags=_tags_from_launcher())
    try:
        return _train(args, command)
    except KeyboardInterrupt:  # composing or planning: no job had begun
        return interrupted(command, args)


def _train(args: list[str], command: CommandContext) -> int:
    args, trusted = trust.take_trust_flags(args)  # ours, not Hydra's
    parsed = hydra_args(args)
    rank = distributed.from_env()
    exclusive = parsed.cfg or parsed.info or parsed.shell_completion
    if parsed.multirun and exclusive:  # Hydra would raise a ValueError with a traceback
        flag = "--cfg" if parsed.cfg else "--info" if parsed.info else "--shell-completion"
        console.error(
            f"{flag} cannot be combined with -m: drop -m to print the config of one job, e.g. "
            "ampsweep train --cfg job precision=fp16"
        )
        return 2
    if informational(parsed):
        return run_hydra(parsed, command)
    conf, name, search = config_of(parsed)
    overrides = parsed.overrides
    saved = saved_config_overrides(conf, name, overrides)  # rerunning RUN_DIR/.hydra/config
    code = _check_saved_trust(conf, name, overrides, search, trusted)
    if code:
        return code
    parsed.overrides = [*overrides, *saved]
    if not parsed.multirun:
        single_code = _single(parsed, command, [*args, *saved])
        if single_code is not None:
            return single_code
        parsed.multirun = True  # the config's own hydra.mode=MULTIRUN: Hydra sweeps it
    if rank.enabled:
        console.error(
            "-m under torchrun: a sweep cannot run inside one process group: run the sweep "
            "with hydra/launcher=ampsweep_slurm trainer.nproc=N instead"
        )
        return 2
    return run_sweep(parsed, command, args)


def _single(parsed: argparse.Namespace, command: CommandContext, args: list[str]) -> int | None:
    """A command without -m: composed once, planned, run. None when its config asks for a
    sweep itself (``hydra.mode: MULTIRUN``, e.g. in an experiment file), which Hydra runs as
    if -m were given."""
    rank = distributed.from_env()
    single_run = copy.copy(parsed)
    # Under torchrun every rank runs Hydra; only rank 0 keeps a run dir and .hydra/ files.
    single_run.overrides = [*parsed.overrides, *distributed.rank_overrides(rank)]
    try:
        with composed_run(single_run) as single:
            if single.node.hydra.mode == RunMode.MULTIRUN:
                return None
            code, planned = validate(single.node, record=rank.is_main)
            if planned is None:
                return code
            return _run_single(single, planned, single_run, command, args)
    except ConfigError as err:  # Hydra's, composing the command
        console.error(str(err))
        return 2


def _run_single(
    single: SingleRun,
    planned: PlannedJob,
    parsed: argparse.Namespace,
    command: CommandContext,
    args: list[str],
) -> int:
    """Run the single job as planned: here, through Hydra, or, for trainer.nproc>1, in the
    processes of the command's ranks (each runs ``args`` again)."""
    rank = distributed.from_env()
    nproc = planned.cfg.trainer.nproc
    if nproc > 1 and not rank.enabled:
        code = _check_data(planned.cfg)  # in the parent: a config error before any rank starts
        if code:
            return code
        try:
            tags = json.dumps(command.extra_tags) if command.extra_tags else None
            with setenv(RANK_TAGS_ENV, tags):
                failure = distributed.launch(args, nproc)  # each worker runs this command again
        except distributed.LaunchError as err:
            console.error(str(err))
            return 1
        return _rank_exit(failure, nproc)
    command.planned[None] = planned  # the job runs as planned here
    try:
        code = run_hydra(parsed, command, composed=single)
        return _exit_code(command, code)
    except KeyboardInterrupt as err:
        if rank.enabled:  # the launcher may have stopped it: the launching command says next
            console.error(f"rank {rank.rank}: interrupted ({err})")
            return EXIT_KILLED
        return interrupted(command, args)


def _check_data(cfg: Config) -> int:
    """Load the data set once, as each rank will: a missing one is the command's one-line
    config error here, not a race between a failing rank and the ones the launcher stops."""
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
    path = Path(conf) / f"{name}.yaml"
    if not path.is_file() or path.resolve().parent == config_dir().resolve():
        return 0
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # not YAML: Hydra says so when it composes
        return 0
    if not isinstance(saved, dict) or "defaults" in saved or "hydra" in saved:
        return 0  # a primary config the user wrote, not a saved one
    # the project a --config-dir belongs to
    folders = [
        Path(e.removeprefix("file://")).parent
        for e in search
        if "://" not in e.removeprefix("file://")
    ]
    try:
        trust.check(saved, trust.Trust.here(named, folders), skip=trust.overridden(overrides))
    except ConfigError as err:
        console.error(f"{path}: {err}")
        return 2
    return 0


def _check_nproc(nodes: list[DictConfig], configs: list[Config]) -> None:
    """DDP is one training in N processes; a sweep's jobs get theirs from a launcher that
    starts processes (not one that runs them in this process). Raises ConfigError."""
    nproc = max(c.trainer.nproc for c in configs)
    target = str(OmegaConf.select(nodes[0], "hydra.launcher._target_", default=""))
    if nproc > 1 and target.endswith(IN_PROCESS_LAUNCHERS):
        raise ConfigError(
            f"trainer.nproc={nproc} in a sweep: the jobs of a sweep run in this one process: "
            "add hydra/launcher=ampsweep_slurm (or ampsweep_local), which starts "
            "trainer.nproc processes per job, or run single jobs with trainer.nproc"
        )


IN_PROCESS_LAUNCHERS = (".AmpsweepLauncher", ".BasicLauncher")


def validate(node: DictConfig, record: bool = True) -> tuple[int, PlannedJob | None]:
    """Type, check and plan the composed job of a single-run command before anything runs;
    open (create or migrate) its MLflow store once, here, before its ranks write to it."""
    try:
        repeats = node.sweep.repeats
        if repeats != 1:
            raise ConfigError(
                f"sweep.repeats={repeats} repeats the configurations of a sweep: add -m, e.g. "
                f"ampsweep train -m sweep.repeats={repeats} precision=fp32,bf16"
            )
        (planned,) = plan.plan([plan.typed(node)], record)
    except ConfigError as err:
        console.error(str(err))
        return 2, None
    except FaultError as err:  # the store cannot be written (locked, full)
        console.error(str(err))
        return 1, None
    if planned.refusal is not None:  # this machine cannot run it: nothing is recorded
        console.error(str(planned.refusal))
        return 2, None
    return 0, planned


# The tags a caller adds to the run (reproduce's ``reproduces=<run id>``) reach the ranks of a
# trainer.nproc>1 command through their environment: each rank runs `ampsweep train` anew, and
# rank 0 records the run.
RANK_TAGS_ENV = "AMPSWEEP_RUN_TAGS"


def _tags_from_launcher() -> dict[str, str]:
    text = os.environ.get(RANK_TAGS_ENV)
    return json.loads(text) if text else {}


def _exit_code(command: CommandContext, hydra_code: int) -> int:
    failed = [o for o in command.outcomes if o.status != "FINISHED"]
    if failed:
        return max(o.exit_code for o in failed)
    return hydra_code


def run_sweep(parsed: argparse.Namespace, command: CommandContext, typed: list[str]) -> int:
    """A multirun: Hydra's sweeper composes each batch of jobs, the command checks and plans
    it (``runner.plan.SweepChecks``) and begins the parent run after the first; then the jobs,
    the report and the parent's end, whatever happened to the jobs. ``typed``: the command
    line as typed (recorded on the parent)."""

    def launch_checks(nodes: list[DictConfig], configs: list[Config]) -> None:
        _check_nproc(nodes, configs)
        for note in slurm.check_launcher(nodes[0], configs):  # a SLURM sweep, against its cluster
            console.note(note)

    def on_first(nodes: list[DictConfig], configs: list[Config]) -> None:
        for note in estimate.slow_mode_notes(  # a mode known to be slow here, said first
            configs, torch.cuda.is_available(), estimate.cpu_flags()
        ):
            console.note(note)
        command.plan = [c.precision.name for c in configs]  # each job's estimate of the rest
        sweep_dir = Path(str(nodes[0].hydra.sweep.dir))
        label = OmegaConf.select(nodes[0], "hydra.runtime.choices.experiment") or "sweep"
        command.sweep = sweep.begin(configs, typed, sweep_dir, label)

    def on_more(configs: list[Config]) -> None:
        command.plan += [c.precision.name for c in configs]
        sweep.grow(command.sweep, configs)

    checks = plan.SweepChecks(True, launch_checks, on_first, on_more, command.planned)
    command.check_batch = checks
    stopped, hydra_code, result = False, 0, None
    try:
        hydra_code = run_hydra(parsed, command)
    except KeyboardInterrupt:
        stopped = True
    finally:
        if command.sweep is not None:
            result = sweep.finish(command.sweep, stopped)
    if stopped or (result and result.report_missing):
        return interrupted(command, typed, result)
    if command.sweep is None and checks.batches == 0:
        return hydra_code  # refused before any job was checked: nothing was recorded
    return _sweep_exit(result, command, hydra_code)


# What the command that resumes a run leaves out of the one that ran it: where it resumes
# from (trainer.resume=auto takes its place), and its callbacks (not in the config hash: a
# run a callback stopped resumes without it, or the callback would stop it again).
NOT_RESUMED = ("trainer.resume", CALLBACKS)
CALLBACKS_LEFT = f"its {CALLBACKS} left out (a run a callback stopped resumes without it), "


def interrupted(command: CommandContext, args: list[str], result=None) -> int:
    """Say in one line how a signal left the command, and what to type next: the report to
    write, the sweep to relaunch, the checkpoint to resume, or that nothing was trained."""
    typed = shlex.join(["ampsweep", "train", *args])
    if result is not None and result.report_missing:
        assert command.sweep is not None  # only a sweep writes a report
        run_id = command.sweep.parent_run_id
        console.error(
            f"interrupted while the sweep's report was written: its parent run {run_id} ended "
            f"KILLED without it; write it with: ampsweep report --sweep {run_id}"
        )
        return EXIT_KILLED
    killed = [o for o in command.outcomes if o.status == store.KILLED]
    stopped = killed[-1] if killed else None
    sweeping = command.sweep is not None or "-m" in args or "--multirun" in args
    if stopped is None and command.outcomes:  # the signal came as a job ended, or between jobs
        done = command.outcomes[-1]
        rest = f"; relaunch the sweep to run the rest (finished jobs are skipped): {typed}"
        console.error(
            f"interrupted after {done.name} ended {done.status}: nothing is left RUNNING"
            + (rest if sweeping else "")
        )
        return EXIT_KILLED
    if stopped is None or not stopped.training_began:
        run = f"run {stopped.run_id} ended KILLED" if stopped and stopped.run_id else "no run"
        console.error(
            f"interrupted before training started: nothing was trained ({run}, nothing is "
            f"left RUNNING); start again with: {typed}"
        )
        return EXIT_KILLED
    if stopped.checkpoint:
        where = f"{stopped.name} stopped with checkpoint {stopped.checkpoint}"
    else:
        where = (
            f"{stopped.name} stopped before writing a checkpoint (the signal cut its first "
            "step short, or a second signal stopped it at once)"
        )
    if sweeping:
        console.error(
            f"interrupted: {where}; relaunch the sweep to finish it (finished jobs are "
            f"skipped, an interrupted one resumes): {typed}"
        )
    elif stopped.checkpoint:
        keys = [override_key(a) for a in args]
        kept = [a for a, k in zip(args, keys, strict=True) if k not in NOT_RESUMED]
        again = shlex.join(["ampsweep", "train", *kept, "trainer.resume=auto"])
        left = CALLBACKS_LEFT if CALLBACKS in keys else ""
        console.error(f"interrupted: {where}; {left}resume it with: {again}")
    else:
        console.error(f"interrupted: {where}; start again with: {typed}")
    return EXIT_KILLED


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
