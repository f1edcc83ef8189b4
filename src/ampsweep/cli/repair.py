"""``ampsweep repair``: what a store outage or a lost process left behind, put right.

Two things can be left when a command could not finish its business with the MLflow store:
a run's journal (records the store did not take while it was down: metrics, tags, the run's
end), and a run left RUNNING by a process that is gone (SIGKILL, a lost machine, a store
that never answered again). ``repair`` writes every journal whose run no live process owns
into the store, then ends every RUNNING run whose owner is gone KILLED, with the reason in
its ``error`` tag (and every sweep parent whose launcher is gone). The first half also runs
whenever ``ampsweep train`` opens a store, so a journal is written by the next command.
"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from ampsweep import console
from ampsweep.config.schema import ConfigError
from ampsweep.engine import run_folder
from ampsweep.engine.run_folder import DEFAULT_ROOT
from ampsweep.errors import FaultError
from ampsweep.tracking import journal, store
from ampsweep.tracking import sweep as sweeps


def add_parser(sub) -> None:
    p = sub.add_parser(
        "repair",
        help="write what a store outage kept in run journals; end runs whose process is gone",
        description="Write the records run journals kept while the MLflow store was down, "
        "then end every RUNNING run whose process is gone (KILLED, with the reason).",
    )
    p.add_argument("--tracking-uri", help=store.STORE_HELP)
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="where the runs' checkpoint folders (and journals) are (default outputs/checkpoints)",
    )
    p.set_defaults(func=cmd_repair)


def cmd_repair(args: argparse.Namespace) -> int:
    uri = store.resolve_uri(args.tracking_uri)
    root = (args.checkpoint_dir or DEFAULT_ROOT).expanduser().resolve()
    try:
        store.check(uri, key="--tracking-uri")
        lines = journal.replay_all(uri, [root]) + end_orphans(uri, root)
    except (ConfigError, FaultError) as err:
        console.error(str(err))
        return 2 if isinstance(err, ConfigError) else 1
    except Exception as err:
        known = store.fault(err, uri, "--tracking-uri")
        if known is None:
            raise
        console.error(str(known))
        return 1
    for line in lines or [f"nothing to repair in {store.describe(uri)}"]:
        console.console.print(line)
    return 0


def end_orphans(uri: str, root: Path) -> list[str]:
    """End KILLED every RUNNING run whose process is gone: it ran on this host and its pid
    is dead, or the lease on its checkpoint folder is free (nobody trains it)."""
    client = store.client_for(uri)
    ended = []
    experiments = [e.experiment_id for e in client.search_experiments()]
    for exp_id in experiments:
        ended += [
            f"ended sweep {r} KILLED: its launcher is gone"
            for r in sweeps.end_orphaned_sweeps(client, exp_id)
        ]
    running = (
        client.search_runs(
            experiments, filter_string=f"attributes.status = '{store.RUNNING}'", max_results=10000
        )
        if experiments
        else []
    )
    for run in running:
        tags = run.data.tags
        if tags.get(store.SWEEP) == "true":
            continue  # a live sweep's parent (a gone one was ended above)
        who = owner_gone(tags)
        if who is None:
            continue
        why = f"its process ({who}) ended without ending the run: ended by ampsweep repair"
        client.set_tag(run.info.run_id, store.ERROR, why)
        client.set_tag(run.info.run_id, store.ENDED_BY, "ampsweep repair")
        client.set_terminated(run.info.run_id, status=store.KILLED)
        ended.append(f"ended run {run.info.run_name} ({run.info.run_id}) KILLED: {why}")
    return ended


def owner_gone(tags: dict[str, str]) -> str | None:
    """Who trained the run, if that process is gone (None: alive, or cannot tell)."""
    host, pid = tags.get(store.HOST, ""), tags.get(store.PID, "")
    folder = tags.get(store.CHECKPOINT_DIR)
    if folder and Path(folder).is_dir() and run_folder.held(Path(folder)) is not None:
        return None  # its lease is held: alive
    who = f"pid {pid} on {host}"
    if host == socket.gethostname() and pid.isdigit():
        return who if not sweeps.alive(int(pid)) else None
    if folder and (Path(folder) / run_folder.LOCK_NAME).is_file():
        return who  # another host's run whose lease nobody holds (a shared file system)
    return None
