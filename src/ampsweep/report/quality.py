"""Time to quality: how long each run took to reach a quality worth having.

What a practitioner pays for is the time to a given accuracy, not samples per second at one
batch size (MLPerf's training benchmarks time runs to a target quality the same way). The
target is, by default, within ``ACC_WITHIN`` (half a point) of the baseline's final accuracy,
or within ``PPL_WITHIN`` (2%) of its final perplexity for a language model; ``--target``
gives one in the metric's own unit instead. Each run's time is read from the evaluations it
logged (``val/acc`` or ``val/perplexity``, each with its step and MLflow timestamp): the first
evaluation at or past the target, as wall time since the run started (its setup, evaluations
and checkpoints included: what the run cost) and optimizer steps. A run evaluates at the end
of each ``trainer.eval_every`` epochs, so the time is that of the evaluation that saw it.
"""

from __future__ import annotations

import statistics

from ampsweep.report.model import Row, RunData, is_number

ACC, PPL = "val/acc", "val/perplexity"
QUALITY_KEYS = (ACC, PPL)  # the evaluations read with their timestamps
ACC_WITHIN = 0.005  # the default target: within half a point of the baseline's final accuracy
PPL_WITHIN = 0.02  # or within 2% of its final perplexity


def metric_of(run: RunData) -> str | None:
    """The quality metric a run logged: perplexity for a language model, else accuracy."""
    return PPL if run.timeline.get(PPL) else ACC if run.timeline.get(ACC) else None


def reached(value: float, target: float, metric: str) -> bool:
    return value <= target if metric == PPL else value >= target


def time_to(run: RunData, target: float, metric: str) -> tuple[float, int] | None:
    """Seconds since the run started and the step of its first evaluation at the target;
    None when no evaluation reached it."""
    for step, value, stamp in sorted(run.timeline.get(metric, []), key=lambda e: e[2]):
        if reached(value, target, metric):
            return max(0.0, (stamp - run.started_ms) / 1000), step
    return None


def default_target(base: Row, metric: str) -> float | None:
    """The target from the baseline's final quality (over repeats: its mean)."""
    if metric == PPL and is_number(base.val_ppl):
        return base.val_ppl * (1 + PPL_WITHIN)
    if metric == ACC and is_number(base.val_acc):
        return base.val_acc - ACC_WITHIN
    return None


def describe_target(target: float, metric: str, base: Row | None, given: bool) -> str:
    """``val acc >= 0.981 (within 0.5 points of fp32's 0.986)``."""
    op, shown = ("<=", f"{target:.3f}") if metric == PPL else (">=", f"{target:.3f}")
    name = "val perplexity" if metric == PPL else "val acc"
    if given or base is None:
        return f"{name} {op} {shown} (--target)"
    if metric == PPL:
        why = f"within {PPL_WITHIN:.0%} of {base.precision}'s {base.val_ppl:.3f}"
    else:
        why = f"within {ACC_WITHIN * 100:.1f} points of {base.precision}'s {base.val_acc:.3f}"
    return f"{name} {op} {shown} ({why})"


def apply(
    rows: list[Row],
    summary: list[Row],
    runs: list[RunData],
    baseline_mode: str,
    target: float | None = None,
) -> dict[str, str]:
    """Fill in each row's time to quality (``Row.target*``), per configuration: the target is
    ``target`` or the default from that configuration's baseline. Returns each
    configuration's target in words (what the finding and the chart say it was)."""
    by_id = {r.run_id: r for r in runs}
    words: dict[str, str] = {}
    for where in dict.fromkeys(r.configuration for r in summary):
        group = [s for s in summary if s.configuration == where and s.status == "FINISHED"]
        members = {m for s in group for m in (s.members or [s.run_id])}
        metric = next((m for rid in members if (m := metric_of(by_id[rid]))), None)
        base = next((s for s in group if s.precision == baseline_mode), None)
        value = target if target is not None else (default_target(base, metric) if base else None)
        if metric is None or value is None:
            continue
        words[where] = describe_target(value, metric, base, target is not None)
        for row in (r for r in rows if r.run_id in members):
            _fill(row, [by_id[row.run_id]], value, metric)
        for s in group:
            _fill(s, [by_id[m] for m in (s.members or [s.run_id])], value, metric)
    return words


def _fill(row: Row, members: list[RunData], target: float, metric: str) -> None:
    hits = [h for m in members if (h := time_to(m, target, metric)) is not None]
    row.target = target
    row.target_evals = max(len(m.timeline.get(metric, [])) for m in members)
    row.target_reached = len(hits)
    if hits:
        row.target_s = statistics.fmean(h[0] for h in hits)
        row.target_steps = statistics.fmean(h[1] for h in hits)
    else:
        row.target_s = row.target_steps = None
