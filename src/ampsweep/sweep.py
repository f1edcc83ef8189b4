"""A Hydra multirun as one MLflow parent run with a child run per job.

The parent run is created by a Hydra callback when the multirun starts, in the launching
process. Its id reaches the jobs two ways: an environment variable (jobs in this process, and
launchers that start processes with this environment) and a small JSON file in the sweep dir
(launchers whose jobs run elsewhere but see the same file system, such as SLURM). The
launching ``ampsweep train -m`` ends the parent after all jobs, whatever happened to them, so it
is never left RUNNING.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from hydra.experimental.callback import Callback

from ampsweep import tracking

SWEEP_FILE = "ampsweep_sweep.json"
ENV_SWEEP = "AMPSWEEP_SWEEP"  # the JSON of SweepInfo
ENV_NAME_COUNTS = "AMPSWEEP_NAME_COUNTS"  # set by the CLI: how often each run name occurs


@dataclass
class SweepInfo:
    parent_run_id: str
    uri: str
    experiment: str
    sweep_dir: str
    name: str
    name_counts: dict[str, int] = field(default_factory=dict)
    expected_jobs: int | None = None

    def run_name(self, resolved: str, base: str, job_num: int | None) -> str:
        """``<precision>-<model>-<dataset>``, plus the job number when names repeat."""
        if job_num is not None and self.name_counts.get(base, 1) > 1:
            return f"{resolved}-{job_num}"
        return resolved

    def dump(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def load(cls, text: str) -> SweepInfo:
        return cls(**json.loads(text))


# The sweep this process launched (set by the callback, ended by the CLI).
ACTIVE: SweepInfo | None = None


def name_counts(names: list[str]) -> None:
    os.environ[ENV_NAME_COUNTS] = json.dumps(Counter(names))


class SweepCallback(Callback):
    """Creates the sweep's parent run when a multirun starts."""

    def on_multirun_start(self, config, **kwargs) -> None:
        global ACTIVE
        from omegaconf import OmegaConf

        backend = config.tracking.backend  # an Enum member in the typed config, not a str
        if getattr(backend, "name", backend) != "mlflow":
            return
        uri = tracking.resolve_uri(config.tracking.uri)
        tracking.check_store(uri)
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        choices = OmegaConf.select(config, "hydra.runtime.choices", default={}) or {}
        label = choices.get("experiment") or "sweep"
        name = f"{label}-{datetime.now():%Y%m%d-%H%M%S}"
        client = tracking.client_for(uri)
        local = uri.startswith("sqlite:")
        exp_id = tracking.get_or_create_experiment(
            client, config.tracking.experiment, config.tracking.artifact_root if local else None
        )
        counts = json.loads(os.environ.get(ENV_NAME_COUNTS, "{}"))
        run = client.create_run(
            exp_id,
            run_name=name,
            tags=tracking.mask_secrets(
                {
                    "ampsweep.sweep": "true",
                    "sweep_dir": str(sweep_dir),
                    "command": " ".join(["ampsweep", *sys.argv[1:]]),
                    "jobs_expected": str(sum(counts.values()) or ""),
                }
            ),
        )
        info = SweepInfo(
            parent_run_id=run.info.run_id,
            uri=uri,
            experiment=config.tracking.experiment,
            sweep_dir=str(sweep_dir),
            name=name,
            name_counts=counts,
            expected_jobs=sum(counts.values()) or None,
        )
        (sweep_dir / SWEEP_FILE).write_text(info.dump())
        os.environ[ENV_SWEEP] = info.dump()
        ACTIVE = info


def job_sweep_info(ctx) -> SweepInfo | None:
    """The sweep a job belongs to: from the environment, else the sweep dir's file."""
    if ctx.sweep_dir is None:
        return None
    text = os.environ.get(ENV_SWEEP)
    if text:
        info = SweepInfo.load(text)
        if Path(info.sweep_dir) == ctx.sweep_dir:
            return info
    path = ctx.sweep_dir / SWEEP_FILE
    return SweepInfo.load(path.read_text()) if path.is_file() else None


SKIPPED_PREFIX = "skipped."  # parent tag skipped.<job num> = the FINISHED run standing in


def record_skip(info: SweepInfo, job_num: int | None, run_id: str) -> None:
    """A job skipped because its identical config already FINISHED: the parent of this launch
    names the run that stands in for it (the run itself stays under the sweep that made it)."""
    client = tracking.client_for(info.uri)
    client.set_tag(info.parent_run_id, f"{SKIPPED_PREFIX}{job_num}", run_id)


def skipped(info: SweepInfo) -> dict[str, str]:
    client = tracking.client_for(info.uri)
    tags = client.get_run(info.parent_run_id).data.tags
    return {k[len(SKIPPED_PREFIX) :]: v for k, v in tags.items() if k.startswith(SKIPPED_PREFIX)}


def children(info: SweepInfo) -> list:
    client = tracking.client_for(info.uri)
    exp = client.get_experiment_by_name(info.experiment)
    if exp is None:
        return []
    return client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`{tracking.PARENT_TAG}` = '{info.parent_run_id}'",
        max_results=10000,
        order_by=["attributes.start_time ASC"],
    )


def finish(info: SweepInfo, interrupted: bool = False) -> list:
    """End the parent run from its children's statuses; return the children not FINISHED."""
    client = tracking.client_for(info.uri)
    runs = children(info)
    counts = Counter(r.info.status for r in runs)
    not_finished = [r for r in runs if r.info.status != tracking.FINISHED]
    n_skipped = len(skipped(info))
    missing = (info.expected_jobs or len(runs) + n_skipped) - len(runs) - n_skipped
    tags = {
        "jobs_total": len(runs) + n_skipped,
        "jobs_skipped": n_skipped,
        "jobs_finished": counts.get(tracking.FINISHED, 0),
        "jobs_failed": counts.get(tracking.FAILED, 0),
        "jobs_killed": counts.get(tracking.KILLED, 0),
    }
    if missing > 0:
        tags["jobs_missing"] = missing
    from mlflow.entities import RunTag

    client.log_batch(info.parent_run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])
    if interrupted:
        status = tracking.KILLED
    elif not_finished or missing > 0:
        status = tracking.FAILED
    else:
        status = tracking.FINISHED
    client.set_terminated(info.parent_run_id, status=status)
    return not_finished
