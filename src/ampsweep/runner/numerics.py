"""What a job records and says of its run's numerics: the probe's ranges before training
(diagnostics.numerics) and where the first non-finite value began. (Measuring them is
``measure.probe`` and ``measure.numerics``; comparing runs is ``report.numerics``.)"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

from ampsweep import console
from ampsweep.engine import distributed
from ampsweep.measure import names
from ampsweep.measure.probe import probe


def record_origin(recorder, setup, failed: bool = False) -> None:
    """Where the run's first non-finite value began: tags, an artifact (and the count of
    non-finite steps for a failed run, whose summary is never logged)."""
    lost = next((c.shares for c in setup.callbacks if getattr(c, "shares", None)), None)
    if lost and recorder.run_id is not None:  # a pure run's own rounding losses
        worst = sorted(((k, v) for k, v in lost.items() if k != "(all)"), key=lambda x: -x[1])
        recorder.set_tags({names.UPDATE_LOST_LAYERS: names.pairs(worst[:8], ".2f")})
    origin = setup.locator.origin
    if origin is None or recorder.run_id is None:
        return
    recorder.set_tags(origin.tags())
    if failed:
        count = float(setup.locator.nonfinite_steps)
        recorder.log_metrics({names.NONFINITE_STEPS: count}, origin.step)
    with tempfile.TemporaryDirectory() as tmp:
        recorder.log_artifact(origin.write(Path(tmp)), "numerics")


def record_probe(recorder, setup) -> None:
    """diagnostics.numerics: the probe's ranges before training, as metrics at step 0,
    tags and the numerics/probe.json and .md artifacts."""
    n = setup.cfg.diagnostics.numerics_batches
    batches = list(itertools.islice(setup.train_batches.epoch(0), n))
    found = probe(distributed.unwrap(setup.model), batches, setup.objective,
                  setup.diagnostics.loss_weight, setup.optimizer)  # fmt: skip
    recorder.log_metrics(found.metrics(), 0)
    recorder.set_tags(found.tags())
    with tempfile.TemporaryDirectory() as tmp:
        for path in found.write(Path(tmp)):
            recorder.log_artifact(path, "numerics")


def say_origin(name: str, setup) -> None:
    """Say where the run's first non-finite value began, and the fix if there is one."""
    origin = setup.locator.origin
    if origin is None:
        return
    fix = origin.fix()
    console.note(
        f"{name}: {setup.locator.nonfinite_steps} non-finite step(s); "
        f"{origin.sentence()}" + (f"; fix: {fix}" if fix else "")
    )
