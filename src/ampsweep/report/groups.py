"""Repeats of one configuration summarised in one row: means with 95% confidence intervals.

Runs whose configs differ only in ``trainer.seed`` (``sweep.repeats=N``, or an explicit
``trainer.seed=0,1,2`` sweep) are repeats of one configuration. Per mode, their row holds the
mean of each measurement with its t interval, and the comparisons with the baseline *paired*:
each run's difference (accuracy) or ratio (speed, memory) to the baseline run of its own seed,
averaged (ratios geometrically) with their interval (``report.stats``). A run that did not
finish keeps a row of its own; a configuration run once keeps its run's row unchanged.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import replace

from ampsweep.report import numerics_fields, stats
from ampsweep.report.model import Row, RunData, is_number
from ampsweep.report.rows import SEED, config_key, shown_precision, varying
from ampsweep.tracking.store import FINISHED

MEANS = (
    "val_acc", "samples_per_s", "step_ms", "tflops", "mfu", "activation_mib", "peak_mib",
    "skipped_steps", "bytes_per_sample", "model_mib", "max_batch", "fp8_flop_share", "steps",
    "update_lost_frac", "cpu_used", "cpu_others", "cpu_cores",
)  # fmt: skip
DIFFERENCES = ("acc_delta",)  # each run minus its same-seed baseline
RATIOS = ("speedup", "activation_ratio", "peak_ratio", "max_batch_ratio")  # run / baseline
# The range each mean cannot leave (fractions in [0, 1], a difference of two in [-1, 1]); every
# other mean is a count, a size, a rate or a time, never negative.
BOUNDS = {
    **dict.fromkeys(("val_acc", "mfu", "fp8_flop_share", "update_lost_frac"), (0.0, 1.0)),
    "acc_delta": (-1.0, 1.0),
}


def summarise(rows: list[Row], runs: list[RunData]) -> list[Row]:
    """One row per configuration and mode (the finished runs that differ only in the seed),
    in the order of their first run; unfinished runs keep their own rows."""
    params = {r.run_id: r.params for r in runs}
    groups: dict[tuple, list[Row]] = {}
    order: list[tuple | str] = []
    for row in rows:
        if row.status != FINISHED:
            order.append(row.run_id)
            continue
        run_params = params.get(row.run_id, {})
        key = (row.precision, shown_precision(run_params), config_key(run_params, ignore=(SEED,)))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(row)
    if all(len(g) == 1 for g in groups.values()):
        return list(rows)  # nothing repeated: a row per run, as they are
    varies = varying(runs, ignore=(SEED,)) if len(runs) > 1 else {}
    by_run = {row.run_id: row for row in rows}
    summary = {key: _summary(group, varies) for key, group in groups.items()}
    name_of = {member: s.name for s in summary.values() for member in s.members}
    out = []
    for key in order:
        if isinstance(key, str):
            out.append(by_run[key])
            continue
        row = summary[key]
        if row.baseline_run_id:  # named after the baseline's summary, not one of its runs
            row.baseline = name_of.get(row.baseline_run_id, row.baseline)
        out.append(row)
    return out


def _summary(group: list[Row], varies: dict[str, str]) -> Row:
    first = group[0]
    if len(group) == 1:
        return replace(first, members=[first.run_id], varies=varies.get(first.run_id, ""))
    ci: dict[str, stats.Estimate] = {}
    values: dict[str, float | None] = {}
    for name in MEANS + DIFFERENCES:
        vals = [v for r in group if is_number(v := getattr(r, name))]
        est = stats.mean_interval(vals, bounds=BOUNDS.get(name, (0.0, None)))
        _keep(name, est, ci, values)
    # A contended run's speed-up is left out where some runs were not contended (it measured
    # the other processes as much as the mode); where all were, the row says so.
    clean = [r for r in group if not r.contended] or group
    for name in RATIOS:
        of = clean if name == "speedup" else group
        est = stats.ratio_interval([v for r in of if is_number(v := getattr(r, name))])
        _keep(name, est, ci, values)
    scales = [r.loss_scale for r in group if is_number(r.loss_scale)]
    extra_keys = sorted({k for r in group for k in r.extra})
    extra = {}
    for k in extra_keys:
        vals = [r.extra[k] for r in group if is_number(r.extra.get(k))]
        if vals:
            extra[k] = sum(vals) / len(vals)
    names = [r.name for r in group]
    return replace(
        first,
        **values,
        name=_common_name(names),
        job=None,
        seed=",".join(r.seed for r in group),
        loss_scale=statistics.median(scales) if scales else None,  # a typical final scale
        extra=extra,
        **numerics_fields.group_fields(group),
        note="; ".join(sorted({r.note for r in group if r.note})),
        varies=varies.get(first.run_id, ""),
        reused=all(r.reused for r in group),
        n=len(group),
        contended=all(r.contended for r in group),
        contended_runs=sum(r.contended for r in group),
        ci=ci,
        members=[r.run_id for r in group],
    )


def _keep(name: str, est, ci: dict, values: dict) -> None:
    values[name] = est.mean if est is not None else None
    if est is not None and est.has_interval:
        ci[name] = est


def _common_name(names: list[str]) -> str:
    """``fp32-cnn-digits`` for ``fp32-cnn-digits-0``, ``fp32-cnn-digits-6``, ...: the run names
    without the job numbers a sweep appends to names that repeat."""
    bare = {re.sub(r"-\d+$", "", n) for n in names}
    if len(bare) == 1:
        return bare.pop()
    return os.path.commonprefix(names).rstrip("-_ ") or names[0]
