"""A sweep's report from the store: find the sweep, read its runs, and log the report back
to its parent run (report.md/.csv/.json, the charts, the headline numbers as metrics)."""

from __future__ import annotations

import re

from ampsweep.measure import capacity
from ampsweep.precision.modes import BASELINE
from ampsweep.report import quality
from ampsweep.report.findings import findings
from ampsweep.report.groups import summarise
from ampsweep.report.model import Report, RunData
from ampsweep.report.recommend import recommend
from ampsweep.report.render import to_csv, to_json, to_markdown, to_note
from ampsweep.report.rows import compute_rows
from ampsweep.tracking import store
from ampsweep.tracking.secrets import mask_files, mask_text

HISTORY_KEYS = ("val/loss", "amp/loss_scale")  # step-wise metrics the charts draw


class ReportError(Exception):
    """The report cannot be made (no store, no sweep, unknown run): one line with the fix."""


def find_sweep(client, sweep: str = "latest", experiment: str | None = None):
    """The parent run of a sweep and the newer sweeps passed over: ``latest`` is the newest
    sweep (in ``experiment``, or in any experiment) that has runs to report: a sweep whose
    jobs all failed before recording, or an interrupted launch, has none. Else a run id."""
    if sweep != "latest":
        try:
            return client.get_run(sweep), []
        except Exception:
            raise ReportError(
                f"--sweep {sweep}: no such run in this store: pass a sweep's parent run id "
                "(see `ampsweep ui`), or --sweep latest"
            ) from None
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise ReportError(f"--experiment {experiment}: no such experiment in this store")
        ids = [exp.experiment_id]
    else:
        ids = [e.experiment_id for e in client.search_experiments()]
    passed_over = []
    for parent in store.sweeps(client, ids, limit=100):
        if store.skipped_jobs(parent) or store.children(client, parent):
            return parent, passed_over
        passed_over.append(parent)
    where = f"experiment {experiment}" if experiment else "this store"
    raise ReportError(
        f"no sweep with runs in {where}: run one first, e.g. ampsweep train -m "
        "experiment=precision_sweep"
    )


def load_sweep(client, parent) -> tuple[dict[str, str], list[RunData]]:
    """The sweep's runs: its children, and the earlier FINISHED runs that stood in for the
    jobs a relaunch skipped (so the report of a relaunch is the whole sweep's)."""
    runs = [(r, None) for r in store.children(client, parent)]
    for job, run_id in store.skipped_jobs(parent).items():
        run = store.find_run(client, run_id)
        if run is not None:
            runs.append((run, job))
    if not runs:
        raise ReportError(
            f"--sweep {parent.info.run_id}: run {parent.info.run_name} has no child runs: "
            "it is not a sweep's parent run"
        )
    data = [_run_data(client, r, job) for r, job in runs]
    # Jobs are numbered by Hydra; order rows that way (start times tie in parallel launchers).
    data.sort(key=lambda d: int(d.stands_in_for_job or d.tags.get(store.JOB_NUM, "0") or 0))
    t = parent.data.tags
    sweep = {
        "run_id": parent.info.run_id,
        "name": parent.info.run_name,
        "experiment_id": parent.info.experiment_id,
        "sweep_dir": t.get(store.SWEEP_DIR, ""),
        "command": t.get(store.COMMAND, ""),
    }
    return sweep, data


def _run_data(client, r, stands_in_for_job: str | None) -> RunData:
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, key)]
        for key in HISTORY_KEYS
        if key in r.data.metrics
    }
    timeline = {
        key: [(m.step, m.value, m.timestamp) for m in client.get_metric_history(r.info.run_id, key)]
        for key in quality.QUALITY_KEYS
        if key in r.data.metrics
    }
    return RunData(
        run_id=r.info.run_id,
        name=r.info.run_name,
        status=r.info.status,
        params=dict(r.data.params),
        tags=dict(r.data.tags),
        metrics=dict(r.data.metrics),
        history=history,
        stands_in_for_job=stands_in_for_job,
        timeline=timeline,
        started_ms=r.info.start_time or 0,
    )


def make_report(
    sweep: dict,
    runs: list[RunData],
    baseline_mode: str = BASELINE,
    budget: int | None = None,
    target: float | None = None,
) -> Report:
    """The report of a sweep's runs; ``budget``: bytes for the max batch column (default: what
    each CUDA run predicted for its GPU's memory; nothing on a CPU); ``target``: the quality
    whose time to reach the report measures (default: near the baseline's, ``report.quality``)."""
    rows = compute_rows(runs, baseline_mode, budget)
    summary = summarise(rows, runs)
    targets = quality.apply(rows, summary, runs, baseline_mode, target)
    finished = [r for r in runs if r.status == store.FINISHED and r.tags.get(store.DEVICE)]
    source = (finished or [r for r in runs if r.tags.get(store.DEVICE)] or runs)[0].tags
    device = {k: source[k] for k in store.DEVICE_TAGS if k in source}
    words = budget_words(runs, budget)
    found = findings(summary, device, baseline_mode, words, targets)
    advice = recommend(summary, device, baseline_mode, sweep.get("command", ""))
    return Report(sweep, device, baseline_mode, rows, found, runs, summary, words, advice, targets)


def budget_words(runs: list[RunData], budget: int | None) -> str:
    """The memory budget of the max batch column as the findings name it: ``on an 80 GiB
    GPU`` (``--memory-budget``), ``on this 140 GiB GPU`` (what a CUDA run measured), or
    nothing (a CPU run, no budget given)."""
    if budget is not None:
        size = capacity.format_size(budget)
        article = "an" if re.match(r"(8|11(\D|$)|18(\D|$))", size) else "a"
        return f"on {article} {size} GPU"
    gib = [r.metrics[capacity.BUDGET_GIB] for r in runs if capacity.BUDGET_GIB in r.metrics]
    return f"on this {capacity.format_size(max(gib) * capacity.GIB)} GPU" if gib else ""


def build_report(
    client,
    parent_run_id: str,
    baseline_mode: str = BASELINE,
    budget: int | None = None,
    target: float | None = None,
) -> Report:
    parent, _ = find_sweep(client, parent_run_id)
    sweep, runs = load_sweep(client, parent)
    return make_report(sweep, runs, baseline_mode, budget, target)


def publish(client, report: Report) -> None:
    """Log the report to the sweep's parent run: report.md/.csv/.json, the charts under
    charts/, the headline numbers as parent metrics, and the recommendation, table, charts
    and findings as the run's description (``store.NOTE``: the UI's Overview page)."""
    import tempfile
    import time
    from pathlib import Path

    from mlflow.entities import Metric

    from ampsweep.report import charts

    run_id = report.sweep["run_id"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "report.md").write_text(to_markdown(report))
        (folder / "report.csv").write_text(to_csv(report))
        (folder / "report.json").write_text(to_json(report))
        made = charts.write_charts(report, folder / "charts")
        mask_files(folder)  # the sweep's command and folders may name a secret
        client.log_artifacts(run_id, str(folder))
    paths = [f"charts/{p.name}" for p in made]
    client.set_tag(run_id, store.NOTE, mask_text(to_note(report, paths, store.NOTE_MAX_CHARS)))
    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, 0) for k, v in report.headline_metrics().items()]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000])
