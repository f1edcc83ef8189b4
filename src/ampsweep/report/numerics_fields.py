"""The numerics facts a run records, read into its row (``row_fields``: where its first
inf/NaN began, what its GradScaler did, what the numerics probe measured) and kept for a row of
repeats (``group_fields``). ``report.numerics`` judges them."""

from __future__ import annotations

import math
import statistics

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
from ampsweep.report.model import Row, RunData, is_number
from ampsweep.tracking.store import DIVERGED

# The loss scaler's history and settings
LOSS_SCALE, TRAIN_STEPS = "amp/loss_scale", "train/steps"
SCALER = "precision.scaler."  # its params: min_scale, growth_interval, dynamic

ORIGIN = ("nonfinite_step", "nonfinite_kind", "nonfinite_module", "nonfinite_where",
          "nonfinite_fix", "nonfinite_steps")  # fmt: skip
PROBED = ("probe", "fp16_overflow", "update_lost_layers")


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
    }


def _steps(run: RunData) -> float | None:
    """The optimizer steps a run trained: train/steps, else the last step its loss scale was
    logged at (a run logs its final numbers, train/* left out, at its last step; a failed
    run's last is its last log step)."""
    if is_number(run.metrics.get(TRAIN_STEPS)):
        return run.metrics[TRAIN_STEPS]
    logged = run.history.get(LOSS_SCALE)
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


def parse_number(text: str | None) -> float | None:
    try:
        value = float(text or "")
    except ValueError:
        return None
    return value if math.isfinite(value) else None


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
