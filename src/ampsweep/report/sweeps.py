"""A sweep's report from the store: find the sweep, read its runs, make each run a row
against its baseline, make the report, and log it back to the sweep's parent run
(report.md/.csv/.json, the charts, the headline numbers as metrics).

The baseline of a run is the run of the baseline mode (fp32 unless ``--baseline``) in the same
sweep whose config differs from it only in ``precision.*``: with repeated seeds, the baseline
run of the same seed (``report.stats`` then summarises the repeats). A row holds what the run
measured (its score, speed, memory, what went wrong numerically) and each against the
baseline's.
"""

from __future__ import annotations

import re
from typing import Any

from ampsweep.measure import capacity, contention
from ampsweep.measure.names import (
    FP16_OVERFLOW,
    NONFINITE_FIX,
    NONFINITE_KIND,
    NONFINITE_MODULE,
    NONFINITE_STEP,
    NONFINITE_STEPS,
    NONFINITE_WHERE,
    PROBE,
    RUN_UPDATE_LOST,
    UPDATE_LOST_LAYERS,
)
from ampsweep.precision import modes
from ampsweep.precision.modes import BASELINE
from ampsweep.report import memory, predicted, quality
from ampsweep.report.findings import findings, untimed_findings
from ampsweep.report.model import Report, Row, RunData, is_number, parse_number
from ampsweep.report.recommend import recommend
from ampsweep.report.render import to_csv, to_json, to_markdown, to_note
from ampsweep.report.stats import SEED, config_key, shown_precision, summarise, varying
from ampsweep.tracking import store
from ampsweep.tracking.secrets import mask_files, mask_text
from ampsweep.tracking.store import (
    DATA_PREFIX,
    DATASET,
    DIVERGED,
    ERROR,
    FINISHED,
    FP8_EMULATED,
    JOB_NUM,
    MODEL,
)

HISTORY_KEYS = ("val/loss", "amp/loss_scale")  # step-wise metrics the charts draw
OPTIONAL_PREFIXES = ("amp/grad_", "predict/")  # e.g. amp/grad_underflow_frac: when logged
# The loss scaler's history and settings
LOSS_SCALE, TRAIN_STEPS = "amp/loss_scale", "train/steps"
SCALER = "precision.scaler."  # its params: min_scale, growth_interval, dynamic


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
    passed_over: list = []  # MLflow runs
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
    runs: list[tuple[Any, str | None]] = [(r, None) for r in store.children(client, parent)]
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
        "jobs_not_run": _not_run(t.get(store.JOBS_EXPECTED, ""), data),
    }
    return sweep, data


def _not_run(expected: str, data: list[RunData]) -> str:
    """The numbers of the jobs the parent expected that recorded no run (an interrupted
    sweep's, or a worker's that died), comma-separated; "" when every job ran."""
    if not expected.isdigit():
        return ""
    ran = {d.stands_in_for_job or d.tags.get(store.JOB_NUM, "") for d in data}
    return ",".join(str(n) for n in range(int(expected)) if str(n) not in ran)


def not_run_finding(sweep: dict[str, str]) -> str | None:
    """What an interrupted sweep's report says of the jobs that never ran, and the relaunch
    that runs them (a relaunch skips the jobs that finished and resumes a killed one)."""
    missing = [f"#{n}" for n in sweep.get("jobs_not_run", "").split(",") if n]
    if not missing:
        return None
    command = sweep.get("command") or "the sweep's command"
    return (
        f"{len(missing)} job(s) of this sweep did not run ({', '.join(missing)}), so they have "
        f"no row: relaunch the sweep to run them (jobs that finished are skipped): {command}"
    )


def _run_data(client, r, stands_in_for_job: str | None) -> RunData:
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, key)]
        for key in HISTORY_KEYS
        if key in r.data.metrics
    }
    data = RunData(
        run_id=r.info.run_id,
        name=r.info.run_name,
        status=r.info.status,
        params=dict(r.data.params),
        tags=dict(r.data.tags),
        metrics=dict(r.data.metrics),
        history=history,
        stands_in_for_job=stands_in_for_job,
        started_ms=r.info.start_time or 0,
        activations_by_module=memory.load_modules(client, r.info.run_id),
    )
    # The score's evaluations with their timestamps: its time to quality (``report.quality``)
    if data.score is not None and data.score.name in data.metrics:
        key = data.score.name
        points = client.get_metric_history(r.info.run_id, key)
        data.timeline = {key: [(m.step, m.value, m.timestamp) for m in points]}
    return data


# ---------------------------------------------------------------- each run a row


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if is_number(value) and is_number(base) and base > 0 else None


def find_baseline(run: RunData, runs: list[RunData], mode: str) -> RunData | None:
    key = config_key(run.params)
    for other in runs:
        if other.precision == mode and other.status == FINISHED and config_key(other.params) == key:
            return other
    return None


def max_batch(metrics: dict[str, float], budget: float | None) -> float | None:
    """The largest batch for ``budget`` bytes from a run's measurements; without a budget, the
    one the run predicted for its GPU's memory (none on a CPU)."""
    if budget is None:
        return metrics.get(capacity.MAX_BATCH_PREDICTED)
    per_sample = metrics.get(capacity.BYTES_PER_SAMPLE)
    model_mib = metrics.get(capacity.MODEL_MIB)
    if not is_number(per_sample) or not is_number(model_mib):
        return None
    return capacity.predict_max_batch(budget, model_mib * capacity.MIB, per_sample)


def compute_rows(
    runs: list[RunData], baseline_mode: str = BASELINE, budget: float | None = None
) -> list[Row]:
    """One row per run, compared with its baseline run (the same seed's, when seeds vary).
    ``budget``: bytes of memory for the max batch column (``--memory-budget``)."""
    rows = []
    varies = varying(runs) if len(runs) > 1 else {}
    for run in runs:
        row = _row(run, varies.get(run.run_id, ""), budget)
        base = find_baseline(run, runs, baseline_mode)
        if base is None:
            same_mode = any(r.precision == baseline_mode for r in runs)
            row.note = (
                f"no {baseline_mode} run of the same config"
                if same_mode
                else f"no {baseline_mode} run in this sweep"
            )
        elif run.status == FINISHED:
            _compare(row, base, budget)
        rows.append(row)
    return rows


def _row(run: RunData, varies: str, budget: float | None) -> Row:
    """What the run itself measured."""
    m, score = run.metrics, run.score
    row = Row(
        run_id=run.run_id,
        name=run.name,
        precision=run.precision,
        model=run.tags.get(MODEL) or run.params.get("model.name", "?"),
        dataset=run.tags.get(DATASET) or run.params.get("dataset.name", "?"),
        status=run.status,
        job=run.stands_in_for_job or run.tags.get(JOB_NUM),
        score=score,
        quality=m.get(score.name) if score is not None else None,
        val_acc=m.get("val/acc"),
        val_ppl=m.get("val/perplexity"),
        unigram_ppl=m.get("data/unigram_perplexity"),
        samples_per_s=m.get("perf/samples_per_s"),
        tokens_per_s=m.get("perf/tokens_per_s"),
        activation_mib=m.get("mem/activation_mib"),
        peak_mib=m.get("mem/peak_allocated_mib"),
        skipped_steps=m.get("amp/skipped_steps"),
        loss_scale=m.get("amp/loss_scale"),
        step_ms=m.get("perf/step_time_ms"),
        tflops=m.get("perf/tflops"),
        mfu=m.get("perf/mfu"),
        varies=varies,
        precision_set=shown_precision(run.params),
        reused=run.stands_in_for_job is not None,
        extra={k: v for k, v in sorted(m.items()) if k.startswith(OPTIONAL_PREFIXES)},
        error=run.tags.get(ERROR, ""),
        seed=run.params.get(SEED, ""),
        bytes_per_sample=m.get(capacity.BYTES_PER_SAMPLE),
        model_mib=m.get(capacity.MODEL_MIB),
        max_batch=max_batch(m, budget),
        num_classes=_count(run.tags.get(f"{DATA_PREFIX}num_classes")),
        emulated=run.tags.get(FP8_EMULATED) == "true",
        fp8_flop_share=m.get("fp8/flop_share"),
        cpu_used=m.get(contention.CORES_USED),
        cpu_others=m.get(contention.CORES_OTHERS),
        cpu_cores=m.get(contention.CORES),
        memory=memory.row_memory(run),
        **row_fields(run),
    )
    row.contended = contended(m)
    row.contended_runs = int(row.contended)
    return row


def _compare(row: Row, base: RunData, budget: float | None) -> None:
    """The row against its baseline run: the score in its own direction and unit, the rest as
    ratios."""
    b = base.metrics
    row.baseline, row.baseline_run_id = base.name, base.run_id
    if row.score is not None and is_number(row.quality) and is_number(b.get(row.score.name)):
        row.quality_change = row.score.change(row.quality, b[row.score.name])
    if is_number(row.val_acc) and is_number(b.get("val/acc")):
        row.acc_delta = row.val_acc - b["val/acc"]
    row.ppl_ratio = ratio(row.val_ppl, b.get("val/perplexity"))
    row.speedup = ratio(row.samples_per_s, b.get("perf/samples_per_s"))
    row.contended = row.contended or contended(b)  # a speed-up is timed on both
    row.contended_runs = int(row.contended)
    row.activation_ratio = ratio(row.activation_mib, b.get("mem/activation_mib"))
    row.peak_ratio = ratio(row.peak_mib, b.get("mem/peak_allocated_mib"))
    row.max_batch_ratio = ratio(row.max_batch, max_batch(b, budget))


def _count(text: str | None) -> int | None:
    try:
        return int(text) if text else None
    except ValueError:
        return None


def contended(metrics: dict[str, float]) -> bool:
    """Whether a run's timed steps shared the machine with busy processes."""
    return contention.contended(
        metrics.get(contention.CORES_USED),
        metrics.get(contention.CORES_OTHERS),
        metrics.get(contention.CORES),
    )


# ---------------------------------------------------------------- what went wrong numerically


def row_fields(run: RunData) -> dict:
    """The numerics fields of a run's row (``model.Row``), from its tags, metrics and params."""
    t, m = run.tags, run.metrics
    return {
        **_origin(t, m),
        **_scaler(run),
        "diverged": t.get(DIVERGED) == "true",
        "steps": _steps(run),
        "probe": {k: m[k] for k in PROBE if k in m},
        "fp16_overflow": t.get(FP16_OVERFLOW, ""),
        "update_lost_layers": t.get(UPDATE_LOST_LAYERS, ""),
        "update_lost_frac": m.get(RUN_UPDATE_LOST),
        "master_weights": run.params.get("precision.master_weights", "").lower() == "true",
    }


def _steps(run: RunData) -> float | None:
    """The optimizer steps a run trained: train/steps, else the last step its loss scale was
    logged at (a run logs its final numbers, train/* left out, at its last step; a failed
    run's last is its last log step), else its last evaluation's step (a run without a scaler
    evaluates at its end)."""
    if is_number(run.metrics.get(TRAIN_STEPS)):
        return run.metrics[TRAIN_STEPS]
    logged = run.history.get(LOSS_SCALE) or [p[:2] for t in run.timeline.values() for p in t]
    return float(max(step for step, _ in logged)) if logged else None


def _origin(tags: dict[str, str], metrics: dict[str, float]) -> dict:
    if not tags.get(NONFINITE_WHERE):
        return {}
    step = tags.get(NONFINITE_STEP, "")
    return {
        "nonfinite_step": int(step) if step.isdigit() else None,
        "nonfinite_kind": tags.get(NONFINITE_KIND, ""),
        "nonfinite_module": tags.get(NONFINITE_MODULE, ""),
        "nonfinite_where": tags[NONFINITE_WHERE],
        "nonfinite_fix": tags.get(NONFINITE_FIX, ""),
        "nonfinite_steps": metrics.get(NONFINITE_STEPS),
        "nonfinite_runs": 1,
    }


def _scaler(run: RunData) -> dict:
    """The scaler's first logged scale, its growth over it, and its settings (a setting left
    at the mode's default is logged as null: the mode table says what it was)."""
    p = run.params
    logged = [v for _, v in sorted(run.history.get(LOSS_SCALE, [])) if is_number(v)]
    first = logged[0] if logged and logged[0] > 0 else None
    dynamic = {"true": True, "false": False}.get(p.get(SCALER + "dynamic", "").lower())
    mode = modes.get(run.precision)
    if dynamic is None and mode is not None:
        dynamic = mode.dynamic_scale
    return {
        "scale_first": first,
        "scale_growth": max(logged) / first if first else None,
        "scale_min": parse_number(p.get(SCALER + "min_scale")),
        "scale_growth_interval": parse_number(p.get(SCALER + "growth_interval")),
        "scale_dynamic": dynamic,
    }


# ---------------------------------------------------------------- the report


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
    found += untimed_findings(rows, runs)
    found += memory.prediction_findings(rows, runs)
    found += predicted.findings(summary)
    unrun = not_run_finding(sweep)
    if unrun:
        found.insert(0, unrun)
    base = next((r for r in runs if r.tags.get(store.PRECISION) == baseline_mode), runs[0])
    trained = {k: base.params.get(k, "") for k in ("trainer.epochs", "trainer.max_steps")}
    advice = recommend(summary, device, baseline_mode, sweep.get("command", ""), trained)
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
