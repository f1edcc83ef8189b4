"""SLURM as a sweep sees it: its commands, what a partition offers, where the jobs run, and
what a job is doing now.

``check`` refuses a SLURM sweep that cannot work before anything is submitted or recorded
(one line naming the key, the value and the fix): no SLURM commands here, a partition that
does not exist, a time limit of zero or shorter than the requeue signal's warning, more
tasks, CPUs, GPUs or memory per node than the partition's nodes have, and files the jobs must
share on a file system only this machine sees. Everything is asked of SLURM's own commands
(``sinfo``, ``squeue``), so the checks hold on any cluster and on the one-node test cluster.

``job_states`` follows jobs with ``squeue`` rather than ``sacct``: it answers on clusters
without accounting (no slurmdbd) too, and a job squeue no longer lists has ended.

Importing this module costs nothing (no torch, no MLflow, no Hydra): it runs inside every job
(the requeue signal) and while a sweep waits. ``check_sweep`` imports Hydra's compose and
OmegaConf when called. What a partition offers and whether the jobs see the files they
share: ``launch.cluster``.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ampsweep.config.schema import ConfigError, Tracker
from ampsweep.engine.run_folder import root_of
from ampsweep.launch.cluster import SINFO_FORMAT, Partition, check_shared, parse_sinfo
from ampsweep.tracking import store

COMMANDS = ("sbatch", "sinfo", "squeue", "scancel")
SUBMITIT_PLUGIN = "hydra_plugins.hydra_submitit_launcher"
LOCAL_LAUNCHER = "hydra/launcher=ampsweep_local"
QUERY_TIMEOUT_S = 30
# Job states after which a job runs no more (squeue -t all). A requeued job passes through
# REQUEUED/PENDING, which are not here; PREEMPTED ends a job only where preemption cancels.
ENDED = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "REVOKED",
    "SPECIAL_EXIT",
}
GONE = "GONE"  # squeue no longer knows the job: it ended longer ago than MinJobAge


class SlurmError(RuntimeError):
    """A SLURM command failed (the controller does not answer, ...): one line."""


# ---------------------------------------------------------------- asking SLURM


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None]


def _run(*args: str) -> str:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{args[0]} did not answer within {QUERY_TIMEOUT_S} s") from None
    except OSError as err:
        raise SlurmError(f"{args[0]}: {err.strerror}") from None
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit {proc.returncode}"]
        raise SlurmError(f"{args[0]}: {lines[-1].strip()}")
    return proc.stdout


def partitions() -> dict[str, Partition]:
    """Every partition with its nodes, from ``sinfo`` (one line per node and partition)."""
    return parse_sinfo(_run("sinfo", "-h", "-N", "-o", SINFO_FORMAT))


def job_states(job_ids: list[str]) -> dict[str, str]:
    """The state of each job (``12`` or array tasks ``12_3``) from squeue; ``GONE`` for a job
    squeue no longer lists. A failed query raises SlurmError (the caller asks again later):
    a controller that does not answer says nothing about the jobs."""
    states: dict[str, str] = {}
    for main in sorted({j.split("_")[0] for j in job_ids}):
        # One query per submission: squeue refuses the whole list if one id is unknown.
        try:
            out = _run("squeue", "-h", "-r", "-t", "all", "-j", main, "-o", "%i|%T")
        except SlurmError as err:
            if "Invalid job id" not in str(err):
                raise
            out = ""
        for line in out.splitlines():
            job, _, state = line.strip().partition("|")
            states[job] = state.split()[0] if state else "UNKNOWN"
    return {j: states.get(j, GONE) for j in job_ids}


def cancel(job_ids: list[str]) -> None:
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=QUERY_TIMEOUT_S)


# ---------------------------------------------------------------- the checks


@dataclass
class LauncherSettings:
    """The keys of a SLURM launcher config that decide whether its jobs can run."""

    partition: str | None = None
    timeout_min: object = 60
    signal_delay_s: int = 120
    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int | None = None
    gpus_per_node: int | None = None
    mem_gb: int | None = None
    # which of tasks_per_node / gpus_per_node are ${trainer.nproc} (named so in errors)
    from_nproc: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, resolved: dict, raw: dict) -> LauncherSettings:
        keys = cls.__dataclass_fields__.keys() - {"from_nproc"}
        given = {k: resolved[k] for k in keys if k in resolved}
        nproc = {k for k, v in raw.items() if str(v).replace(" ", "") == "${trainer.nproc}"}
        return cls(**given, from_nproc=frozenset(nproc))


def is_slurm_launcher(target: str | None) -> bool:
    return target is not None and target.rsplit(".", 1)[-1] == "SlurmLauncher"


def check(
    settings: LauncherSettings,
    nprocs: list[int],
    shared_paths: dict[str, Path],
    launcher_choice: str,
) -> list[str]:
    """Raise ConfigError if the sweep's SLURM jobs cannot run; return notes (things that
    probably fail, which the user should know). ``shared_paths``: what the jobs must reach
    (the sweep dir, a SQLite store, the checkpoint folder), named by their key."""
    missing = missing_commands()
    if missing:
        raise ConfigError(
            f"{launcher_choice}: SLURM's commands are not found ({', '.join(missing)} not on "
            f"PATH): launch the sweep where SLURM jobs are submitted (a login node), or use "
            f"{LOCAL_LAUNCHER} to run each job in a process of this machine"
        )
    check_timeout(settings)
    if len(set(nprocs)) > 1:
        raise ConfigError(
            f"trainer.nproc={','.join(str(n) for n in sorted(set(nprocs)))}: the jobs of one "
            "sweep share one launcher config (tasks_per_node is trainer.nproc): sweep each "
            "process count in a command of its own"
        )
    try:
        parts = partitions()
    except SlurmError as err:
        raise ConfigError(
            f"{launcher_choice}: SLURM does not answer ({err}): check that the controller "
            "runs and SLURM_CONF, or use " + LOCAL_LAUNCHER
        ) from None
    part = _partition(settings, parts)
    _check_time_limit(settings, part)
    _check_resources(settings, part)
    return check_shared(shared_paths, part)


def check_timeout(s: LauncherSettings) -> None:
    """A time limit the job can run within: at least a minute, and longer than the requeue
    signal's warning (SLURM sends that signal from the job's start otherwise, every time its
    controller looks, about every 30 s). The launcher checks this for any Hydra app."""
    t = s.timeout_min
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ConfigError(
            f"hydra.launcher.timeout_min={t}: a SLURM job needs a time limit of at least 1 "
            "minute: set hydra.launcher.timeout_min to the minutes a job may run, e.g. 60"
        )
    if t * 60 <= s.signal_delay_s:
        raise ConfigError(
            f"hydra.launcher.timeout_min={t}: the job is signalled to checkpoint and requeue "
            f"hydra.launcher.signal_delay_s={s.signal_delay_s} seconds before its time limit, "
            "so it would be requeued as soon as it starts: raise timeout_min above "
            f"{s.signal_delay_s // 60} minutes or lower signal_delay_s"
        )


def _partition(s: LauncherSettings, parts: dict[str, Partition]) -> Partition:
    names = ", ".join(sorted(parts)) or "none"
    if s.partition is None:
        default = next((p for p in parts.values() if p.default), None)
        if default is None:
            raise ConfigError(
                "hydra.launcher.partition=null: this cluster has no default partition: "
                f"set hydra.launcher.partition to one of {names}"
            )
        return default
    if s.partition not in parts:
        raise ConfigError(
            f"hydra.launcher.partition={s.partition}: no such partition on this cluster "
            f"(sinfo lists {names}): set hydra.launcher.partition to one of them"
        )
    return parts[s.partition]


def _check_time_limit(s: LauncherSettings, part: Partition) -> None:
    limit, timeout = part.time_limit_min, s.timeout_min  # an int: check_timeout ran first
    if limit is not None and isinstance(timeout, int) and timeout > limit:
        raise ConfigError(
            f"hydra.launcher.timeout_min={s.timeout_min}: partition {part.name} allows at "
            f"most {limit} minutes: lower timeout_min (a job that reaches it is requeued and "
            "resumes from its checkpoint) or choose another partition"
        )


def _check_resources(s: LauncherSettings, part: Partition) -> None:
    where = f"partition {part.name}"
    if s.nodes > len(part.nodes):
        raise ConfigError(
            f"hydra.launcher.nodes={s.nodes}: {where} has {len(part.nodes)} node(s): "
            "lower hydra.launcher.nodes or choose another partition"
        )
    tasks = s.tasks_per_node
    key = "trainer.nproc" if "tasks_per_node" in s.from_nproc else "hydra.launcher.tasks_per_node"
    what = f"{key}={tasks}"
    cpus = tasks * (s.cpus_per_task or 1)
    if cpus > part.max_cpus:
        per_task = f" x hydra.launcher.cpus_per_task={s.cpus_per_task}" if s.cpus_per_task else ""
        raise ConfigError(
            f"{what}{per_task} needs {cpus} CPUs on one node, but the nodes of {where} have at "
            f"most {part.max_cpus}: lower {key}"
            + (" or hydra.launcher.cpus_per_task" if s.cpus_per_task else "")
        )
    gpus = s.gpus_per_node or 0
    if gpus > part.max_gpus:
        if "gpus_per_node" in s.from_nproc:
            given = f"hydra.launcher.gpus_per_node={gpus} (trainer.nproc={gpus}: a GPU per process)"
        else:
            given = f"hydra.launcher.gpus_per_node={gpus}"
        hint = (
            "set hydra.launcher.gpus_per_node=0 to train on CPUs (Gloo), or choose a GPU partition"
            if part.max_gpus == 0
            else "lower trainer.nproc (one GPU per process) or hydra.launcher.gpus_per_node"
        )
        raise ConfigError(
            f"{given}: the nodes of {where} have at most {part.max_gpus} GPU(s): {hint}"
        )
    if s.mem_gb and s.mem_gb * 1024 > part.max_memory_mb > 0:
        raise ConfigError(
            f"hydra.launcher.mem_gb={s.mem_gb}: the nodes of {where} have at most "
            f"{part.max_memory_mb // 1024} GB: lower hydra.launcher.mem_gb"
        )


# ---------------------------------------------------------------- a sweep's command


def check_sweep(
    overrides: list[str], configs: list, conf: Path, config_name: str, search=()
) -> list[str]:
    """The checks above for a ``-m`` command whose launcher is a SLURM one (else nothing):
    its launcher config as Hydra composes it for the first job, the jobs' process counts,
    and what the jobs must share (the sweep dir, a SQLite store, the checkpoint folders).
    Raises ConfigError; returns notes."""

    from ampsweep.config.compose import compose
    from ampsweep.config.sweeps import expand_sweep

    try:
        first = expand_sweep(overrides)[0]
        cfg = compose(first, conf, config_name, return_hydra_config=True, search=search)
    except ConfigError as err:
        if "submitit" in str(err) and importlib.util.find_spec(SUBMITIT_PLUGIN) is None:
            given = [o for o in overrides if o.startswith("hydra/launcher=")]
            raise ConfigError(
                f"{given[-1] if given else 'hydra/launcher'}: Hydra's submitit launcher is not "
                "installed: pip install 'ampsweep[cluster]' (hydra-submitit-launcher)"
            ) from None
        raise
    return check_launcher(cfg, configs)


def check_launcher(cfg, configs: list) -> list[str]:
    """The checks above for a sweep whose jobs Hydra composed (``cfg``: one job's config with
    its hydra node) if its launcher is a SLURM one (else nothing). Raises ConfigError;
    returns notes."""
    from omegaconf import OmegaConf

    launcher = cfg.hydra.launcher
    if not is_slurm_launcher(OmegaConf.select(launcher, "_target_")):
        return []
    raw = OmegaConf.to_container(launcher, resolve=False)
    assert isinstance(raw, dict)  # a launcher config is a mapping
    resolved = {k: OmegaConf.select(launcher, k) for k in raw if isinstance(k, str)}
    settings = LauncherSettings.from_config(resolved, raw)
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default={}) or {}
    choice = f"hydra/launcher={choices.get('hydra/launcher', 'ampsweep_slurm')}"
    shared = {"hydra.sweep.dir": Path(str(cfg.hydra.sweep.dir)).expanduser().resolve()}
    for c in configs:
        db = store.sqlite_path(store.resolve_uri(c.tracking.uri))
        if c.tracking.backend == Tracker.mlflow and db is not None:
            shared.setdefault("tracking.uri", db)
        shared.setdefault("trainer.checkpoint_dir", root_of(c))
    return check(settings, [c.trainer.nproc for c in configs], shared, choice)
