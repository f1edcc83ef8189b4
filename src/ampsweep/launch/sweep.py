"""Launching a sweep: its parent run before the jobs, its report and end after them.

``ampsweep train -m`` creates the parent run in the sweep dir once the sweeper has composed and
checked the first batch of jobs (``runner.plan``), runs the jobs through Hydra, then ends the
parent whatever happened to them, after printing the comparison report and logging it to the
parent.
"""

from __future__ import annotations

import itertools
import shlex
from datetime import datetime
from pathlib import Path

from ampsweep import console
from ampsweep.config.schema import Config, Tracker
from ampsweep.report import render
from ampsweep.report import sweeps as report_sweeps
from ampsweep.runner.context import default_run_name
from ampsweep.tracking import store
from ampsweep.tracking import sweep as sweeps
from ampsweep.tracking.sweep import SweepInfo, SweepResult


def claim_dir(sweep_dir: Path) -> Path:
    """``sweep_dir``, or ``<sweep_dir>-2``, ``-3``... when another sweep started in the same
    second took it: created here, and ``mkdir`` either creates a folder or fails, so two
    sweeps never share one."""
    sweep_dir.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = sweep_dir if n == 1 else sweep_dir.with_name(f"{sweep_dir.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def begin(configs: list[Config], args: list[str], sweep_dir: Path, label: str) -> SweepInfo | None:
    """The sweep's parent run (None when the sweep is not recorded: tracking=none), from the
    planned configs of its first batch of jobs."""
    first = configs[0].tracking
    if first.backend != Tracker.mlflow:
        return None
    uri = store.resolve_uri(first.uri)
    names = [default_run_name(c) for c in configs if not c.tracking.run_name]
    return sweeps.begin(
        uri,
        first,
        sweep_dir,
        name=f"{label}-{datetime.now():%Y%m%d-%H%M%S}",
        command=shlex.join(["ampsweep", "train", *args]),
        expected_jobs=len(configs),
        run_names=names,
    )


def grow(info: SweepInfo | None, configs: list[Config]) -> None:
    """A later batch of a search's trials (hydra/sweeper=optuna): the parent expects them."""
    if info is not None:
        sweeps.grow(
            info, [default_run_name(c) for c in configs if not c.tracking.run_name], len(configs)
        )


def finish(info: SweepInfo, interrupted: bool) -> SweepResult:
    """End the parent from its children's statuses, after printing the sweep report and
    logging it to the parent (an interrupted sweep's too: what finished is worth reading).
    A signal while the report is written stops it: the parent ends KILLED with a tag that
    says the report is missing and how to write it (``result.report_missing``). Whatever the
    report does, the parent is never left RUNNING."""
    result = sweeps.conclude(info, interrupted)
    try:
        if result.runs or result.skipped:
            publish_report(info)
    except KeyboardInterrupt:
        result.report_missing = (
            "a signal stopped the sweep's report before it was logged: "
            f"`ampsweep report --sweep {info.parent_run_id}` writes it"
        )
    finally:
        sweeps.end(info, result)
    return result


def publish_report(info: SweepInfo) -> None:
    """Print the comparison report and log it (files, charts, headline metrics) to the parent.
    A report problem is reported, never allowed to change how the sweep ended."""
    try:
        client = store.client_for(info.uri)
        rep = report_sweeps.build_report(client, info.parent_run_id)
        console.console.print()
        render.print_table(rep, console.console)
        report_sweeps.publish(client, rep)
        console.console.print(
            f"report logged to the sweep's parent run {info.parent_run_id} "
            f"({info.name}) in {store.describe(info.uri)}"
        )
    except Exception as err:
        console.error(f"could not write the sweep report: {store.one_line(err)}")
