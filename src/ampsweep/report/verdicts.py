"""The findings' verdicts over repeats: a mode's speed, memory and accuracy against the
baseline, each judged on the 95% interval of the paired comparison (``report.stats``), in
words (a wide interval is named as such, with the runs it needs); and the few phrases the
findings of a single run share with them."""

from __future__ import annotations

from ampsweep.report import stats
from ampsweep.report.criteria import ACC_TOLERANCE
from ampsweep.report.model import Row, how_much, is_number, ratio_range

# Autocast saves half-precision copies of the weights for backward; on a model whose
# activations are small next to its weights, those copies dominate.
WEIGHT_COPIES = (
    "Autocast keeps half-precision copies of the weights for backward, which outweigh the "
    "activations on a model this small."
)


def pts(delta: float) -> str:
    return f"{delta * 100:+.1f} points"


def _on(device: dict[str, str]) -> str:
    kind = device.get("device")
    return {"cpu": " on this CPU", "cuda": " on this GPU"}.get(kind, "")


def _n(r: Row, name: str) -> int:
    est = r.ci.get(name)
    return est.n if est is not None else r.n


def ratio_of(r: Row, name: str, vs: str = "") -> str:
    """``0.16x (0.15-0.17x), n=3`` (``0.52x in all 3 runs``; ``0.16x, a single run``);
    ``vs``: what it is a ratio to, after the value."""
    value, est = getattr(r, name), r.ci.get(name)
    if est is None or not est.has_interval:
        return f"{ratio_range(value, None)}{vs}, a single run"
    if est.half_width == 0:
        every = "both runs" if est.n == 2 else f"all {est.n} runs"
        return f"{ratio_range(value, None)}{vs} in {every}"
    return f"{ratio_range(value, est)}{vs}, n={est.n}"


def _too_wide(est: stats.Estimate, target: float, ratio: bool, unit: str) -> str:
    """Why an interval that contains "no difference" is no verdict, and the runs that would
    make it one: ``n`` runs observed a spread; at that spread the interval would narrow to
    ``target`` after the number ``stats.repeats_needed`` finds."""
    needed = stats.repeats_needed(est, target, ratio)
    runs = "2 runs" if est.n == 2 else f"{est.n} runs"
    more = (
        f"more than {stats.MAX_REPEATS} runs per mode"
        if needed > stats.MAX_REPEATS
        else f"about {needed} runs per mode (sweep.repeats={needed})"
    )
    return (
        f"with {runs} per mode the interval is too wide to judge: at this spread {more} "
        f"would narrow it to {unit}"
    )


def _wide(est: stats.Estimate | None, target: float, ratio: bool) -> bool:
    """An interval that says nothing yet: it contains "no difference" and either rests on
    fewer than ``stats.MIN_REPEATS`` runs or is wider than ``target``."""
    verdict = stats.compare(est, 1.0 if ratio else 0.0)
    if verdict == "too wide":
        return True
    needed = stats.repeats_needed(est, target, ratio)
    return verdict == "indistinguishable" and needed is not None and needed > est.n


def _speed(r: Row, base: str, on: str) -> str:
    """One mode's speed against the baseline: ``fp16 is 25x slower than fp32 on this CPU
    (0.04x (0.03-0.05x), n=3)``; a wide interval is named as such, with the runs it needs."""
    est = r.ci.get("speedup")
    verdict = stats.compare(est, 1.0)
    shown = ratio_of(r, "speedup")
    if _wide(est, stats.PRECISION_WANTED, ratio=True):
        why = _too_wide(est, stats.PRECISION_WANTED, True, f"within {stats.PRECISION_WANTED:.0%}")
        words = how_much(r.speedup)
        than = "as fast as" if words == "as fast" else f"{words} than"
        return f"{r.precision} ran {than} {base}{on} in the mean ({shown}), but {why}"
    if verdict in ("lower", "higher"):
        words = how_much(r.speedup)
        if words == "as fast":
            words = "slightly slower" if verdict == "lower" else "slightly faster"
        return f"{r.precision} is {words} than {base}{on} ({shown})"
    return f"{r.precision} {SPEED_WORDS[verdict]} {base}{on} ({shown})"


def points_of(r: Row, vs: str = "") -> str:
    """``-0.1 +/- 0.3 points, n=5``: a paired accuracy difference and its interval."""
    est = r.ci.get("acc_delta")
    if est is None or not est.has_interval:
        return f"{pts(r.acc_delta)}{vs}, a single run"
    return f"{r.acc_delta * 100:+.1f} +/- {est.half_width * 100:.1f} points{vs}, n={est.n}"


def acc_of(r: Row) -> str:
    est = r.ci.get("val_acc")
    if est is None or not est.has_interval:
        return f"{r.val_acc:.3f}"
    return f"{r.val_acc:.3f} +/- {est.half_width:.3f}"


# What the interval of a paired comparison says (``stats.compare``; None: a single run)
SPEED_WORDS = {
    "lower": "is slower than",
    "higher": "is faster than",
    "indistinguishable": "is indistinguishable in speed from",
    None: "compares with",
}


ACC_WORDS = {
    "lower": "is lower than",
    "higher": "is higher than",
    "indistinguishable": "is indistinguishable from",
    None: "compares with",
}


def interval_findings(group: list[Row], base: str, where: str, device: dict) -> list[str]:
    """Speed, memory and accuracy against the baseline, each a verdict on the 95% interval of
    the paired comparison: a mode is faster (or more accurate) only when the whole interval
    says so, else it is indistinguishable from the baseline at this number of repeats."""
    out = []
    others = [r for r in group if r.precision != base]
    speed = [
        _speed(r, base, _on(device))
        for r in others
        if is_number(r.speedup) and not r.emulated and not r.contended
    ]
    if speed:
        out.append(f"Speed{where}, paired by seed: " + "; ".join(speed) + ".")
    act = [r for r in others if is_number(r.activation_ratio)]
    if act:
        best = min(act, key=lambda r: r.activation_ratio)
        base_mib = best.activation_mib / best.activation_ratio
        saved = best.activation_ratio < 1
        less = f"; {(1 - best.activation_ratio) * 100:.0f}% less" if saved else ""
        head = "Most activation memory saved" if saved else "No mode saved activation memory"
        why = "" if saved else f" {WEIGHT_COPIES}"
        out.append(
            f"{head}{where}: {best.precision}, {best.activation_mib:.2f} MiB per step vs "
            f"{base_mib:.2f} MiB for {base} ({ratio_of(best, 'activation_ratio')}{less}).{why}"
        )
    peak = [r for r in others if is_number(r.peak_ratio)]
    if peak:
        best = min(peak, key=lambda r: r.peak_ratio)
        out.append(
            f"Lowest peak GPU memory{where}: {best.precision}, {best.peak_mib:,.0f} MiB vs "
            f"{best.peak_mib / best.peak_ratio:,.0f} MiB for {base} "
            f"({ratio_of(best, 'peak_ratio')})."
        )
    accs = [r for r in others if is_number(r.acc_delta)]
    if accs:
        parts = [_accuracy(r, base) for r in accs]
        base_row = next((r for r in group if r.precision == base), None)
        if base_row is not None and is_number(base_row.val_acc):
            parts.insert(0, f"{base} reached {acc_of(base_row)} (n={_n(base_row, 'val_acc')})")
        out.append(f"Accuracy{where}, paired by seed: " + "; ".join(parts) + ".")
    return out


def _accuracy(r: Row, base: str) -> str:
    """One mode's accuracy against the baseline's: its verdict on the paired interval, or that
    the interval is too wide (wider than ``ACC_TOLERANCE``, the change the report calls a loss)."""
    est = r.ci.get("acc_delta")
    if _wide(est, ACC_TOLERANCE, ratio=False):
        why = _too_wide(est, ACC_TOLERANCE, False, f"+/- {ACC_TOLERANCE * 100:.1f} points")
        return f"{r.precision}'s accuracy against {base}'s is {points_of(r)}, but {why}"
    words = ACC_WORDS[stats.compare(est, 0.0)]
    return f"{r.precision}'s accuracy {words} {base}'s ({points_of(r)})"
