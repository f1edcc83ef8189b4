"""The numbers of a report: each run against its baseline, as pure functions of run data.

The baseline of a run is the run of the baseline mode (fp32 unless ``--baseline``) in the same
sweep whose config differs from it only in ``precision.*``: with repeated seeds, the baseline
run of the same seed (``report.groups`` then summarises the repeats).
"""

from __future__ import annotations

from ampsweep.measure import capacity, contention
from ampsweep.precision.modes import BASELINE
from ampsweep.report import numerics_fields
from ampsweep.report.model import Row, RunData, is_number
from ampsweep.tracking.store import (
    DATA_PREFIX,
    DATASET,
    ERROR,
    FINISHED,
    FP8_EMULATED,
    JOB_NUM,
    MODEL,
)

OPTIONAL_PREFIXES = ("amp/grad_",)  # e.g. amp/grad_underflow_frac: columns only when logged
SEED = "trainer.seed"  # what repeats of one configuration differ in


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if is_number(value) and is_number(base) and base > 0 else None


# Keys that name a run rather than configure it: never a reason two runs are not comparable.
LABELS = ("tracking.run_name",)
# Precision settings that tell two runs of one mode apart in the report's config column (a
# run of bf16 and the doctor's bf16 with precision.keep_fp32=[fc2]); other precision keys
# follow from the mode and are said by its name.
# FSDP's mixed-precision policy is a precision axis of its own (a sweep over
# precision.fsdp.reduce_dtype=fp32,bf16 compares its values as it compares modes).
SHOWN_PRECISION = (
    "precision.keep_fp32", "precision.fsdp.param_dtype", "precision.fsdp.reduce_dtype",
)  # fmt: skip


def shown_precision(params: dict[str, str]) -> tuple:
    """The precision settings beyond the mode that tell a run's row apart (SHOWN_PRECISION)."""
    return tuple((k, params[k]) for k in SHOWN_PRECISION if k in params)


def config_key(params: dict[str, str], ignore: tuple[str, ...] = ()) -> tuple:
    """A run's config apart from its precision (and the keys in ``ignore``): runs with equal
    keys are comparable."""
    skip = (*ignore, *LABELS)
    return tuple(
        sorted(
            (k, v) for k, v in params.items() if not k.startswith("precision.") and k not in skip
        )
    )


def varying(runs: list[RunData], ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """Run id -> the settings beyond precision that tell it apart from the sweep's other runs
    (``lr=0.01``; a key shortened to its last part unless that is ambiguous). Where the model
    or data set itself differs (they have columns of their own), its settings are left out."""
    skip = (*ignore, *LABELS)
    keys = sorted(
        {
            k
            for r in runs
            for k in r.params
            if (not k.startswith("precision.") or k in SHOWN_PRECISION) and k not in skip
        }
    )
    differ = [k for k in keys if len({r.params.get(k) for r in runs}) > 1]
    swapped = {k.split(".", 1)[0] for k in differ if k.endswith(".name")}
    differ = [k for k in differ if k.split(".", 1)[0] not in swapped or k == "optimizer.name"]
    short = {k: k.rsplit(".", 1)[-1] for k in differ}
    short["optimizer.name"] = "optimizer"
    names = [short[k] for k in differ]
    label = {k: short[k] if names.count(short[k]) == 1 else k for k in differ}
    return {r.run_id: " ".join(f"{label[k]}={r.params.get(k, '-')}" for k in differ) for r in runs}


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
        m = run.metrics
        row = Row(
            run_id=run.run_id,
            name=run.name,
            precision=run.precision,
            model=run.tags.get(MODEL) or run.params.get("model.name", "?"),
            dataset=run.tags.get(DATASET) or run.params.get("dataset.name", "?"),
            status=run.status,
            job=run.stands_in_for_job or run.tags.get(JOB_NUM),
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
            varies=varies.get(run.run_id, ""),
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
            **numerics_fields.row_fields(run),
        )
        row.contended = contended(m)
        row.contended_runs = int(row.contended)
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
            row.contended = row.contended or contended(b)  # a speed-up is timed on both
            row.contended_runs = int(row.contended)
            row.activation_ratio = ratio(row.activation_mib, b.get("mem/activation_mib"))
            row.peak_ratio = ratio(row.peak_mib, b.get("mem/peak_allocated_mib"))
            row.max_batch_ratio = ratio(row.max_batch, max_batch(b, budget))
        rows.append(row)
    return rows


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
