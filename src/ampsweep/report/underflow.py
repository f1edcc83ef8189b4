"""The findings on gradient underflow: what fp16 without loss scaling reached and lost, what
the underflow diagnostics measured (the share of gradient values below fp16's range) and how
much of it the scaler keeps."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ampsweep.precision import modes
from ampsweep.report.criteria import is_mode, scaled_fp16
from ampsweep.report.model import Row, is_number, percent
from ampsweep.report.verdicts import acc_of, points_of, pts


def noscale_findings(done: list[Row], base: str) -> list[str]:
    out = []
    for r in done:
        if not is_mode(r.precision, lambda m: m.unscaled_fp16):
            continue
        acc = f"reached {acc_of(r)}" if is_number(r.val_acc) else "has no accuracy"
        delta = ""
        if is_number(r.acc_delta):
            vs = f" vs {base}"
            delta = f" ({points_of(r, vs)})" if r.n > 1 else f" ({pts(r.acc_delta)}{vs})"
        if is_number(r.val_ppl):  # a language model
            acc = f"reached perplexity {r.val_ppl:.3f}"
            ratio = r.ppl_ratio
            delta = f" ({(ratio - 1.0) * 100:+.1f}% vs {base})" if is_number(ratio) else ""
        text = (
            f"fp16 without loss scaling ({r.precision}) {acc}{delta}. With no scaler no step is "
            "checked or skipped: gradients too small for fp16 silently become zero"
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
                f"{x.precision} skipped {x.skipped_steps or 0:.0f} step(s), final scale "
                f"{x.loss_scale:g}"
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
            metrics = {**r.extra, **({"val/acc": r.val_acc} if is_number(r.val_acc) else {})}
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
        if "val/acc" in noscale and base_mode in runs and "val/acc" in runs[base_mode]:
            text += (
                f" and reached val/acc {noscale['val/acc']:.3f} against "
                f"{runs[base_mode]['val/acc']:.3f} in {base_mode}"
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
