"""The numerics probe's verdicts (``diagnostics.numerics=true``): where fp16 overflows in the
forward pass, how much of the gradient it would flush without a scaler, the updates a pure
half-precision model would round away, and which half modes nothing rules out; each with its
numbers and its fix."""

from __future__ import annotations

import math

from ampsweep.measure.names import (
    HEADROOM,
    INIT_SCALE,
    UNDERFLOW,
    UNDERFLOW_AT_SCALE,
    UPDATE_LOST,
)
from ampsweep.precision import modes
from ampsweep.precision.modes import FORMATS
from ampsweep.report.criteria import UPDATE_TOLERANCE
from ampsweep.report.fixes import autocast_mode, mode_named, scale_text, wide_range_fix
from ampsweep.report.model import Row, is_number, percent
from ampsweep.report.numerics_fields import parse_number

LAYERS_SHOWN = 3  # modules or parameters a probe finding names with their numbers (the worst)
MODEL = "(model)"  # the probe's name for the model itself


def probe_findings(rows: list[Row], went_wrong_itself) -> list[str]:
    """The probe's verdicts, once per configuration: it measures the model in fp32 before
    training, so every mode's run of a configuration measures the same. A mode whose run
    ``went_wrong_itself`` (``numerics._troubled``) is never called safe."""
    configs: dict[str, list[Row]] = {}
    for r in rows:
        configs.setdefault(r.configuration, []).append(r)
    probed = {where: group for where, group in configs.items() if any(r.probe for r in group)}
    out = []
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
    remedy = " or ".join(f"precision={autocast_mode(dtype)}" for dtype in lost)
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
