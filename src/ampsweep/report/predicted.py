"""The step ``ampsweep predict`` gives each mode, against the step a run on a GPU of its table
measured: what each such run recorded (``predict/step_ms``, ``predict/error_pct``), read back
as one finding per sweep, so that the roofline's error on real runs stays in view."""

from __future__ import annotations

from ampsweep.report.model import Row, is_number
from ampsweep.tracking.store import FINISHED

STEP_MS, ERROR_PCT = "predict/step_ms", "predict/error_pct"


def findings(rows: list[Row]) -> list[str]:
    """Per mode (per configuration where the sweep has several), the predicted step against
    the measured median step and the error; nothing where no run recorded a prediction (off
    CUDA, or a GPU the table does not know)."""
    shown = [
        r
        for r in rows
        if r.status == FINISHED and is_number(r.extra.get(ERROR_PCT)) and is_number(r.step_ms)
    ]
    if not shown:
        return []
    several = len({r.configuration for r in shown}) > 1
    parts = [
        f"{r.name if several else r.mode} {r.extra[STEP_MS]:.3g} ms against "
        f"{r.step_ms:.3g} ms ({r.extra[ERROR_PCT]:+.0f}%)"
        for r in shown
    ]
    return [
        "Predicted against measured step time (ampsweep predict's roofline for each run's "
        "mode on its GPU; negative: predicted faster than measured; torch.compile and "
        f"communication not modelled): {'; '.join(parts)}."
    ]
