"""What went wrong numerically in a sweep's runs, where it began, and the config change that
fixes it.

Three kinds of facts a run records feed these findings:

* where its first inf/NaN began, as the run located it by replaying that step with hooks on
  every module (the ``numerics.nonfinite_*`` tags), and how many steps were non-finite;
* what its GradScaler did: the loss scale (logged every ``trainer.log_every`` steps, then the
  final one), the skipped steps, the steps trained, and the scaler's settings (params);
* the numerics probe (``diagnostics.numerics=true``): every module's value ranges measured in
  fp32 before training, against each format's range (``precision.modes.FORMATS``); a pure
  mode's run also measures the updates its own steps round away.

``report.sweeps`` reads them into a run's row and ``report.stats`` keeps them for a row of
repeats; ``findings`` here says what is wrong, each in a sentence or two with its numbers and
its fix (the config changes it proposes: ``report.probe``). A healthy scaler gets no finding;
the probe's verdicts are ``report.probe``'s: where nothing rules a half mode out, it says which
half modes are safe.
"""

from __future__ import annotations

from ampsweep.measure.names import (
    RUN_UPDATE_LOST,
)
from ampsweep.precision import modes
from ampsweep.report import memory, quality
from ampsweep.report.model import Row, is_number, percent
from ampsweep.report.probe import (
    UPDATE_TOLERANCE,
    autocast_mode,
    probe_findings,
    scale_text,
    wide_range_fix,
)
from ampsweep.tracking.store import FAILED

# A dynamic scaler skips a step at each overflow: a few while it backs off from its initial
# scale, then about one per growth_interval (2000 by default) as it probes a higher scale. One
# step in 20 is far beyond that: the run is throwing away that share of its updates.
SKIP_TOLERANCE = 0.05


# ---------------------------------------------------------------- findings


def findings(rows: list[Row]) -> list[str]:
    """What went wrong numerically: where each run's first inf/NaN began, an unhealthy loss
    scale, what the probe found in each configuration, updates a pure mode lost."""
    return [
        *origin_findings(rows),
        *scale_findings(rows),
        *probe_findings(rows, troubled),
        *update_findings(rows),
    ]


def _named(r: Row) -> str:
    """A row's name, and how many runs it summarises (its numbers are their means)."""
    return r.name if r.n == 1 else f"{r.name} ({r.n} runs)"


# ---------------------------------------------------------------- where inf/NaN began


def origin_findings(rows: list[Row]) -> list[str]:
    """Each run's first inf/NaN and its fix; a module that several runs name, said once."""
    by_module: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r.nonfinite_where:  # no module (the loss, a step not reproduced): the run's own
            key = ("module", r.nonfinite_module) if r.nonfinite_module else ("run", r.run_id)
            by_module.setdefault(key, []).append(r)
    return [
        _one_origin(group[0]) if len(group) == 1 else _shared_origin(group)
        for group in by_module.values()
    ]


def _origin_runs(r: Row) -> str:
    """``fp16-cnn-digits``; for repeats ``fp16-cnn-digits (2 of 3 runs)``."""
    return r.name if r.n == 1 else f"{r.name} ({r.nonfinite_runs} of {r.n} runs)"


def _one_origin(r: Row) -> str:
    fix = f"; fix: {r.nonfinite_fix}" if r.nonfinite_fix else ""
    return f"{_origin_runs(r)}: {r.nonfinite_where}{fix}.{_aftermath(r)}"


def _aftermath(r: Row) -> str:
    """What the run did after its first non-finite step: failed from it, or went on."""
    if r.status == FAILED:
        return " Its divergence began there." if r.diverged else " Its failure began there."
    if r.n > 1 or not is_number(r.nonfinite_steps):
        return ""
    of = f" of its {r.steps:.0f}" if is_number(r.steps) else ""
    return f" {r.nonfinite_steps:.0f}{of} steps were non-finite."


def _shared_origin(group: list[Row]) -> str:
    first = group[0]
    runs = sum(r.nonfinite_runs for r in group)
    names = ", ".join(_origin_runs(r) for r in group)
    fixes = {r.nonfinite_fix for r in group if r.nonfinite_fix}
    if len(fixes) == 1:
        fix = f"; fix: {fixes.pop()}"
    elif fixes:
        fix = "; fix: " + "; ".join(f"{r.nonfinite_fix} ({r.name})" for r in group)
    else:
        fix = ""
    failed = [
        f"{r.name} ({'diverged' if r.diverged else r.status})" for r in group if r.status == FAILED
    ]
    failures = f" The failure of {', '.join(failed)} began there." if failed else ""
    return (
        f"{runs} runs first went non-finite in {first.nonfinite_module} ({names}); "
        f"{first.name}: {first.nonfinite_where}{fix}.{failures}"
    )


# ---------------------------------------------------------------- the loss scale


def scale_findings(rows: list[Row]) -> list[str]:
    """What is wrong with a run's loss scale, the worst first (one finding a run): it
    collapsed to its minimum, the scaler skipped too many steps, or a dynamic scale never
    grew. Nothing for a run without a scaler, or a healthy one."""
    return [text for r in rows if (text := _scale_problem(r))]


def _scale_problem(r: Row) -> str | None:
    if not is_number(r.loss_scale):  # logged only where a scaler ran
        return None
    return _collapsed(r) or _skipping(r) or _stuck(r)


def _skips(r: Row) -> str:
    """``12 of 300 steps skipped``."""
    if not is_number(r.skipped_steps):
        return ""
    of = f" of {r.steps:.0f}" if is_number(r.steps) else ""
    return f"{r.skipped_steps:.0f}{of} steps skipped"


def _began(r: Row) -> str:
    return f", beginning in {r.nonfinite_module}" if r.nonfinite_module else ""


def _collapsed(r: Row) -> str | None:
    if not (r.scale_dynamic and is_number(r.scale_min) and is_number(r.loss_scale)):
        return None
    if r.loss_scale > r.scale_min:
        return None
    skips = f" ({_skips(r)})" if _skips(r) else ""
    return (
        f"{_named(r)}: the loss scale collapsed to {scale_text(r.loss_scale)}, "
        f"{'at' if r.loss_scale == r.scale_min else 'below'} "
        f"precision.scaler.min_scale={scale_text(r.scale_min)}{skips}: the gradients overflow "
        f"fp16 at every scale{_began(r)}; fix: {r.nonfinite_fix or wide_range_fix()}."
    )


def _skipping(r: Row) -> str | None:
    if not (is_number(r.skipped_steps) and is_number(r.steps) and r.steps > 0):
        return None
    rate = r.skipped_steps / r.steps
    if rate <= SKIP_TOLERANCE:
        return None
    if r.nonfinite_fix:
        fix = r.nonfinite_fix
    elif r.scale_dynamic is False:  # a fixed scale that overflows: let it back off
        fix = "precision.scaler.dynamic=true, or a lower precision.scaler.init_scale"
    else:
        fix = wide_range_fix()
    return (
        f"{_named(r)}: the scaler skipped {r.skipped_steps:.0f} of {r.steps:.0f} steps "
        f"({percent(rate)}, more than {SKIP_TOLERANCE:.0%}), each one's update thrown away on "
        f"an overflow{_began(r)}; fix: {fix}."
    )


def _stuck(r: Row) -> str | None:
    interval = r.scale_growth_interval
    if not (
        r.scale_dynamic
        and is_number(r.scale_growth)
        and r.scale_growth <= 1
        and is_number(interval)
        and is_number(r.steps)
        and r.steps > interval
    ):
        return None
    assert r.scale_first is not None  # what its growth was measured from
    skips = f" ({_skips(r)})" if _skips(r) else ""
    return (
        f"{_named(r)}: the dynamic loss scale never grew above its first logged value "
        f"{scale_text(r.scale_first)} in {r.steps:.0f} steps, though it grows after "
        f"precision.scaler.growth_interval={interval:.0f} steps without an overflow: an "
        f"overflow came at least that often{skips}{_began(r)}, so the scale sits at the edge "
        "of what the gradients fit in fp16."
    )


def went_wrong(r: Row) -> bool:
    """Whether a row's runs went wrong numerically, so that its mode is never recommended: a
    run diverged, its scaler collapsed or skipped too many steps, a pure mode rounded its
    updates away, or a mode without a scaler met an inf/NaN (with one, skipping such a step is
    the scaler's job)."""
    mode = modes.get(r.precision)
    unscaled = mode is None or not mode.scaler
    return r.diverged or troubled(r) or (unscaled and r.nonfinite_runs > 0)


def troubled(r: Row) -> bool:
    """Whether the run itself went wrong numerically (the findings above say how): then its
    mode is not safe here, whatever the probe saw before training (a faulty kernel, updates
    lost late in training, are beyond what the probe measures)."""
    failed = r.status == FAILED and bool(r.nonfinite_where)
    return failed or bool(_scale_problem(r)) or _lost_on_own_steps(r) is not None


# ---------------------------------------------------------------- a pure mode's own steps


def update_findings(rows: list[Row]) -> list[str]:
    """Updates a pure-mode run rounded away on its own steps (diagnostics.every > 0); else a
    pure mode's score short of the baseline's where the autocast mode of its dtype held (the
    same math with fp32 weights): each with fp32 master weights as the fix."""
    out = []
    for r in rows:
        mode = _lost_on_own_steps(r)
        if mode is None:
            if text := _short_of_autocast(r, rows):
                out.append(text)
            continue
        lost = r.update_lost_frac
        assert lost is not None  # a number: _lost_on_own_steps
        out.append(
            f"{_named(r)}: its {mode.dtype} weights rounded away {percent(lost)} "
            f"of the non-zero updates of a step it measured ({RUN_UPDATE_LOST}: smaller than "
            f"half a unit in the last place of the weight), so those weights did not learn; "
            f"fix: {masters_fix(r, mode)}."
        )
    return out


def _lost_on_own_steps(r: Row) -> modes.PrecisionMode | None:
    """The pure mode of ``r`` if its run lost more updates than the tolerance, else None."""
    mode, lost = modes.get(r.precision), r.update_lost_frac
    if mode is None or not mode.pure or not is_number(lost) or lost <= UPDATE_TOLERANCE:
        return None
    return mode


def _short_of_autocast(r: Row, rows: list[Row]) -> str | None:
    """A pure row without master weights that lost the task's score against its baseline
    while a row of the autocast mode of its dtype, in the same configuration, held: the
    weights' rounding is what the pure mode adds, so master weights are its fix."""
    mode = modes.get(r.precision)
    if mode is None or not mode.pure or r.master_weights or quality.verdict(r) != "lost":
        return None
    autocast = autocast_mode(mode.dtype)
    held = next(
        (
            x
            for x in rows
            if x.precision == autocast
            and x.configuration == r.configuration
            and quality.verdict(x) == "held"
        ),
        None,
    )
    if held is None or r.score is None:
        return None
    base = next((x.precision for x in rows if r.baseline_run_id in (x.run_id, *x.members)), "")
    vs = f" vs {base}" if base else ""
    return (
        f"{_named(r)}: its {r.score.label} did not hold {r.score.within()} of its baseline's "
        f"({quality.change_of(r, vs)}) while {autocast}, the same {mode.dtype} math with fp32 "
        f"weights, held ({quality.change_of(held, vs)}): its {mode.dtype} weights round away "
        f"updates smaller than half a unit in their last place; fix: {masters_fix(r, mode)}."
    )


def masters_fix(r: Row, mode: modes.PrecisionMode) -> str:
    """fp32 master weights for the pure row ``r``, with what they add to its step's peak
    (predicted from the parts it measured, ``measure.capacity``), and the autocast mode."""
    cost = "as much weight memory as fp32"
    bd = memory.of_row(r)
    if bd is not None and not bd.master_weights:
        more = bd.at(master_weights=True)
        cost = (
            f"the step's peak {memory.mib(bd.total)} -> {memory.mib(more.total)}, predicted "
            "from its parts"
        )
    return (
        f"precision={mode.name} precision.master_weights=true keeps them in fp32 master "
        f"weights ({cost}), or precision={autocast_mode(mode.dtype)} (autocast, fp32 weights)"
    )
