"""What the numerics probe and the gradient-underflow diagnostics measured, and the config
changes the numerics findings propose.

The probe (``diagnostics.numerics=true``) measures the model in fp32 before training: where
fp16 overflows in the forward pass, how much of the gradient it would flush without a scaler,
the updates a pure half-precision model would round away, and which half modes nothing rules
out; each verdict with its numbers and its fix. The underflow diagnostics
(``diagnostics.every > 0``) measure the share of gradient values below fp16's range during
training and how much of it the scaler keeps; beside them, what fp16 without loss scaling
reached. A fix names a mode by what it is, asked of the mode table (never spelled out here),
and a loss scale as a config value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ampsweep.measure.names import (
    HEADROOM,
    INIT_SCALE,
    UNDERFLOW,
    UNDERFLOW_AT_SCALE,
    UPDATE_LOST,
)
from ampsweep.precision import modes
from ampsweep.precision.modes import FORMATS
from ampsweep.report import quality
from ampsweep.report.model import Row, is_mode, is_number, parse_number, percent

LAYERS_SHOWN = 3  # modules or parameters a probe finding names with their numbers (the worst)
MODEL = "(model)"  # the probe's name for the model itself
# A judgment, not a measurement: a few percent of updates rounded away are the smallest steps
# of weights that barely move; beyond one in 20 the weights stop following the optimizer.
UPDATE_TOLERANCE = 0.05


# ---------------------------------------------------------------- the fixes proposed


def mode_named(test) -> str:
    """The name of the first mode of the table that passes ``test``."""
    return next(m.name for m in modes.MODES.values() if test(m))


def autocast_mode(dtype: str) -> str:
    """The plain autocast mode of ``dtype``: its math in dtype, its weights in fp32."""
    return mode_named(lambda m: m.autocast and m.dtype == dtype and not m.fp8)


def wide_range_fix() -> str:
    return f"precision={autocast_mode('bf16')} (fp32's range)"


def scale_text(x: float) -> str:
    """A loss scale as a config value (``1048576``, not ``1.04858e+06``); below 1, the power
    of two that every backed-off scale is (``2^-14``, not ``6.10352e-05``)."""
    if x >= 1 and x == int(x):
        return f"{x:.0f}"
    if x > 0 and math.log2(x).is_integer():
        return f"2^{math.log2(x):.0f}"
    return f"{x:g}"


def scaled_fp16(m: modes.PrecisionMode) -> bool:
    return m.dtype == "fp16" and m.scaler


# ---------------------------------------------------------------- the probe


def probe_findings(rows: list[Row], went_wrong_itself) -> list[str]:
    """The probe's verdicts, once per configuration: it measures the model in fp32 before
    training, so every mode's run of a configuration measures the same. A mode whose run
    ``went_wrong_itself`` (``numerics.troubled``) is never called safe."""
    configs: dict[str, list[Row]] = {}
    for r in rows:
        configs.setdefault(r.configuration, []).append(r)
    probed = {where: group for where, group in configs.items() if any(r.probe for r in group)}
    out: list[str] = []
    for where, group in probed.items():
        r = next(r for r in group if r.probe)
        troubled = {x.precision for x in group if went_wrong_itself(x)}
        head = f"Numerics probe ({where})" if len(probed) > 1 else "Numerics probe"
        texts = (_overflow(r), _underflow(r), _updates_lost(r), _safe(r, troubled))
        out.extend(f"{head}: {text}" for text in texts if text)
    return out


def _pairs(text: str) -> list[tuple[str, float]]:
    """``"fc1.weight=1.00,fc2.weight=0.42"`` -> ``[("fc1.weight", 1.0), ("fc2.weight", 0.42)]``."""
    out = []
    for item in text.split(","):
        name, _, value = item.strip().rpartition("=")
        number = parse_number(value)
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
        assert headroom is not None  # no module named: the overflow is the headroom below 0
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
        return wide_range_fix()
    return f"precision.keep_fp32=[{keep}] (those modules in fp32), or {wide_range_fix()}"


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
    fp16 = mode_named(lambda m: m.autocast and m.dtype == "fp16" and m.scaler and m.dynamic_scale)
    return (
        f"{text}; a loss scale of {scale_text(scale)} keeps {kept}: "
        f"precision={fp16} precision.scaler.init_scale={scale_text(scale)}."
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
    masters = " or ".join(f"precision={_pure(d)} precision.master_weights=true" for d in lost)
    autocast = " or ".join(f"precision={autocast_mode(d)}" for d in lost)
    return (
        f"{shares} of one optimizer step's non-zero updates (smaller than half a unit in the "
        f"last place of their weight){most}; fix: {masters} (fp32 master weights, as much "
        f"weight memory as fp32) or {autocast} (autocast, fp32 weights) keeps them."
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


# ---------------------------------------------------------------- gradient underflow


def noscale_findings(done: list[Row], base: str) -> list[str]:
    out = []
    for r in done:
        if not is_mode(r.precision, lambda m: m.unscaled_fp16):
            continue
        text = (
            f"fp16 without loss scaling ({r.mode}) {quality.reached(r, base)}. With no "
            "scaler no step is checked or skipped: gradients too small for fp16 silently "
            "become zero"
        )
        under = r.extra.get("amp/grad_underflow_frac")
        if is_number(under):
            text += (
                f" ({percent(under)} of this run's gradient values did)"
                if under > 0
                else " (on this model none did: amp/grad_underflow_frac 0)"
            )
        scaled = [x for x in done if is_mode(x.precision, scaled_fp16) and x.model == r.model]
        if scaled:
            parts = [
                f"{x.mode} skipped {x.skipped_steps or 0:.0f} step(s), final scale {x.loss_scale:g}"
                for x in scaled
                if is_number(x.loss_scale)
            ]
            if parts:
                text += "; with scaling, " + "; ".join(parts)
        out.append(text + ".")
    return out


def underflow_findings(done: list[Row]) -> list[str]:
    """What the gradient-underflow diagnostics measured (runs with diagnostics.every > 0):
    how much of the gradient fp16 without scaling loses on this model, what the scaler keeps."""
    groups: dict[str, dict[str, dict[str, float]]] = {}
    for r in done:
        if r.extra:
            metrics = dict(r.extra)
            if r.score is not None and is_number(r.quality):  # the score, e.g. val/acc
                metrics[r.score.name] = r.quality
            if is_number(r.loss_scale):
                metrics["amp/loss_scale"] = r.loss_scale
            groups.setdefault(r.configuration, {})[r.precision] = metrics
    out = []
    for where, runs in groups.items():
        text = underflow_finding(runs)
        if text:
            out.append(f"Gradient underflow{f' ({where})' if len(groups) > 1 else ''}: {text}")
    return out


def underflow_finding(runs: Mapping[str, Mapping[str, float]]) -> str | None:
    """A plain-language finding from a sweep's child runs.

    ``runs`` maps a precision mode name to that run's latest metrics. The underflow share
    comes from the run measured in the mode least affected (full exponent range: fp32, tf32,
    then bf16; else any); the rescue from an fp16 run with a scaler; the measured loss from an
    fp16 run without one. None when nothing was measured.
    """
    key = "amp/grad_underflow_frac"
    measured = {mode: m for mode, m in runs.items() if key in m and not math.isnan(m[key])}
    if not measured:
        return None
    # The reference: a mode with fp32's exponent range (fp32 and tf32 before bf16), else any.
    full = sorted(
        (n for n in measured if is_mode(n, lambda m: m.full_range)),
        key=lambda n: modes.MODES[n].half,
    )
    base_mode = full[0] if full else next(iter(measured))
    lost = measured[base_mode][key]
    parts = []
    if lost == 0:
        parts.append(
            f"No gradient value falls below fp16's range on this model (measured in {base_mode}): "
            "fp16 would train here even without loss scaling."
        )
    else:
        parts.append(
            f"fp16 without loss scaling would flush {percent(lost)} of the non-zero gradient "
            f"values to zero on this model (measured in {base_mode}); "
            f"{percent(measured[base_mode].get('amp/grad_subnormal_frac', float('nan')))} "
            "fall below fp16's normal range."
        )
    noscale_mode = next((n for n in measured if is_mode(n, lambda m: m.unscaled_fp16)), None)
    noscale = measured.get(noscale_mode) if noscale_mode else None
    if noscale and "amp/grad_flushed_frac" in noscale:
        flushed = noscale["amp/grad_flushed_frac"]
        lost_here = (
            f"lost {percent(flushed)} of its non-zero gradient values"
            if flushed > 0
            else "lost none of its gradient values"
        )
        text = f"The {noscale_mode} run actually {lost_here}"
        score = next((k for k in noscale if k.startswith("val/")), None)
        if score and base_mode in runs and score in runs[base_mode]:
            text += (
                f" and reached {score} {noscale[score]:.3f} against "
                f"{runs[base_mode][score]:.3f} in {base_mode}"
            )
        parts.append(text + ".")
    scaled_mode = next((n for n in measured if is_mode(n, scaled_fp16)), None)
    if lost > 0 and scaled_mode and "amp/grad_underflow_frac_scaled" in measured[scaled_mode]:
        m = measured[scaled_mode]
        still = m["amp/grad_underflow_frac_scaled"]
        scale = m.get("amp/loss_scale", float("nan"))
        if m[key] > 0:
            kept = 1.0 - still / m[key]
            left = f"leaves {percent(still)} below fp16's range" if still > 0 else "leaves none"
            parts.append(
                f"In {scaled_mode}, the scaler at scale {scale:g} {left}, so it keeps "
                f"{percent(kept)} of the values fp16 alone would lose."
            )
    return " ".join(parts)
