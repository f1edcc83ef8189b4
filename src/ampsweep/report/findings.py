"""The report's findings: plain-language conclusions, each with the numbers behind it.

Here: the comparisons with the baseline (speed, memory; over repeats each a verdict on the 95%
interval of the paired comparison, ``report.stats``), time to quality, contended timings,
capacity, fp8 and the hardware's caveats, and ``findings``, which gathers every finding in the
report's order. A mode's score against the baseline's is ``report.quality``'s; what went wrong
numerically (where a run's first inf/NaN began, an unhealthy loss scale), ``report.numerics``;
the numerics probe and gradient underflow, ``report.probe``. Which modes a finding speaks of is
asked of the mode table (``model.is_mode``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ampsweep.config.score import OWN_COLUMNS
from ampsweep.measure import contention
from ampsweep.precision.modes import BASELINE
from ampsweep.report import memory, numerics, quality, stats
from ampsweep.report.model import (
    Row,
    RunData,
    how_much,
    is_mode,
    is_number,
    measured,
    ratio_range,
    times,
)
from ampsweep.report.probe import noscale_findings, underflow_findings
from ampsweep.tracking.store import FINISHED

# Autocast saves half-precision copies of the weights for backward; on a model whose
# activations are small next to its weights, those copies dominate.
WEIGHT_COPIES = (
    "Autocast keeps half-precision copies of the weights for backward, which outweigh the "
    "activations on a model this small."
)


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


def _capability(tags: dict[str, str]) -> float | None:
    try:
        return float(tags["compute_capability"])
    except (KeyError, ValueError):
        return None


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
    configuration and mode (repeats summarised, ``report.stats``); a verdict over repeats
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
            out.extend(interval_findings(group, baseline_mode, suffix, device))
            out.extend(quality.interval_findings(group, baseline_mode, suffix))
        else:
            out.extend(_group_findings(group, baseline_mode, suffix))
        if targets and where in targets:
            out.extend(_target_findings(group, baseline_mode, suffix, targets[where]))
    out.extend(_contention_findings(done))
    out.extend(noscale_findings(done, baseline_mode))
    out.extend(underflow_findings(done))
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
        moves = quality.label(compared)
        moves = "accuracy by a few tenths of a point" if moves == "accuracy" else f"{moves} too"
        out.append(
            f"Each verdict here rests on a single run per mode: a rerun moves {moves} and, on a "
            "shared machine, speed by tens of percent. "
            "sweep.repeats=3 (or more) repeats every mode with other seeds and gives each "
            "comparison a 95% confidence interval."
        )
    return out


def _group_findings(group: list[Row], base: str, where: str) -> list[str]:
    out = []
    timed = measured((r for r in group if not r.emulated and not r.contended), "speedup")
    if len(timed) > 1:  # a mode to compare with the baseline (an emulated one has no speed)
        best, speedup = max(timed, key=lambda m: m[1])
        if best.precision == base or speedup <= 1.0:
            others = [(r, x) for r, x in timed if r is not best]
            slower = ", ".join(f"{r.mode} {x:.2f}x" for r, x in others)
            out.append(
                f"Fastest here{where}: {best.mode} at {_rate(best)}; "
                f"every other mode is slower (throughput relative to {base}: {slower})."
            )
        else:
            out.append(
                f"Fastest here{where}: {best.mode}, {speedup:.2f}x the {base} "
                f"throughput ({_rate(best)})."
            )
    out.extend(memory.findings(group, base, where))  # first among the memory findings
    act = measured((r for r in group if r.precision != base), "activation_ratio")
    if act:
        best, ratio = min(act, key=lambda m: m[1])
        mib = best.activation_mib
        assert mib is not None  # what its ratio was measured from
        saved = (1 - ratio) * 100
        base_mib = mib / ratio
        if ratio < 1.0:
            out.append(
                f"Most activation memory saved{where}: {best.mode}, "
                f"{mib:.2f} MiB per step vs {base_mib:.2f} MiB for {base} "
                f"({ratio:.2f}x, {saved:.0f}% less)."
            )
        else:
            out.append(
                f"No mode saved activation memory{where}: the least is {best.mode} with "
                f"{mib:.2f} MiB per step vs {base_mib:.2f} MiB for {base} "
                f"({ratio:.2f}x). {WEIGHT_COPIES}"
            )
    peak = measured((r for r in group if r.precision != base), "peak_ratio")
    if peak:
        best, _ = min(peak, key=lambda m: m[1])
        out.append(
            f"Lowest peak GPU memory{where}: {best.mode}, {best.peak_mib:,.0f} MiB "
            f"({best.peak_ratio:.2f}x {base})."
        )
    out.extend(quality.findings(group, base, where))
    return out


# ---------------------------------------------------------------- over repeats


def _on(device: dict[str, str]) -> str:
    kind = device.get("device", "")
    return {"cpu": " on this CPU", "cuda": " on this GPU"}.get(kind, "")


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


def _speed(r: Row, base: str, on: str) -> str:
    """One mode's speed against the baseline: ``fp16 is 25x slower than fp32 on this CPU
    (0.04x (0.03-0.05x), n=3)``; a wide interval is named as such, with the runs it needs."""
    est = r.ci.get("speedup")
    verdict = stats.compare(est, 1.0)
    shown = ratio_of(r, "speedup")
    speedup = r.speedup
    assert speedup is not None  # a mode timed against the baseline
    if est is not None and stats.wide(est, stats.PRECISION_WANTED, ratio=True):
        within = f"within {stats.PRECISION_WANTED:.0%}"
        why = stats.too_wide(est, stats.PRECISION_WANTED, True, within)
        words = how_much(speedup)
        than = "as fast as" if words == "as fast" else f"{words} than"
        return f"{r.mode} ran {than} {base}{on} in the mean ({shown}), but {why}"
    if verdict in ("lower", "higher"):
        words = how_much(speedup)
        if words == "as fast":
            words = "slightly slower" if verdict == "lower" else "slightly faster"
        return f"{r.mode} is {words} than {base}{on} ({shown})"
    return f"{r.mode} {SPEED_WORDS[verdict]} {base}{on} ({shown})"


# What the interval of a paired comparison says (``stats.compare``; None: a single run)
SPEED_WORDS = {
    "lower": "is slower than",
    "higher": "is faster than",
    "indistinguishable": "is indistinguishable in speed from",
    None: "compares with",
}


def interval_findings(group: list[Row], base: str, where: str, device: dict) -> list[str]:
    """Speed and memory against the baseline, each a verdict on the 95% interval of the paired
    comparison: a mode is faster only when the whole interval says so, else it is
    indistinguishable from the baseline at this number of repeats."""
    out = []
    others = [r for r in group if r.precision != base]
    speed = [
        _speed(r, base, _on(device))
        for r in others
        if is_number(r.speedup) and not r.emulated and not r.contended
    ]
    if speed:
        out.append(f"Speed{where}, paired by seed: " + "; ".join(speed) + ".")
    out.extend(memory.findings(group, base, where))  # first among the memory findings
    act = measured(others, "activation_ratio")
    if act:
        best, ratio = min(act, key=lambda m: m[1])
        mib = best.activation_mib
        assert mib is not None  # what its ratio was measured from
        base_mib = mib / ratio
        saved = ratio < 1
        less = f"; {(1 - ratio) * 100:.0f}% less" if saved else ""
        head = "Most activation memory saved" if saved else "No mode saved activation memory"
        why = "" if saved else f" {WEIGHT_COPIES}"
        out.append(
            f"{head}{where}: {best.mode}, {mib:.2f} MiB per step vs "
            f"{base_mib:.2f} MiB for {base} ({ratio_of(best, 'activation_ratio')}{less}).{why}"
        )
    peak = measured(others, "peak_ratio")
    if peak:
        best, ratio = min(peak, key=lambda m: m[1])
        mib = best.peak_mib
        assert mib is not None  # what its ratio was measured from
        out.append(
            f"Lowest peak GPU memory{where}: {best.mode}, {mib:,.0f} MiB vs "
            f"{mib / ratio:,.0f} MiB for {base} "
            f"({ratio_of(best, 'peak_ratio')})."
        )
    return out


# ---------------------------------------------------------------- every report


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
                f"{r.contended_runs} of {r.n} runs of {r.mode}{load} (its speed-up is "
                f"from the other {r.n - r.contended_runs})"
            )
        elif is_number(r.cpu_others) and not contention.contended(
            r.cpu_used, r.cpu_others, r.cpu_cores
        ):
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
    hit = sorted(measured(rows, "target_s"), key=lambda m: m[1])
    base_hit = next((m for m in hit if m[0].precision == base), None)
    parts = []
    for r, s in hit:
        of = f", {r.target_reached} of {r.n} runs" if r.target_reached < r.n else ""
        vs = ""
        if base_hit is not None and r is not base_hit[0] and base_hit[1] > 0:
            vs = f", {times(s / base_hit[1])} {base}'s time"
        mean = " in the mean" if r.n > 1 else ""
        parts.append(f"{r.mode} in {s:.1f} s{mean} (step {r.target_steps:,.0f}{of}{vs})")
    missed = [r for r in rows if not is_number(r.target_s)]
    for r in missed:
        runs = "in any run" if r.n > 1 else f"in its {r.target_evals} evaluation(s)"
        parts.append(f"{r.mode} not reached {runs}")
    flag = " (some timings contended)" if any(r.contended for r in rows) else ""
    return [
        f"Time to quality{where}, {target}, wall time from the run's start{flag}: "
        + "; ".join(parts)
        + "."
    ]


def _capacity_findings(compared: list[Row], base: str, budget: str) -> list[str]:
    """How much larger a batch each mode fits than the baseline in the memory budget."""
    rows = measured((r for r in compared if r.precision != base), "max_batch_ratio")
    if not rows or not budget:
        return []
    best, ratio = max(rows, key=lambda m: m[1])
    batch = best.max_batch
    assert batch is not None  # what its ratio was measured from
    base_batch = batch / ratio
    others = ", ".join(f"{r.mode} {x:.2f}x" for r, x in rows if r is not best)
    how = (
        " (predicted from the activation bytes per sample and the memory that does not grow "
        "with the batch: parameters, gradients, optimizer state, autocast's weight copies)"
    )
    if ratio <= 1.0:
        return [
            f"No mode fits a larger batch than {base} {budget}: the most is {best.mode} "
            f"with {batch:,.0f} vs {base_batch:,.0f} samples per step "
            f"({ratio_of(best, 'max_batch_ratio')}){how}."
        ]
    rest = f"; {others}" if others else ""
    return [
        f"{best.mode} fits {ratio:.2f}x the batch of {base} {budget}: "
        f"{batch:,.0f} vs {base_batch:,.0f} samples per step "
        f"({ratio_of(best, 'max_batch_ratio')}{rest}){how}."
    ]


def _fp8_findings(done: list[Row]) -> list[str]:
    """What fp8 converted, and that an emulated run's speed means nothing."""
    out = []
    for r in done:
        if not is_mode(r.precision, lambda m: bool(m.fp8)):
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
                f"{quality.label([r])} and memory show what fp8 does to this model; {share}."
            )
        else:
            out.append(f"{r.name}: {share}; fp8 can speed up only that share.")
    return out


def _hardware_findings(compared: list[Row], device: dict[str, str], base: str) -> list[str]:
    half = [
        r
        for r in compared
        if r.precision != base
        and is_mode(r.precision, lambda m: m.half)
        and is_number(r.speedup)
        and not r.contended
    ]
    rel = ", ".join(f"{r.mode} {r.speedup:.2f}x" for r in half if not r.emulated)
    rel = f" ({rel})" if rel else ""
    kind = device.get("device")
    if kind == "cpu":
        scores = {r.score.name for r in compared if r.score is not None}
        held = "accuracy (for a language model, perplexity)"  # the tasks ampsweep ships
        held = held if scores <= OWN_COLUMNS else quality.label(compared)
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
            f"whether {held} held."
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
        and any(is_mode(r.precision, lambda m: m.dtype == "bf16") for r in half)
    ):
        return [f"This GPU (compute capability {cap}) has no native bf16: bf16 modes are emulated."]
    return []


def untimed_findings(rows: list[Row], runs: list[RunData]) -> list[str]:
    """Why a finished run's speed columns are blank: it trained no step past its timing
    warm-up (``trainer.timing_warmup_steps``), so there was no step to time; and what to set."""
    warmup = {r.run_id: r.params.get("trainer.timing_warmup_steps", "") for r in runs}
    blank = [
        r
        for r in rows
        if r.status == FINISHED
        and r.samples_per_s is None
        and r.steps is not None
        and warmup.get(r.run_id, "").isdigit()
        and r.steps <= int(warmup[r.run_id])
    ]
    if not blank:
        return []
    steps, skip = int(max(r.steps or 0 for r in blank)), warmup[blank[0].run_id]
    names = ", ".join(r.name for r in blank)
    return [
        f"Samples/s and speed-up are blank for {names}: too few steps to time ({steps} "
        f"trained, the first {skip} untimed as warm-up): set trainer.max_steps above {skip} "
        f"(or trainer.timing_warmup_steps below {steps})."
    ]
