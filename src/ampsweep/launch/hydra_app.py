"""Handing a command line to Hydra: read by Hydra's own parser (``hydra_args``), run as
``hydra.main`` runs an app (its help, the config, shell completion), a single run composed
once (``composed_run``: the command plans the composed config, then Hydra runs it), and a
sweep through Hydra's multirun with its errors (a malformed sweep, an unknown sweeper or
launcher) and the sweep's refusal as one line each, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hydra import version

# Private, and the only private Hydra names in ampsweep: Hydra has no public way to run
# multirun with a task function and get its errors back, to run an app on a config it composed
# already (Hydra.run composes its own), or to read an app's command line (hydra.main parses
# sys.argv itself). Checked on hydra-core 1.3.8; tests/unit/launch/test_hydra_app.py fails if
# any of these moves.
from hydra._internal.callbacks import Callbacks
from hydra._internal.hydra import Hydra
from hydra._internal.utils import _run_hydra as run_hydra_app
from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.core.utils import run_job
from hydra.errors import HydraException
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException

from ampsweep import console
from ampsweep.config import messages
from ampsweep.config.compose import (
    composition_error,
    config_dir,
    normalise_overrides,
    search_entry,
    searchpath_of,
)
from ampsweep.config.schema import ConfigError, register_configs
from ampsweep.launch import launcher
from ampsweep.launch.sweeper import check_sweep, task_overrides
from ampsweep.runner.context import CommandContext, Refused

if TYPE_CHECKING:  # the job imports torch: imported where a command runs one
    from ampsweep.runner.job import TaskFunction


def hydra_args(args: list[str]) -> argparse.Namespace:
    """The command line as Hydra's own parser reads it (its flags, -m, the overrides), the
    config folders made absolute (Hydra reads a relative one relative to the module that calls
    it, inside ampsweep, not the folder the user is in) and each ``<section>.args.<key>=v``
    made Hydra's add-or-set."""
    parser = get_args_parser()
    parser.prog = "ampsweep train"  # a bad flag: argparse's usage line and exit 2
    parsed = parser.parse_intermixed_args(args)  # overrides before and after the flags
    for key in ("config_path", "config_dir"):
        if getattr(parsed, key):
            setattr(parsed, key, str(Path(getattr(parsed, key)).expanduser().resolve()))
    parsed.overrides = normalise_overrides(parsed.overrides)
    return parsed


def informational(parsed: argparse.Namespace | None) -> bool:
    """Hydra prints something (help, the config, completion) and trains nothing (None: a
    command line Hydra's parser refused)."""
    return parsed is None or bool(
        parsed.help
        or parsed.hydra_help
        or parsed.cfg
        or parsed.info
        or parsed.shell_completion
        or parsed.experimental_rerun
    )


def run_hydra(
    parsed: argparse.Namespace, command: CommandContext, composed: SingleRun | None = None
) -> int:
    """Hand the command to Hydra, which runs each job through ``TaskFunction``; the exit
    code of Hydra itself (its own errors are printed by Hydra, a sweep's as one line).
    ``composed``: the single run of the command, composed already (``composed_run``)."""
    from ampsweep.runner.job import TaskFunction

    register_configs()
    launcher.register()
    task = TaskFunction(command)
    # SIGTERM (a scheduler's stop) ends the command like Ctrl-C: a sweep's parent run is ended
    # and the exit is non-zero. Inside a job, the job's StopRequest first writes a checkpoint.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        if parsed.multirun:
            return _multirun(parsed, task)
        if composed is not None:
            composed.run(task)
            return 0
        if parsed.shell_completion:
            return _complete(parsed, task)
        # What hydra.main runs, given the command line read already (printing the config or
        # help)
        _as_hydra_main(parsed, task)
    except SystemExit as exc:  # Hydra exits on its own errors (already printed)
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _as_hydra_main(parsed: argparse.Namespace, task: TaskFunction) -> None:
    """What ``hydra.main`` runs, given the command line read already."""
    run_hydra_app(
        args=parsed,
        args_parser=get_args_parser(),
        task_function=task,
        config_path=str(config_dir()),
        config_name="config",
    )


def _complete(parsed: argparse.Namespace, task: TaskFunction) -> int:
    """Hydra's shell completion of ``ampsweep train``: its script names the program by
    ``sys.argv[0]`` (``ampsweep``, whatever ran this one) and the query completes the
    overrides that follow ``ampsweep train`` in the line typed so far (COMP_LINE)."""
    line = os.environ.get("COMP_LINE")
    if line is not None:
        line = re.sub(r"^\s*\S+\s+train\b", "ampsweep", line)
    argv0, sys.argv[0] = sys.argv[0], "ampsweep"
    try:
        with setenv("COMP_LINE", line):
            _as_hydra_main(parsed, task)
    finally:
        sys.argv[0] = argv0
    return 0


def _multirun(parsed: argparse.Namespace, task: TaskFunction) -> int:
    """Hydra's multirun, as hydra.main starts it, with its errors (a malformed sweep, an
    unknown sweeper) and the sweep's refusal as one line each, exit 2."""
    try:
        hydra = _main_hydra(parsed)
    except ConfigError as err:
        console.error(str(err))
        return 2
    try:
        # (hydra.mode: what hydra.main adds for -m, each job's HydraConfig says MULTIRUN)
        overrides = [*parsed.overrides, "hydra.mode=MULTIRUN"]
        _sweep(hydra, config_of(parsed)[1], overrides, task)
    except Refused as refused:
        return refused.code
    except ConfigError as err:
        console.error(str(err))
        return 2
    except (HydraException, OmegaConfBaseException) as err:
        console.error(hydra_error(err, parsed, hydra.config_loader))
        return 2
    finally:
        GlobalHydra.instance().clear()
    return 0


def _sweep(hydra: Hydra, name: str, overrides: list[str], task: TaskFunction) -> None:
    """What ``Hydra.multirun`` does, with the sweep checked between composing its config and
    starting its sweeper: a sweep the sweeper would refuse leaves nothing behind."""
    cfg = hydra.compose_config(name, overrides, RunMode.MULTIRUN, with_log_configuration=True)
    check_sweep(cfg, hydra.config_loader)
    callbacks = Callbacks(cfg)
    callbacks.on_multirun_start(config=cfg, config_name=name)
    sweeper = Plugins.instance().instantiate_sweeper(
        config=cfg,
        hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=callbacks),
        task_function=task,
    )
    sweeper.sweep(arguments=task_overrides(cfg))
    callbacks.on_multirun_end(config=cfg, config_name=name)


def config_of(parsed: argparse.Namespace) -> tuple[Path, str, list[str]]:
    """The primary config's folder, the config's name, and the user's config folder
    (``--config-dir``: its group files sit beside ampsweep's) as a search path entry."""
    name = parsed.config_name or "config"
    search = [search_entry(parsed.config_dir)] if parsed.config_dir else []
    return Path(parsed.config_path or config_dir()), name, search


def _main_hydra(parsed: argparse.Namespace) -> Hydra:
    """Hydra as hydra.main starts it for this command line: the primary config's folder
    (ampsweep's, or --config-path), the user's --config-dir beside it. Raises ConfigError."""
    for flag, folder, holds in (
        ("--config-dir", parsed.config_dir, "your config groups, e.g. --config-dir ./conf"),
        (
            "--config-path",
            parsed.config_path,
            "the primary config, e.g. --config-path RUN_DIR/.hydra --config-name config",
        ),
    ):
        if folder and not Path(folder).is_dir():
            raise ConfigError(f"{flag} {folder}: no such folder: give the folder of {holds}")
    search_path = create_automatic_config_search_path(
        None, None, parsed.config_path or str(config_dir())
    )
    if parsed.config_dir:
        search_path.prepend(
            "command-line", f"file://{parsed.config_dir}", anchor=SearchPathQuery(provider="schema")
        )
    return Hydra.create_main_hydra2(task_name="ampsweep", config_search_path=search_path)


@dataclass
class SingleRun:
    """A single run's config, composed once as ``Hydra.run`` composes it (its ``hydra`` node
    included), for the command to plan and then run."""

    hydra: Hydra
    node: DictConfig
    config_name: str

    def run(self, task: TaskFunction) -> None:
        """What ``Hydra.run`` does after composing: its callbacks around the job, run in its
        run dir (``hydra.run.dir``) with its logging; the job's own exception re-raised."""
        callbacks = Callbacks(self.node)
        callbacks.on_run_start(config=self.node, config_name=self.config_name)
        context = HydraContext(config_loader=self.hydra.config_loader, callbacks=callbacks)
        ret = run_job(
            hydra_context=context,
            task_function=task,
            config=self.node,
            job_dir_key="hydra.run.dir",
            job_subdir_key=None,
            configure_logging=True,
        )
        callbacks.on_run_end(config=self.node, config_name=self.config_name, job_return=ret)
        _ = ret.return_value  # (Hydra's own way to raise what the job raised)


@contextlib.contextmanager
def composed_run(parsed: argparse.Namespace) -> Iterator[SingleRun]:
    """The command's single run composed once, with Hydra's own loader, as ``Hydra.run``
    would compose it (the one composition of a single run: the command types and plans this
    node, and ``SingleRun.run`` runs it). Raises ConfigError with Hydra's error as one line."""
    register_configs()
    launcher.register()
    version.setbase("1.3")  # as ampsweep's compose API (config.compose) composes
    conf, name, search = config_of(parsed)
    hydra = _main_hydra(parsed)
    try:
        try:
            node = hydra.compose_config(
                name, parsed.overrides, run_mode=RunMode.RUN, with_log_configuration=True
            )
        except (HydraException, OmegaConfBaseException) as err:
            search += searchpath_of(parsed.overrides)
            raise composition_error(err, parsed.overrides, conf, name, search) from None
        with open_dict(node.hydra):  # as Hydra.run sets it (MULTIRUN: the config asks to sweep)
            node.hydra.mode = node.hydra.mode or RunMode.RUN
        HydraConfig.instance().set_config(node)  # its ${hydra:...} resolve as in the job
        yield SingleRun(hydra, node, name)
    finally:
        GlobalHydra.instance().clear()


def hydra_error(err: Exception, parsed: argparse.Namespace, loader) -> str:
    """Hydra's error for a sweep command as one line: the override and the fix."""
    missing = re.search(r"Could not find '(hydra/\w+)/([^']+)'", str(err))
    if missing:
        group, option = missing.groups()
        options = sorted(loader.get_group_options(group), key=lambda o: o != "basic")
        fix = " (pip install 'ampsweep[optuna]' adds optuna)" if option == "optuna" else ""
        kind = group.split("/")[1]
        return f"{group}={option}: no such {kind}: choose one of {', '.join(options)}{fix}"
    folders = [config_of(parsed)[0]]
    folders += [Path(parsed.config_dir)] if parsed.config_dir else []
    return messages.explain(err, parsed.overrides, folders)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


@contextlib.contextmanager
def setenv(key: str, value: str | None):
    """``key=value`` inside the block (``None``: leave ``key`` as it is)."""
    if value is None:
        yield
        return
    saved = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
