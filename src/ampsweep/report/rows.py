"""The numbers of a report: each run against its baseline, as pure functions of run data.

The baseline of a run is the run of the baseline mode (fp32 unless ``--baseline``) in the same
sweep whose config differs from it only in ``precision.*``.
"""

from __future__ import annotations

from ampsweep.report.model import Row, RunData, is_number
from ampsweep.tracking.store import DATASET, ERROR, FINISHED, JOB_NUM, MODEL

OPTIONAL_PREFIXES = ("amp/grad_",)  # e.g. amp/grad_underflow_frac: columns only when logged


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if is_number(value) and is_number(base) and base > 0 else None


def config_key(params: dict[str, str]) -> tuple:
    """A run's config apart from its precision: runs with equal keys are comparable."""
    return tuple(sorted((k, v) for k, v in params.items() if not k.startswith("precision.")))


def find_baseline(run: RunData, runs: list[RunData], mode: str) -> RunData | None:
    key = config_key(run.params)
    for other in runs:
        if other.precision == mode and other.status == FINISHED and config_key(other.params) == key:
            return other
    return None


def compute_rows(runs: list[RunData], baseline_mode: str = "fp32") -> list[Row]:
    rows = []
    for run in runs:
        m = run.metrics
        row = Row(
            run_id=run.run_id,
            name=run.name,
            precision=run.precision,
            model=run.tags.get(MODEL) or run.params.get("model.name", "?"),
            dataset=run.tags.get(DATASET) or run.params.get("dataset.name", "?"),
            status=run.status,
            job=run.tags.get(JOB_NUM),
            val_acc=m.get("val/acc"),
            val_ppl=m.get("val/perplexity"),
            unigram_ppl=m.get("data/unigram_perplexity"),
            samples_per_s=m.get("perf/samples_per_s"),
            tokens_per_s=m.get("perf/tokens_per_s"),
            activation_mib=m.get("mem/activation_mib"),
            peak_mib=m.get("mem/peak_allocated_mib"),
            skipped_steps=m.get("amp/skipped_steps"),
            loss_scale=m.get("amp/loss_scale"),
            extra={k: v for k, v in sorted(m.items()) if k.startswith(OPTIONAL_PREFIXES)},
            error=run.tags.get(ERROR, ""),
        )
        base = find_baseline(run, runs, baseline_mode)
        if base is None:
            same_mode = any(r.precision == baseline_mode for r in runs)
            row.note = (
                f"no {baseline_mode} run of the same config"
                if same_mode
                else f"no {baseline_mode} run in this sweep"
            )
        elif run.status == FINISHED:
            b = base.metrics
            row.baseline, row.baseline_run_id = base.name, base.run_id
            if is_number(row.val_acc) and is_number(b.get("val/acc")):
                row.acc_delta = row.val_acc - b["val/acc"]
            row.ppl_ratio = ratio(row.val_ppl, b.get("val/perplexity"))
            row.speedup = ratio(row.samples_per_s, b.get("perf/samples_per_s"))
            row.activation_ratio = ratio(row.activation_mib, b.get("mem/activation_mib"))
            row.peak_ratio = ratio(row.peak_mib, b.get("mem/peak_allocated_mib"))
        rows.append(row)
    return rows
