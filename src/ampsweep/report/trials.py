"""A search's trials by precision mode (``hydra/sweeper=optuna`` trying settings per mode, or a
grid of several settings per mode): how many configurations each mode ran and its best one,
by the objective a search minimises, the final validation loss (what a job returns to the
sweeper: ``app.job.JobOutcome.__float__``)."""

from __future__ import annotations

from dataclasses import dataclass

from ampsweep.report.model import Report, Row

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
    loss = {r.run_id: r.metrics.get(OBJECTIVE) for r in report.runs}
    finished = [r for r in report.rows if r.status == "FINISHED" and loss.get(r.run_id) is not None]
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
