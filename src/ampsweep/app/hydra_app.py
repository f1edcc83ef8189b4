"""Handing a command line to Hydra: read by Hydra's own parser, run as ``hydra.main`` runs an
app (its help, the config, shell completion, one run), and a sweep through Hydra's multirun
with its errors (a malformed sweep, an unknown sweeper or launcher) and the sweep's refusal as
one line each, exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path

# Private: Hydra has no public way to run multirun with a task function and get its errors
# back, or to read its command line (hydra.main parses sys.argv itself); checked on
# hydra-core 1.3.8, tests/unit/app/test_hydra_app.py fails if any of these moves.
from hydra._internal.hydra import Hydra
from hydra._internal.utils import _run_hydra as run_hydra_app
from hydra._internal.utils import create_automatic_config_search_path, get_args_parser
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ampsweep.app import console, launcher, plan, scoped_env
from ampsweep.app.job import CommandContext, TaskFunction
from ampsweep.config import messages
from ampsweep.config.compose import config_dir
from ampsweep.config.schema import ConfigError, register_configs


def run_hydra(parsed: argparse.Namespace, command: CommandContext) -> int:
    """Hand the command to Hydra, which runs each job through ``TaskFunction``; the exit
    code of Hydra itself (its own errors are printed by Hydra, a sweep's as one line)."""
    register_configs()
    launcher.register()
    task = TaskFunction(command)
    # SIGTERM (a scheduler's stop) ends the command like Ctrl-C: a sweep's parent run is ended
    # and the exit is non-zero. Inside a job, the job's StopRequest first writes a checkpoint.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        if parsed.multirun:
            return _multirun(parsed, task)
        if parsed.shell_completion:
            return _complete(parsed, task)
        # What hydra.main runs, given the command line read already (printing the config,
        # help and completion, or one run)
        run_hydra_app(
            args=parsed, args_parser=get_args_parser(), task_function=task,
            config_path=str(config_dir()), config_name="config",
        )  # fmt: skip
    except SystemExit as exc:  # Hydra exits on its own errors (already printed)
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _complete(parsed: argparse.Namespace, task: TaskFunction) -> int:
    """Hydra's shell completion of ``ampsweep train``: its script names the program by
    ``sys.argv[0]`` (``ampsweep``, whatever ran this one) and the query completes the
    overrides that follow ``ampsweep train`` in the line typed so far (COMP_LINE)."""
    line = os.environ.get("COMP_LINE")
    if line is not None:
        line = re.sub(r"^\s*\S+\s+train\b", "ampsweep", line)
    argv0, sys.argv[0] = sys.argv[0], "ampsweep"
    try:
        with scoped_env.setenv("COMP_LINE", line):
            run_hydra_app(
                args=parsed, args_parser=get_args_parser(), task_function=task,
                config_path=str(config_dir()), config_name="config",
            )  # fmt: skip
    finally:
        sys.argv[0] = argv0
    return 0


def _multirun(parsed: argparse.Namespace, task: TaskFunction) -> int:
    """Hydra's multirun, as hydra.main starts it, with its errors (a malformed sweep, an
    unknown sweeper) and the sweep's refusal as one line each, exit 2."""
    search_path = create_automatic_config_search_path(
        None, None, parsed.config_path or str(config_dir())
    )
    if parsed.config_dir:
        search_path.prepend("command-line", f"file://{parsed.config_dir}",
                            anchor=SearchPathQuery(provider="schema"))  # fmt: skip
    hydra = Hydra.create_main_hydra2(task_name="ampsweep", config_search_path=search_path)
    try:
        # (hydra.mode: what hydra.main adds for -m, each job's HydraConfig says MULTIRUN)
        overrides = [*parsed.overrides, "hydra.mode=MULTIRUN"]
        hydra.multirun(parsed.config_name or "config", task, overrides)
    except plan.Refused as refused:
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


def hydra_error(err: Exception, parsed: argparse.Namespace, loader) -> str:
    """Hydra's error for a sweep command as one line: the override and the fix."""
    missing = re.search(r"Could not find '(hydra/\w+)/([^']+)'", str(err))
    if missing:
        group, option = missing.groups()
        options = sorted(loader.get_group_options(group), key=lambda o: o != "basic")
        fix = " (pip install 'ampsweep[optuna]' adds optuna)" if option == "optuna" else ""
        kind = group.split("/")[1]
        return f"{group}={option}: no such {kind}: choose one of {', '.join(options)}{fix}"
    folders = [Path(parsed.config_path or config_dir())]
    folders += [Path(parsed.config_dir)] if parsed.config_dir else []
    return messages.explain(err, parsed.overrides, folders)


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")
