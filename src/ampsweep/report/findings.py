"""The report's findings: plain-language conclusions, each with the numbers behind it.

Which modes a finding speaks of is asked of the mode table (``precision.modes``): the modes
without a scaler in fp16, those with one, those with fp32's exponent range. What went wrong
numerically (where a run's first inf/NaN began, an unhealthy loss scale, the numerics probe's
verdicts) are the findings of ``report.numerics``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ampsweep.measure import contention
from ampsweep.precision import modes
from ampsweep.precision.modes import BASELINE
from ampsweep.report import numerics, stats
from ampsweep.report.model import Row, how_much, is_number, percent, ratio_range, times
from ampsweep.tracking.store import FINISHED

ACC_TOLERANCE = 0.015  # accuracy "held" within 1.5 points of the baseline
# Perplexity "held" within 5% of the baseline's: a validation loss within about 0.05 nats.
# Short runs vary more than that with the seed alone (the CPU LM sweep's fp32 run: 9.3 to 12.2
# over four seeds), so a difference beyond it on a short run is a reason to repeat, not proof.
PPL_TOLERANCE = 0.05
# A language model "learnt" when its perplexity is well below the unigram baseline's (what
# predicting each token from its frequency alone gives): below three quarters of it.
LEARNT = 0.75


def _is(name: str, test) -> bool:
    """Whether the mode called ``name`` passes ``test`` (a mode the table lacks never does)."""
    mode = modes.get(name)
    return mode is not None and test(mode)


def _scaled_fp16(m: modes.PrecisionMode) -> bool:
    return m.dtype == "fp16" and m.scaler


def describe_device(tags: dict[str, str]) -> str:
    kind = tags.get("device", "unknown device")
    name = tags.get("device_name", "")
    extra = []
    if kind == "cuda" and tags.get("compute_capability"):
        extra.append(f"compute capability {tags['compute_capability']}")
    if kind == "cpu" and tags.get("cpu_threads"):
        extra.append(f"{tags['cpu_threads']} threads")
    if tags.get("torch_version"):
        extra.append(f"torch {tags['torch_version']}")
    if tags.get("cuda_version"):
        extra.append(f"CUDA {tags['cuda_version']}")
    inner = ", ".join(x for x in [name, *extra] if x)
    return f"{kind} ({inner})" if inner else kind


# Autocast saves half-precision copies of the weights for backward; on a model whose
# activations are small next to its weights, those copies dominate.
WEIGHT_COPIES = (
    "Autocast keeps half-precision copies of the weights for backward, which outweigh the "
    "activations on a model this small."
)


def _capability(tags: dict[str, str]) -> float | None:
    try:
        return float(tags["compute_capability"])
    except (KeyError, ValueError):
        return None


def _pts(delta: float) -> str:
    return f"{delta * 100:+.1f} points"


def _rate(r: Row) -> str:
    """A run's throughput in its own unit: tokens/s for language models, else samples/s."""
    if is_number(r.tokens_per_s):
        return f"{r.tokens_per_s:,.0f} tokens/s"
    return f"{r.samples_per_s:,.0f} samples/s"


def findings(
    rows: list[Row],
    device: dict[str, str],
    baseline_mode: str = BASELINE,
    budget: str = "",
    targets: Mapping[str, str] | None = None,
) -> list[str]:
    """Plain-language conclusions, each with the numbers behind it. ``rows``: one per
    configuration and mode (repeats summarised, ``report.groups``); a verdict over repeats
    carries its 95% interval. ``budget``: the max batch column's memory, in words;
    ``targets``: each configuration's time-to-quality target, in words (``report.quality``).
    A contended run's speed is left out of every speed verdict (``_contention_findings``)."""
    out = [f"Device: {describe_device(device)}."]
    done = [r for r in rows if r.status == FINISHED]
    compared = [r for r in done if r.baseline]
    groups: dict[str, list[Row]] = {}
    for r in compared:
        groups.setdefault(r.configuration, []).append(r)
    for where, group in groups.items():
        suffix = f" ({where})" if len(groups) > 1 else ""
        if any(r.n > 1 for r in group):
            out.extend(_interval_findings(group, baseline_mode, suffix, device))
        else:
            out.extend(_group_findings(group, baseline_mode, suffix))
        if targets and where in targets:
            out.extend(_target_findings(group, baseline_mode, suffix, targets[where]))
    out.extend(_contention_findings(done))
    out.extend(_noscale_findings(done, baseline_mode))
    out.extend(_underflow_findings(done))
    out.extend(numerics.findings(rows))
    out.extend(_capacity_findings(compared, baseline_mode, budget))
    out.extend(_fp8_findings(done))
    out.extend(_hardware_findings(compared, device, baseline_mode))
    missing = [r for r in done if not r.baseline]
    if missing:
        names = ", ".join(r.name for r in missing)
        out.append(
            f"No {baseline_mode} baseline for {len(missing)} run(s) ({names}): their config "
            "differs from every baseline run beyond precision, so their comparisons are blank."
        )
    for r in rows:
        if r.status != FINISHED:
            out.append(f"{r.name} ended {r.status}: {r.error or 'no error recorded'}.")
    if any(r.precision != baseline_mode for r in compared) and all(r.n == 1 for r in compared):
        out.append(
            "Each verdict here rests on a single run per mode: a rerun moves accuracy by a few "
            "tenths of a point and, on a shared machine, speed by tens of percent. "
            "sweep.repeats=3 (or more) repeats every mode with other seeds and gives each "
            "comparison a 95% confidence interval."
        )
    return out


def _group_findings(group: list[Row], base: str, where: str) -> list[str]:
    out = []
    timed = [r for r in group if is_number(r.speedup) and not r.emulated and not r.contended]
    if len(timed) > 1:  # a mode to compare with the baseline (an emulated one has no speed)
        best = max(timed, key=lambda r: r.speedup)
        if best.precision == base or best.speedup <= 1.0:
            others = [r for r in timed if r is not best]
            slower = ", ".join(f"{r.precision} {r.speedup:.2f}x" for r in others)
            out.append(
                f"Fastest here{where}: {best.precision} at {_rate(best)}; "
                f"every other mode is slower (throughput relative to {base}: {slower})."
            )
        else:
            out.append(
                f"Fastest here{where}: {best.precision}, {best.speedup:.2f}x the {base} "
                f"throughput ({_rate(best)})."
            )
    act = [r for r in group if is_number(r.activation_ratio) and r.precision != base]
    if act:
        best = min(act, key=lambda r: r.activation_ratio)
        saved = (1 - best.activation_ratio) * 100
        base_mib = best.activation_mib / best.activation_ratio
        if best.activation_ratio < 1.0:
            out.append(
                f"Most activation memory saved{where}: {best.precision}, "
                f"{best.activation_mib:.2f} MiB per step vs {base_mib:.2f} MiB for {base} "
                f"({best.activation_ratio:.2f}x, {saved:.0f}% less)."
            )
        else:
            out.append(
                f"No mode saved activation memory{where}: the least is {best.precision} with "
                f"{best.activation_mib:.2f} MiB per step vs {base_mib:.2f} MiB for {base} "
                f"({best.activation_ratio:.2f}x). {WEIGHT_COPIES}"
            )
    peak = [r for r in group if is_number(r.peak_ratio) and r.precision != base]
    if peak:
        best = min(peak, key=lambda r: r.peak_ratio)
        out.append(
            f"Lowest peak GPU memory{where}: {best.precision}, {best.peak_mib:,.0f} MiB "
            f"({best.peak_ratio:.2f}x {base})."
        )
    accs = [r for r in group if is_number(r.acc_delta) and r.precision != base]
    if accs:
        base_acc = accs[0].val_acc - accs[0].acc_delta
        held = [r for r in accs if abs(r.acc_delta) <= ACC_TOLERANCE]
        lost = [r for r in accs if r.acc_delta < -ACC_TOLERANCE]
        gained = [r for r in accs if r.acc_delta > ACC_TOLERANCE]
        if held:
            listing = ", ".join(f"{r.precision} {r.val_acc:.3f}" for r in held)
            out.append(
                f"Accuracy held{where} within {ACC_TOLERANCE * 100:.1f} points of {base}'s "
                f"{base_acc:.3f}: {listing}."
            )
        for r in lost:
            out.append(
                f"Accuracy dropped{where} for {r.precision}: {r.val_acc:.3f} "
                f"({_pts(r.acc_delta)} vs {base})."
            )
        for r in gained:
            out.append(
                f"Accuracy rose{where} for {r.precision}: {r.val_acc:.3f} "
                f"({_pts(r.acc_delta)} vs {base}; at this run length that is noise, not a gain)."
            )
    out.extend(_perplexity_findings(group, base, where))
    return out


def _perplexity_findings(group: list[Row], base: str, where: str) -> list[str]:
    """Language models: perplexity against the baseline's, and against the unigram baseline
    of the same text (what predicting each token from its frequency alone achieves)."""
    ppls = [r for r in group if is_number(r.ppl_ratio) and r.precision != base]
    if not ppls:
        return []
    out = []
    base_ppl = ppls[0].val_ppl / ppls[0].ppl_ratio
    unigram = next((r.unigram_ppl for r in group if is_number(r.unigram_ppl)), None)
    if unigram:
        verdict = "learnt well below it" if base_ppl < LEARNT * unigram else "is not far below it"
        out.append(
            f"{base} reached validation perplexity {base_ppl:.3f}{where}; predicting each token "
            f"from its frequency alone (the unigram baseline of the same text) gives "
            f"{unigram:.3f}: the model {verdict}."
        )
    held = [r for r in ppls if abs(r.ppl_ratio - 1.0) <= PPL_TOLERANCE]
    if held:
        listing = ", ".join(f"{r.precision} {r.val_ppl:.3f}" for r in held)
        out.append(
            f"Perplexity held{where} within {PPL_TOLERANCE:.0%} of {base}'s {base_ppl:.3f}: "
            f"{listing}."
        )
    for r in ppls:
        change = f"{(r.ppl_ratio - 1.0) * 100:+.1f}% vs {base}"
        if r.ppl_ratio > 1.0 + PPL_TOLERANCE:
            out.append(f"Perplexity rose{where} for {r.precision}: {r.val_ppl:.3f} ({change}).")
        elif r.ppl_ratio < 1.0 - PPL_TOLERANCE:
            out.append(
                f"Perplexity fell{where} for {r.precision}: {r.val_ppl:.3f} ({change}; at this "
                "run length that is noise, not a gain)."
            )
    return out


def _contention_findings(done: list[Row]) -> list[str]:
    """The runs whose timed steps shared the machine with busy processes: named, with how
    much the others took, and left out of the speed verdicts."""
    hit = [r for r in done if r.contended or r.contended_runs]
    if not hit:
        return []
    parts = []
    for r in hit:
        load = ""
        if is_number(r.cpu_others) and is_number(r.cpu_cores) and is_number(r.cpu_used):
            load = f": {contention.describe(r.cpu_used, r.cpu_others, r.cpu_cores)}"
        if r.n > 1 and not r.contended:
            parts.append(
                f"{r.contended_runs} of {r.n} runs of {r.precision}{load} (its speed-up is "
                f"from the other {r.n - r.contended_runs})"
            )
        elif is_number(r.cpu_others) and not contention.contended(r.cpu_used, r.cpu_others,
                                                                    r.cpu_cores):  # fmt: skip
            parts.append(f"{r.name} (its baseline's timing was)")
        else:
            parts.append(f"{r.name}{load}")
    return [
        "Timing contended, other processes competing for the CPU while these were timed: "
        + "; ".join(parts)
        + ". Their speed is left out of the speed verdicts: a busy machine times the other "
        "processes as much as the mode. Rerun them on an idle machine to compare speed."
    ]


def _target_findings(group: list[Row], base: str, where: str, target: str) -> list[str]:
    """How long each mode took to reach the quality target, fastest first."""
    rows = [r for r in group if r.target_evals]
    if not rows:
        return []
    hit = sorted((r for r in rows if is_number(r.target_s)), key=lambda r: r.target_s)
    base_row = next((r for r in hit if r.precision == base), None)
    parts = []
    for r in hit:
        of = f", {r.target_reached} of {r.n} runs" if r.target_reached < r.n else ""
        vs = ""
        if base_row is not None and r is not base_row and base_row.target_s > 0:
            vs = f", {times(r.target_s / base_row.target_s)} {base}'s time"
        mean = " in the mean" if r.n > 1 else ""
        parts.append(
            f"{r.precision} in {r.target_s:.1f} s{mean} (step {r.target_steps:,.0f}{of}{vs})"
        )
    missed = [r for r in rows if not is_number(r.target_s)]
    for r in missed:
        runs = "in any run" if r.n > 1 else f"in its {r.target_evals} evaluation(s)"
        parts.append(f"{r.precision} not reached {runs}")
    flag = " (some timings contended)" if any(r.contended for r in rows) else ""
    return [
        f"Time to quality{where}, {target}, wall time from the run's start{flag}: "
        + "; ".join(parts)
        + "."
    ]


# ---------------------------------------------------------------- verdicts over repeats


def _on(device: dict[str, str]) -> str:
    kind = device.get("device")
    return {"cpu": " on this CPU", "cuda": " on this GPU"}.get(kind, "")


def _n(r: Row, name: str) -> int:
    est = r.ci.get(name)
    return est.n if est is not None else r.n


def _ratio(r: Row, name: str, vs: str = "") -> str:
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
    shown = _ratio(r, "speedup")
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


def _points(r: Row, vs: str = "") -> str:
    """``-0.1 +/- 0.3 points, n=5``: a paired accuracy difference and its interval."""
    est = r.ci.get("acc_delta")
    if est is None or not est.has_interval:
        return f"{_pts(r.acc_delta)}{vs}, a single run"
    return f"{r.acc_delta * 100:+.1f} +/- {est.half_width * 100:.1f} points{vs}, n={est.n}"


def _acc(r: Row) -> str:
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


def _interval_findings(group: list[Row], base: str, where: str, device: dict) -> list[str]:
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
            f"{base_mib:.2f} MiB for {base} ({_ratio(best, 'activation_ratio')}{less}).{why}"
        )
    peak = [r for r in others if is_number(r.peak_ratio)]
    if peak:
        best = min(peak, key=lambda r: r.peak_ratio)
        out.append(
            f"Lowest peak GPU memory{where}: {best.precision}, {best.peak_mib:,.0f} MiB vs "
            f"{best.peak_mib / best.peak_ratio:,.0f} MiB for {base} "
            f"({_ratio(best, 'peak_ratio')})."
        )
    accs = [r for r in others if is_number(r.acc_delta)]
    if accs:
        parts = [_accuracy(r, base) for r in accs]
        base_row = next((r for r in group if r.precision == base), None)
        if base_row is not None and is_number(base_row.val_acc):
            parts.insert(0, f"{base} reached {_acc(base_row)} (n={_n(base_row, 'val_acc')})")
        out.append(f"Accuracy{where}, paired by seed: " + "; ".join(parts) + ".")
    return out


def _accuracy(r: Row, base: str) -> str:
    """One mode's accuracy against the baseline's: its verdict on the paired interval, or that
    the interval is too wide (wider than ``ACC_TOLERANCE``, the change the report calls a loss)."""
    est = r.ci.get("acc_delta")
    if _wide(est, ACC_TOLERANCE, ratio=False):
        why = _too_wide(est, ACC_TOLERANCE, False, f"+/- {ACC_TOLERANCE * 100:.1f} points")
        return f"{r.precision}'s accuracy against {base}'s is {_points(r)}, but {why}"
    return f"{r.precision}'s accuracy {ACC_WORDS[stats.compare(est, 0.0)]} {base}'s ({_points(r)})"


def _capacity_findings(compared: list[Row], base: str, budget: str) -> list[str]:
    """How much larger a batch each mode fits than the baseline in the memory budget."""
    rows = [r for r in compared if r.precision != base and is_number(r.max_batch_ratio)]
    if not rows or not budget:
        return []
    best = max(rows, key=lambda r: r.max_batch_ratio)
    base_batch = best.max_batch / best.max_batch_ratio
    others = ", ".join(f"{r.precision} {r.max_batch_ratio:.2f}x" for r in rows if r is not best)
    how = (
        " (predicted from the activation bytes per sample and the memory that does not grow "
        "with the batch: parameters, gradients, optimizer state, autocast's weight copies)"
    )
    if best.max_batch_ratio <= 1.0:
        return [
            f"No mode fits a larger batch than {base} {budget}: the most is {best.precision} "
            f"with {best.max_batch:,.0f} vs {base_batch:,.0f} samples per step "
            f"({_ratio(best, 'max_batch_ratio')}){how}."
        ]
    rest = f"; {others}" if others else ""
    return [
        f"{best.precision} fits {best.max_batch_ratio:.2f}x the batch of {base} {budget}: "
        f"{best.max_batch:,.0f} vs {base_batch:,.0f} samples per step "
        f"({_ratio(best, 'max_batch_ratio')}{rest}){how}."
    ]


def _fp8_findings(done: list[Row]) -> list[str]:
    """What fp8 converted, and that an emulated run's speed means nothing."""
    out = []
    for r in done:
        if not _is(r.precision, lambda m: bool(m.fp8)):
            continue
        share = (
            f"the Linear layers it converted carry {r.fp8_flop_share:.0%} of the FLOPs (the rest "
            "ran in bf16)"
            if is_number(r.fp8_flop_share)
            else "no conversion was recorded"
        )
        if r.emulated:
            out.append(
                f"{r.name} ran in torchao's fp8 emulation (precision.fp8.emulate=true): its fp8 "
                "matmuls were computed in higher precision, so its speed means nothing; its "
                f"accuracy and memory show what fp8 does to this model; {share}."
            )
        else:
            out.append(f"{r.name}: {share}; fp8 can speed up only that share.")
    return out


def _noscale_findings(done: list[Row], base: str) -> list[str]:
    out = []
    for r in done:
        if not _is(r.precision, lambda m: m.unscaled_fp16):
            continue
        acc = f"reached {_acc(r)}" if is_number(r.val_acc) else "has no accuracy"
        delta = ""
        if is_number(r.acc_delta):
            vs = f" vs {base}"
            delta = f" ({_points(r, vs)})" if r.n > 1 else f" ({_pts(r.acc_delta)}{vs})"
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
        scaled = [x for x in done if _is(x.precision, _scaled_fp16) and x.model == r.model]
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


def _underflow_findings(done: list[Row]) -> list[str]:
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


def _hardware_findings(compared: list[Row], device: dict[str, str], base: str) -> list[str]:
    half = [
        r
        for r in compared
        if r.precision != base
        and _is(r.precision, lambda m: m.half)
        and is_number(r.speedup)
        and not r.contended
    ]
    rel = ", ".join(f"{r.precision} {r.speedup:.2f}x" for r in half if not r.emulated)
    rel = f" ({rel})" if rel else ""
    kind = device.get("device")
    if kind == "cpu":
        isa = [f for f in device.get("cpu_half_isa", "none").split(",") if f and f != "none"]
        has = (
            ("native half-precision instructions " + ", ".join(isa))
            if isa
            else ("no native fp16/bf16 arithmetic")
        )
        return [
            f"This CPU has no tensor cores and {has}, so its timings of half precision{rel} "
            "say little about a GPU: the speed-ups of mixed precision belong to GPUs with "
            "tensor cores. What carries over from a CPU run is the activation memory saved and "
            "whether accuracy (for a language model, perplexity) held."
        ]
    cap = _capability(device)
    if kind == "cuda" and cap is not None and cap < 7.0:
        return [
            f"This GPU (compute capability {cap}) has no tensor cores, so half precision mostly "
            f"saves memory and bandwidth here{rel}; tensor-core GPUs (7.0+) gain more speed."
        ]
    if (
        kind == "cuda"
        and cap is not None
        and cap < 8.0
        and any(_is(r.precision, lambda m: m.dtype == "bf16") for r in half)
    ):
        return [f"This GPU (compute capability {cap}) has no native bf16: bf16 modes are emulated."]
    return []


# ---------------------------------------------------------------- gradient underflow


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
        (n for n in measured if _is(n, lambda m: m.full_range)),
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
    noscale_mode = next((n for n in measured if _is(n, lambda m: m.unscaled_fp16)), None)
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
    scaled_mode = next((n for n in measured if _is(n, _scaled_fp16)), None)
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
