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

``row_fields`` reads them into a run's row, ``group_fields`` keeps them for a row of repeats,
``findings`` says what is wrong, each in a sentence or two with its numbers and its fix. A
healthy scaler gets no finding; the probe, where nothing rules a half mode out, says which
half modes are safe.
"""

from __future__ import annotations

import math
import statistics

from ampsweep.measure.names import (
    FP16_OVERFLOW,
    HEADROOM,
    INIT_SCALE,
    NONFINITE_FIX,
    NONFINITE_KIND,
    NONFINITE_MODULE,
    NONFINITE_STEP,
    NONFINITE_STEPS,
    NONFINITE_WHERE,
    PROBE,
    RUN_UPDATE_LOST,
    UNDERFLOW,
    UNDERFLOW_AT_SCALE,
    UPDATE_LOST,
    UPDATE_LOST_LAYERS,
)
from ampsweep.precision import modes
from ampsweep.precision.modes import FORMATS
from ampsweep.report.model import Row, RunData, is_number, percent
from ampsweep.tracking.store import DIVERGED, FAILED

# The loss scaler's history and settings
LOSS_SCALE, TRAIN_STEPS = "amp/loss_scale", "train/steps"
SCALER = "precision.scaler."  # its params: min_scale, growth_interval, dynamic

# A dynamic scaler skips a step at each overflow: a few while it backs off from its initial
# scale, then about one per growth_interval (2000 by default) as it probes a higher scale. One
# step in 20 is far beyond that: the run is throwing away that share of its updates.
SKIP_TOLERANCE = 0.05
# A judgment, not a measurement: a few percent of updates rounded away are the smallest steps
# of weights that barely move; beyond one in 20 the weights stop following the optimizer.
UPDATE_TOLERANCE = 0.05
LAYERS_SHOWN = 3  # modules or parameters a probe finding names with their numbers (the worst)
MODEL = "(model)"  # the probe's name for the model itself

ORIGIN = ("nonfinite_step", "nonfinite_kind", "nonfinite_module", "nonfinite_where",
          "nonfinite_fix", "nonfinite_steps")  # fmt: skip
PROBED = ("probe", "fp16_overflow", "update_lost_layers")


# ---------------------------------------------------------------- reading a run


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
        "scale_min": _number(p.get(SCALER + "min_scale")),
        "scale_growth_interval": _number(p.get(SCALER + "growth_interval")),
        "scale_dynamic": dynamic,
    }


def _number(text: str | None) -> float | None:
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


# ---------------------------------------------------------------- findings


def findings(rows: list[Row]) -> list[str]:
    """What went wrong numerically: where each run's first inf/NaN began, an unhealthy loss
    scale, what the probe found in each configuration, updates a pure mode lost."""
    return [
        *origin_findings(rows),
        *scale_findings(rows),
        *probe_findings(rows),
        *update_findings(rows),
    ]


def _mode(test) -> str:
    """The name of the first mode of the table that passes ``test``."""
    return next(m.name for m in modes.MODES.values() if test(m))


def _autocast(dtype: str) -> str:
    """The plain autocast mode of ``dtype``: its math in dtype, its weights in fp32."""
    return _mode(lambda m: m.autocast and m.dtype == dtype and not m.fp8)


def _wide_range_fix() -> str:
    return f"precision={_autocast('bf16')} (fp32's range)"


def _scale(x: float) -> str:
    """A loss scale as a config value (``1048576``, not ``1.04858e+06``); below 1, the power
    of two that every backed-off scale is (``2^-14``, not ``6.10352e-05``)."""
    if x >= 1 and x == int(x):
        return f"{x:.0f}"
    if x > 0 and math.log2(x).is_integer():
        return f"2^{math.log2(x):.0f}"
    return f"{x:g}"


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
    failed = [f"{r.name} ({'diverged' if r.diverged else r.status})" for r in group
              if r.status == FAILED]  # fmt: skip
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
    if not (r.scale_dynamic and is_number(r.scale_min) and r.loss_scale <= r.scale_min):
        return None
    skips = f" ({_skips(r)})" if _skips(r) else ""
    return (
        f"{_named(r)}: the loss scale collapsed to {_scale(r.loss_scale)}, "
        f"{'at' if r.loss_scale == r.scale_min else 'below'} "
        f"precision.scaler.min_scale={_scale(r.scale_min)}{skips}: the gradients overflow "
        f"fp16 at every scale{_began(r)}; fix: {r.nonfinite_fix or _wide_range_fix()}."
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
        fix = _wide_range_fix()
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
    skips = f" ({_skips(r)})" if _skips(r) else ""
    return (
        f"{_named(r)}: the dynamic loss scale never grew above its first logged value "
        f"{_scale(r.scale_first)} in {r.steps:.0f} steps, though it grows after "
        f"precision.scaler.growth_interval={interval:.0f} steps without an overflow: an "
        f"overflow came at least that often{skips}{_began(r)}, so the scale sits at the edge "
        "of what the gradients fit in fp16."
    )


# ---------------------------------------------------------------- the numerics probe


def probe_findings(rows: list[Row]) -> list[str]:
    """The probe's verdicts, once per configuration: it measures the model in fp32 before
    training, so every mode's run of a configuration measures the same."""
    configs: dict[str, list[Row]] = {}
    for r in rows:
        configs.setdefault(r.configuration, []).append(r)
    probed = {where: group for where, group in configs.items() if any(r.probe for r in group)}
    out = []
    for where, group in probed.items():
        r = next(r for r in group if r.probe)
        troubled = {x.precision for x in group if _troubled(x)}
        head = f"Numerics probe ({where})" if len(probed) > 1 else "Numerics probe"
        texts = (_overflow(r), _underflow(r), _updates_lost(r), _safe(r, troubled))
        out.extend(f"{head}: {text}" for text in texts if text)
    return out


def went_wrong(r: Row) -> bool:
    """Whether a row's runs went wrong numerically, so that its mode is never recommended: a
    run diverged, its scaler collapsed or skipped too many steps, a pure mode rounded its
    updates away, or a mode without a scaler met an inf/NaN (with one, skipping such a step is
    the scaler's job)."""
    mode = modes.get(r.precision)
    unscaled = mode is None or not mode.scaler
    return r.diverged or _troubled(r) or (unscaled and r.nonfinite_runs > 0)


def _troubled(r: Row) -> bool:
    """Whether the run itself went wrong numerically (the findings above say how): then its
    mode is not safe here, whatever the probe saw before training (a faulty kernel, updates
    lost late in training, are beyond what the probe measures)."""
    failed = r.status == FAILED and bool(r.nonfinite_where)
    return failed or bool(_scale_problem(r)) or _lost_on_own_steps(r) is not None


def _pairs(text: str) -> list[tuple[str, float]]:
    """``"fc1.weight=1.00,fc2.weight=0.42"`` -> ``[("fc1.weight", 1.0), ("fc2.weight", 0.42)]``."""
    out = []
    for item in text.split(","):
        name, _, value = item.strip().rpartition("=")
        number = _number(value)
        if name and number is not None:
            out.append((name, number))
    return out


def _probed(r: Row, key: str) -> float | None:
    value = r.probe.get(key)
    return value if is_number(value) else None


def _overflow(r: Row) -> str | None:
    """fp16's forward pass overflows: which modules, by how much, and the fix."""
    modules, headroom = _pairs(r.fp16_overflow), _probed(r, HEADROOM)
    if not modules and not (headroom is not None and headroom < 0):
        return None
    limit = FORMATS["fp16"].max
    if modules:
        (name, value), *rest = modules[:LAYERS_SHOWN]
        reach = f"{name} reaches {value:.3g}" + "".join(f", {n} {v:.3g}" for n, v in rest)
        more = len(modules) - LAYERS_SHOWN
        reach += f" and {more} more module(s)" if more > 0 else ""
    else:
        reach = f"a module's output reaches {limit * 2.0**-headroom:.3g}"
    room = f" (headroom 2^{headroom:.1f})" if headroom is not None else ""
    return (
        f"fp16 overflows in the forward pass: {reach} in fp32, beyond fp16's largest value "
        f"{limit:g}{room}, so every fp16 mode turns {'them' if len(modules) > 1 else 'it'} "
        f"into inf; fix: {_keep_fp32_fix(modules)}."
    )


def _keep_fp32_fix(modules: list[tuple[str, float]]) -> str:
    """Those modules outside autocast, or bf16; the probe names the model itself "(model)",
    which is no module to keep."""
    keep = ",".join(name for name, _ in modules if name != MODEL)
    if not keep:
        return _wide_range_fix()
    return f"precision.keep_fp32=[{keep}] (those modules in fp32), or {_wide_range_fix()}"


def _underflow(r: Row) -> str | None:
    """The share of the gradient fp16 loses without a scaler, and the scale that keeps it."""
    lost = _probed(r, UNDERFLOW)
    if lost is None or lost <= 0:
        return None
    unscaled = ", ".join(m.name for m in modes.MODES.values() if m.dtype == "fp16" and not m.scaler)
    text = (
        f"fp16 without loss scaling ({unscaled}) would flush {percent(lost)} of the non-zero "
        "gradient values to zero"
    )
    scale, left = _probed(r, INIT_SCALE), _probed(r, UNDERFLOW_AT_SCALE)
    if scale is None:
        return text + "."
    kept = f"all but {percent(left)}" if left else "all of them"
    fp16 = _mode(lambda m: m.autocast and m.dtype == "fp16" and m.scaler and m.dynamic_scale)
    return (
        f"{text}; a loss scale of {_scale(scale)} keeps {kept}: "
        f"precision={fp16} precision.scaler.init_scale={_scale(scale)}."
    )


def _pure(dtype: str) -> str:
    return ", ".join(m.name for m in modes.MODES.values() if m.pure and m.dtype == dtype)


def _updates_lost(r: Row) -> str | None:
    """The share of one step's updates a pure half-precision model rounds away, the
    parameters that lose most (bf16), and the autocast mode that keeps them."""
    lost = {
        dtype: value
        for dtype, key in UPDATE_LOST.items()
        if (value := _probed(r, key)) is not None and value > UPDATE_TOLERANCE
    }
    if not lost:
        return None
    (dtype, value), *rest = lost.items()
    shares = f"a pure {dtype} model ({_pure(dtype)}) would round away {percent(value)}"
    shares += "".join(f", a pure {d} model ({_pure(d)}) {percent(v)}," for d, v in rest)
    layers = _pairs(r.update_lost_layers)[:LAYERS_SHOWN]
    most = ""
    if layers and "bf16" in lost:
        most = "; in bf16 most in " + ", ".join(f"{n} ({percent(v)})" for n, v in layers)
    remedy = " or ".join(f"precision={_autocast(dtype)}" for dtype in lost)
    return (
        f"{shares} of one optimizer step's non-zero updates (smaller than half a unit in the "
        f"last place of their weight){most}; fix: {remedy} (autocast with fp32 master "
        "weights) keeps them."
    )


def _risk_free(mode: modes.PrecisionMode, r: Row) -> bool:
    """Whether the probe measured every risk of ``mode`` and found none."""
    if mode.fp8:  # the probe measures fp16 and bf16, not fp8's ranges
        return False
    if mode.dtype == "fp16":
        headroom = _probed(r, HEADROOM)
        if headroom is None or headroom < 0 or r.fp16_overflow:
            return False
        if not mode.scaler and _probed(r, UNDERFLOW) != 0:
            return False
    if mode.pure:
        lost = _probed(r, UPDATE_LOST.get(mode.dtype, ""))
        return lost is not None and lost <= UPDATE_TOLERANCE
    return True


def _safe(r: Row, troubled: set[str]) -> str | None:
    """The half modes nothing above rules out (nor a ``troubled`` run of them), with the
    headroom behind the verdict."""
    half = [m for m in modes.MODES.values() if m.half and m.name not in troubled]
    safe = [m for m in half if _risk_free(m, r)]
    if not safe:
        return None
    evidence = []
    headroom = _probed(r, HEADROOM)
    if headroom is not None:
        wider = headroom + math.log2(FORMATS["bf16"].max / FORMATS["fp16"].max)
        fp16 = f"2^{headroom:.1f} below fp16's and " if headroom >= 0 else ""
        evidence.append(f"the largest forward value is {fp16}2^{wider:.0f} below bf16's largest")
    pure = {d: v for d, key in UPDATE_LOST.items() if (v := _probed(r, key)) is not None}
    if any(m.pure for m in safe) and pure:
        evidence.append(
            "a pure model would round away "
            + " and ".join(f"{percent(v)} ({d})" for d, v in pure.items())
            + " of one step's updates"
        )
    names = ", ".join(m.name for m in safe)
    why = f" ({'; '.join(evidence)})" if evidence else ""
    verb = "is" if len(safe) == 1 else "are"
    return f"{names} {verb} safe here{why}."


# ---------------------------------------------------------------- a pure mode's own steps


def update_findings(rows: list[Row]) -> list[str]:
    """Updates a pure-mode run rounded away on its own steps (diagnostics.every > 0)."""
    out = []
    for r in rows:
        mode = _lost_on_own_steps(r)
        if mode is None:
            continue
        out.append(
            f"{_named(r)}: its {mode.dtype} weights rounded away {percent(r.update_lost_frac)} "
            f"of the non-zero updates of a step it measured ({RUN_UPDATE_LOST}: smaller than "
            "half a unit in the last place of the weight), so those weights did not learn; "
            f"fix: precision={_autocast(mode.dtype)} (autocast with fp32 master weights) keeps "
            "them."
        )
    return out


def _lost_on_own_steps(r: Row) -> modes.PrecisionMode | None:
    """The pure mode of ``r`` if its run lost more updates than the tolerance, else None."""
    mode, lost = modes.get(r.precision), r.update_lost_frac
    if mode is None or not mode.pure or not is_number(lost) or lost <= UPDATE_TOLERANCE:
        return None
    return mode
