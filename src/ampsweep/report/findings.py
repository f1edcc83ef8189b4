"""The report's findings: plain-language conclusions, each with the numbers behind it.

Here: the single-run comparisons with the baseline (speed, memory, accuracy, perplexity), time
to quality, contended timings, capacity, fp8 and the hardware's caveats, and ``findings``,
which gathers every finding in the report's order. The verdicts over repeats (95% intervals)
are ``report.verdicts``; gradient underflow and fp16 without a scaler, ``report.underflow``;
what went wrong numerically (where a run's first inf/NaN began, an unhealthy loss scale, the
numerics probe's verdicts), ``report.numerics``. Which modes a finding speaks of is asked of
the mode table (``report.criteria``), and so are the tolerances of "held".
"""

from __future__ import annotations

from collections.abc import Mapping

from ampsweep.measure import contention
from ampsweep.precision.modes import BASELINE
from ampsweep.report import numerics
from ampsweep.report.criteria import ACC_TOLERANCE, LEARNT, PPL_TOLERANCE, is_mode
from ampsweep.report.model import Row, is_number, times
from ampsweep.report.underflow import noscale_findings, underflow_findings
from ampsweep.report.verdicts import WEIGHT_COPIES, interval_findings, pts, ratio_of
from ampsweep.tracking.store import FINISHED


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
            out.extend(interval_findings(group, baseline_mode, suffix, device))
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
                f"({pts(r.acc_delta)} vs {base})."
            )
        for r in gained:
            out.append(
                f"Accuracy rose{where} for {r.precision}: {r.val_acc:.3f} "
                f"({pts(r.acc_delta)} vs {base}; at this run length that is noise, not a gain)."
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
            f"({ratio_of(best, 'max_batch_ratio')}){how}."
        ]
    rest = f"; {others}" if others else ""
    return [
        f"{best.precision} fits {best.max_batch_ratio:.2f}x the batch of {base} {budget}: "
        f"{best.max_batch:,.0f} vs {base_batch:,.0f} samples per step "
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
                f"accuracy and memory show what fp8 does to this model; {share}."
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
        and any(is_mode(r.precision, lambda m: m.dtype == "bf16") for r in half)
    ):
        return [f"This GPU (compute capability {cap}) has no native bf16: bf16 modes are emulated."]
    return []
