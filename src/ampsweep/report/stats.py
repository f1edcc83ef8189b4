"""Repeats and searches: which runs are one configuration, their means with confidence
intervals, and a search's best trial per mode; pure functions of run data.

A configuration run N times with different seeds gives N values of each metric. Its mean gets
a two-sided confidence interval from Student's t distribution (scipy), which is right for small
N (the normal approximation is far too narrow at N=3). A mode is compared with the baseline
*paired*: each run against the baseline run of the same seed, so what the seed changes (the
initial weights, the data order) cancels out of the difference. Ratios (speed-up, memory ratio)
are averaged on the log scale: the interval of a ratio is then symmetric in "x times faster"
and "x times slower", and never crosses zero.

Runs whose configs differ only in ``trainer.seed`` (``sweep.repeats=N``, or an explicit
``trainer.seed=0,1,2`` sweep) are repeats of one configuration (``summarise``): per mode, their
row holds the mean of each measurement with its t interval, and the comparisons with the
baseline paired (each run's difference or ratio to the baseline run of its own seed). A run
that did not finish keeps a row of its own; a configuration run once keeps its run's row. A
search (``hydra/sweeper=optuna``, or a grid of several settings per mode) gets each mode's
best trial (``best_by_mode``), by the objective a search minimises, the final validation loss
(what a job returns to the sweeper: ``runner.job.JobOutcome.__float__``).
"""

from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ampsweep.config.score import Score
from ampsweep.engine.run_folder import NOT_HASHED
from ampsweep.report.model import Estimate, Report, Row, RunData, is_number
from ampsweep.tracking.store import FINISHED

LEVEL = 0.95  # the confidence level of every interval in the report
# Below three runs an interval is too wide to judge unless it clears the null value anyway:
# with two runs Student's t is 12.7 (4.3 with three), so one noisy pair spans orders of
# magnitude.
MIN_REPEATS = 3
# How narrow an interval must be to be worth its runs: a ratio within 10% either way of its
# mean, a mean within 10% of itself. What "repeats needed" aims at.
PRECISION_WANTED = 0.10
MAX_REPEATS = 100  # beyond this many repeats the report says "more than 100"


def t_quantile(level: float, dof: int) -> float:
    """The two-sided critical value of Student's t with ``dof`` degrees of freedom: the
    inverse of its distribution function (scipy.special's, the one ``scipy.stats.t.ppf``
    calls, without importing scipy.stats, a much larger import, at the end of a sweep)."""
    from scipy import special

    return float(special.stdtrit(dof, 0.5 + level / 2))


def mean_interval(
    values: Sequence[float],
    level: float = LEVEL,
    bounds: tuple[float | None, float | None] = (None, None),
) -> Estimate | None:
    """The mean of ``values`` and its t interval; None for no values. ``bounds``: the range
    the quantity cannot leave (an accuracy lies in [0, 1]); the t interval, symmetric by
    construction, is cut at them rather than reporting e.g. an accuracy of up to 1.24."""
    xs = [float(v) for v in values if _finite(v)]
    n = len(xs)
    if n == 0:
        return None
    mean = sum(xs) / n
    if n == 1:
        return Estimate(mean, None, None, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    lowest, highest = bounds
    low = mean - half if lowest is None else max(lowest, mean - half)
    high = mean + half if highest is None else min(highest, mean + half)
    return Estimate(mean, low, high, n)


def paired_difference(
    values: Sequence[float], baselines: Sequence[float], level: float = LEVEL
) -> Estimate | None:
    """The mean of ``values[i] - baselines[i]`` (each pair from the same seed) and its
    interval: the paired t interval."""
    if len(values) != len(baselines):
        raise ValueError("paired_difference needs one baseline per value")
    return mean_interval([v - b for v, b in zip(values, baselines, strict=True)], level)


def ratio_interval(ratios: Sequence[float], level: float = LEVEL) -> Estimate | None:
    """The geometric mean of positive ratios (each a run over its same-seed baseline) and its
    interval, computed on the log scale and mapped back."""
    logs = [math.log(r) for r in ratios if _finite(r) and r > 0]
    est = mean_interval(logs, level)
    if est is None:
        return None
    if est.low is None or est.high is None:
        return Estimate(math.exp(est.mean), None, None, est.n)
    return Estimate(math.exp(est.mean), math.exp(est.low), math.exp(est.high), est.n)


def paired_ratio(
    values: Sequence[float], baselines: Sequence[float], level: float = LEVEL
) -> Estimate | None:
    """``ratio_interval`` of ``values[i] / baselines[i]``."""
    if len(values) != len(baselines):
        raise ValueError("paired_ratio needs one baseline per value")
    pairs = zip(values, baselines, strict=True)
    return ratio_interval([v / b for v, b in pairs if _finite(v) and _finite(b) and b > 0], level)


def repeats_needed(
    est: Estimate | None, target: float, ratio: bool = False, level: float = LEVEL
) -> int | None:
    """The number of runs at which the interval's half-width would fall to ``target`` at the
    spread ``est`` observed (its standard deviation, recovered from its half-width and t);
    for a ``ratio`` the half-width is on the log scale, so ``target`` 0.10 means within a
    factor 1.10 either way. None without an interval; ``MAX_REPEATS + 1`` when even
    ``MAX_REPEATS`` would not do."""
    if est is None or est.low is None or est.high is None:
        return None
    if ratio:
        half, target = (math.log(est.high) - math.log(est.low)) / 2, math.log(1 + target)
    else:
        half = (est.high - est.low) / 2  # the half_width
    sd = half * math.sqrt(est.n) / t_quantile(level, est.n - 1)
    for n in range(2, MAX_REPEATS + 1):
        if t_quantile(level, n - 1) * sd / math.sqrt(n) <= target:
            return n
    return MAX_REPEATS + 1


def compare(est: Estimate | None, null: float) -> str | None:
    """Where an interval lies against the value of "no difference" (0 for a difference, 1 for
    a ratio): "lower" or "higher" when the whole interval lies on that side (at any number of
    runs), "indistinguishable" when it contains ``null`` over ``MIN_REPEATS`` runs or more,
    "too wide" when it contains ``null`` over fewer (too few runs to call it a tie); None
    without an interval."""
    if est is None or est.low is None or est.high is None:
        return None
    if est.high < null:
        return "lower"
    if est.low > null:
        return "higher"
    return "indistinguishable" if est.n >= MIN_REPEATS else "too wide"


def too_wide(est: Estimate, target: float, ratio: bool, unit: str) -> str:
    """Why an interval that contains "no difference" is no verdict, and the runs that would
    make it one: ``n`` runs observed a spread; at that spread the interval would narrow to
    ``target`` after the number ``repeats_needed`` finds."""
    needed = repeats_needed(est, target, ratio)
    assert needed is not None  # an interval that contains "no difference" has its ends
    runs = "2 runs" if est.n == 2 else f"{est.n} runs"
    more = (
        f"more than {MAX_REPEATS} runs per mode"
        if needed > MAX_REPEATS
        else f"about {needed} runs per mode (sweep.repeats={needed})"
    )
    return (
        f"with {runs} per mode the interval is too wide to judge: at this spread {more} "
        f"would narrow it to {unit}"
    )


def wide(est: Estimate | None, target: float, ratio: bool) -> bool:
    """An interval that says nothing yet: it contains "no difference" and either rests on
    fewer than ``MIN_REPEATS`` runs or is wider than ``target``."""
    if est is None:
        return False  # no interval: nothing to judge
    verdict = compare(est, 1.0 if ratio else 0.0)
    if verdict == "too wide":
        return True
    needed = repeats_needed(est, target, ratio)
    return verdict == "indistinguishable" and needed is not None and needed > est.n


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


# ---------------------------------------------------------------- one configuration

SEED = "trainer.seed"  # what repeats of one configuration differ in

# A run's name, and what the config hash leaves out (``engine.run_folder``): the run computes
# the same whatever they are, so they never part two runs, nor show in the config column.
NOT_COMPARED = ("tracking.run_name", *NOT_HASHED)
# Precision settings that tell two rows of one mode apart (bf16, the doctor's bf16 with
# precision.keep_fp32=[fc2]), each compared with its mode's baseline; the rest follow from the
# mode. FSDP's policy is a precision axis too (fsdp.reduce_dtype=fp32,bf16 compares as modes).
SHOWN_PRECISION = (
    "precision.master_weights",
    "precision.keep_fp32",
    "precision.fp8.keep_bf16",
    "precision.fsdp.param_dtype",
    "precision.fsdp.reduce_dtype",
)
UNSET = ("", "false", "[]", "none", "null")  # a setting at its default, as MLflow logged it


def shown_precision(params: dict[str, str]) -> tuple:
    """The precision settings beyond the mode that tell a run's row apart (SHOWN_PRECISION),
    those left at their defaults left out: a run of fp32 is one whatever its sweep set."""
    return tuple((k, v) for k in SHOWN_PRECISION if (v := params.get(k, "")).lower() not in UNSET)


def config_key(params: dict[str, str], ignore: tuple[str, ...] = ()) -> tuple:
    """A run's config apart from its precision (and the keys in ``ignore``): runs with equal
    keys are comparable."""
    skip = (*ignore, *NOT_COMPARED)
    return tuple(
        sorted(
            (k, v) for k, v in params.items() if not k.startswith("precision.") and k not in skip
        )
    )


def varying(runs: list[RunData], ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """Run id -> the settings beyond precision that tell it apart from the sweep's other runs
    (``lr=0.01``; a key shortened to its last part unless that is ambiguous): its configuration.
    Where the model or data set differs (columns of their own), its settings are left out."""
    skip = (*ignore, *NOT_COMPARED)
    keys = sorted({k for r in runs for k in r.params if not k.startswith("precision.")} - set(skip))
    differ = [k for k in keys if len({r.params.get(k) for r in runs}) > 1]
    swapped = {k.split(".", 1)[0] for k in differ if k.endswith(".name")}
    differ = [k for k in differ if k.split(".", 1)[0] not in swapped or k == "optimizer.name"]
    short = {k: k.rsplit(".", 1)[-1] for k in differ}
    short["optimizer.name"] = "optimizer"
    names = [short[k] for k in differ]
    label = {k: short[k] if names.count(short[k]) == 1 else k for k in differ}
    return {r.run_id: " ".join(f"{label[k]}={r.params.get(k, '-')}" for k in differ) for r in runs}


# ---------------------------------------------------------------- repeats summarised

MEANS = (
    "quality",
    "val_acc",
    "val_ppl",
    "samples_per_s",
    "step_ms",
    "tflops",
    "mfu",
    "activation_mib",
    "peak_mib",
    "skipped_steps",
    "bytes_per_sample",
    "model_mib",
    "max_batch",
    "fp8_flop_share",
    "steps",
    "update_lost_frac",
    "cpu_used",
    "cpu_others",
    "cpu_cores",
)
DIFFERENCES = ("quality_change", "acc_delta")  # each run minus its same-seed baseline
# run / baseline
RATIOS = ("speedup", "activation_ratio", "peak_ratio", "max_batch_ratio", "ppl_ratio")
# The range each mean cannot leave (fractions in [0, 1], a difference of two in [-1, 1]; a
# score's own, ``score_bounds``); every other mean is a count, a size, a rate or a time, never
# negative.
BOUNDS = {
    **dict.fromkeys(("val_acc", "mfu", "fp8_flop_share", "update_lost_frac"), (0.0, 1.0)),
    "acc_delta": (-1.0, 1.0),
}


def score_bounds(score: Score | None) -> dict[str, tuple[float | None, float | None]]:
    """The range of a score's value and of its change (a difference of two values; a relative
    change is left unbounded)."""
    if score is None:
        return {}
    low, high = score.low, score.high
    wide = None if low is None or high is None or score.relative else high - low
    return {"quality": (low, high), "quality_change": (-wide if wide else None, wide)}


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
    for entry in order:
        if isinstance(entry, str):  # an unfinished run's id
            out.append(by_run[entry])
            continue
        row = summary[entry]
        if row.baseline_run_id:  # named after the baseline's summary, not one of its runs
            row.baseline = name_of.get(row.baseline_run_id, row.baseline)
        out.append(row)
    return out


def _summary(group: list[Row], varies: dict[str, str]) -> Row:
    first = group[0]
    if len(group) == 1:
        return replace(first, members=[first.run_id], varies=varies.get(first.run_id, ""))
    ci: dict[str, Estimate] = {}
    values: dict[str, Any] = {}  # Row field -> its mean (or None), for replace() by name
    bounds = {**BOUNDS, **score_bounds(first.score)}
    for name in MEANS + DIFFERENCES:
        vals = [v for r in group if is_number(v := getattr(r, name))]
        est = mean_interval(vals, bounds=bounds.get(name, (0.0, None)))
        _keep(name, est, ci, values)
    # A contended run's speed-up is left out where some runs were not contended (it measured
    # the other processes as much as the mode); where all were, the row says so.
    clean = [r for r in group if not r.contended] or group
    for name in RATIOS:
        of = clean if name == "speedup" else group
        est = ratio_interval([v for r in of if is_number(v := getattr(r, name))])
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
        **group_fields(group),
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


ORIGIN = (
    "nonfinite_step",
    "nonfinite_kind",
    "nonfinite_module",
    "nonfinite_where",
    "nonfinite_fix",
    "nonfinite_steps",
)
PROBED = ("probe", "fp16_overflow", "update_lost_layers")


def group_fields(group: list[Row]) -> dict:
    """The numerics fields of a row of repeats: the first origin among them with how many runs
    had one; the median first scale and the largest growth (a scale that never grew, in no
    run); the first probed run's probe (its numbers and its module names belong together)."""
    had = [r for r in group if r.nonfinite_where]
    origin = {name: getattr(had[0], name) for name in ORIGIN} if had else {}
    probed = next((r for r in group if r.probe), group[0])
    firsts = [r.scale_first for r in group if is_number(r.scale_first)]
    growths = [r.scale_growth for r in group if is_number(r.scale_growth)]
    return {
        **origin,
        **{name: getattr(probed, name) for name in PROBED},
        "nonfinite_runs": len(had),
        "scale_first": statistics.median(firsts) if firsts else None,
        "scale_growth": max(growths) if growths else None,
    }


# ---------------------------------------------------------------- a search

OBJECTIVE = "val/loss"


@dataclass
class ModeBest:
    precision: str
    trials: int  # the mode's finished trials
    best: Row
    loss: float


def best_by_mode(report: Report) -> list[ModeBest]:
    """Each mode's best finished trial, where some mode ran more than one configuration
    (repeats of one configuration, which differ only in their seed, are not a search)."""
    loss = {r.run_id: v for r in report.runs if (v := r.metrics.get(OBJECTIVE)) is not None}
    finished = [r for r in report.rows if r.status == "FINISHED" and r.run_id in loss]
    by_mode: dict[str, list[Row]] = {}
    for row in finished:
        by_mode.setdefault(row.precision, []).append(row)
    if not any(len({_setting(r) for r in rows}) > 1 for rows in by_mode.values()):
        return []
    return [
        ModeBest(mode, len(rows), best, loss[best.run_id])
        for mode, rows in by_mode.items()
        for best in [min(rows, key=lambda r: loss[r.run_id])]
    ]


def _setting(row: Row) -> str:
    return " ".join(p for p in row.varies.split() if not p.startswith("seed="))


def lines(report: Report) -> list[str]:
    """One line per mode: its best trial, what it was set to, and its loss."""
    return [
        f"{m.precision}: best of {m.trials} trial(s) is {m.best.name} ({m.best.run_id}): "
        f"{OBJECTIVE} {m.loss:.4g}" + (f" with {_setting(m.best)}" if _setting(m.best) else "")
        for m in best_by_mode(report)
    ]
