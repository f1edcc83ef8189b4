"""Memory explained: each run's training-step peak part by part (``mem/<part>_mib``), the finding
that says what each mode saved against the baseline and why, what shrinks the part that
dominates (each a config to run, its peak predicted: ``measure.capacity.Breakdown``), the
prediction of another batch checked against a run at that batch, the table of the text report
and the bars of ``charts/memory_breakdown.png``.

A row's ``memory`` (and the JSON report's key of that name) holds the step's measured peak, its
parts, the run's batch, the activation bytes per sample, and the modules that saved the most for
backward (the run's ``memory/activations_by_module.json``), where recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from ampsweep.measure import capacity
from ampsweep.measure.capacity import Breakdown
from ampsweep.precision import modes
from ampsweep.report.model import Report, Row, RunData, is_number
from ampsweep.report.stats import SEED, config_key
from ampsweep.tracking import artifacts

BATCH = "trainer.batch_size"
MODULES_ARTIFACT = "memory/activations_by_module.json"
TOP_MODULES = 5  # the modules a row keeps of that artifact, largest first
WEIGHTS = ("params", "grads", "optimizer", "master_weights")  # what autocast leaves in fp32
DOMINANT = 0.5  # a share of the peak above which a part decides what shrinks it
NOTABLE = 0.1  # a share of a mode's peak worth a finding of its own (the autocast cache)
# The parts as the table and the chart name them, and their colours (bottom to top)
PART_NAMES = {
    "params": "params",
    "grads": "grads",
    "optimizer": "optimizer",
    "master_weights": "master weights",
    "autocast_cache": "autocast cache",
    "activations": "activations",
    "activation_grads": "activation grads",
    "fp8": "fp8",
    "other": "other",
}
PART_COLORS = {
    "params": "#4c72b0",
    "grads": "#64b5cd",
    "optimizer": "#8172b3",
    "master_weights": "#ccb974",
    "autocast_cache": "#dd8452",
    "activations": "#55a868",
    "activation_grads": "#a6d854",
    "fp8": "#937860",
    "other": "#bbbbbb",
}


# ---------------------------------------------------------------- what a run recorded


def load_modules(client, run_id: str) -> list[dict]:
    """The run's activations by module (largest first), or [] where it recorded none or its
    artifacts cannot be read (the rest of the report does not need them)."""
    from mlflow.exceptions import MlflowException

    folder, name = MODULES_ARTIFACT.rsplit("/", 1)
    try:
        if not any(f.path.endswith(name) for f in client.list_artifacts(run_id, folder)):
            return []
        found = json.loads(artifacts.read_text(client, run_id, MODULES_ARTIFACT))
    except (OSError, ValueError, MlflowException):
        return []
    return found if isinstance(found, list) else []


def row_memory(run: RunData) -> dict:
    """A row's ``memory``: ``step_peak_mib`` (None where not measured), ``parts`` (MiB),
    ``batch``, ``bytes_per_sample`` and the top ``activations_by_module``; {} where the run
    recorded no parts."""
    bd = breakdown_of(run.metrics, run.precision, run.params)
    if bd is None:
        return {}
    peak = run.metrics.get(capacity.STEP_PEAK)
    out: dict[str, object] = {
        "step_peak_mib": peak if is_number(peak) else None,
        "parts": bd.parts,
        "batch": bd.batch,
        "bytes_per_sample": bd.per_sample,
        "peak_at_optimizer": bd.at_optimizer,
        "saved_mib": bd.saved,
        "weight_copies_mib": bd.copies,
        "optimizer_intermediates_mib": bd.intermediates,
    }
    if run.activations_by_module:
        out["activations_by_module"] = run.activations_by_module[:TOP_MODULES]
    return out


def breakdown_of(metrics: dict, mode: str, params: dict[str, str]) -> Breakdown | None:
    try:
        batch = int(params.get(BATCH, ""))
    except ValueError:
        return None
    return capacity.breakdown(metrics, mode, batch)


def of_row(row: Row) -> Breakdown | None:
    """The row's measured breakdown (``Row.memory``), for the findings, table and chart; None
    for a run that measured no step peak (an older run's parts leave out ``other``)."""
    m = row.memory
    if not m or m.get("step_peak_mib") is None or row.precision not in modes.MODES:
        return None
    at_optimizer, saved = m.get("peak_at_optimizer", False), m.get("saved_mib", 0.0)
    copies, intermediates = (
        m.get("weight_copies_mib", 0.0),
        m.get("optimizer_intermediates_mib", 0.0),
    )
    parts = dict(m["parts"])
    return Breakdown(
        row.precision, m["batch"], parts, True, (), at_optimizer, saved, copies, intermediates
    )


def measured_rows(rows: Iterable[Row]) -> list[tuple[Row, Breakdown]]:
    return [(r, bd) for r in rows if (bd := of_row(r)) is not None]


def mib(x: float) -> str:
    """``846 MiB``, ``1.1 GiB``, ``12.5 MiB``, ``0.31 MiB``, ``97.7 KiB``."""
    if x < 0.1:
        return f"{x * 1024:.3g} KiB"
    if x >= 1024:
        return f"{x / 1024:.2g} GiB" if x < 10 * 1024 else f"{x / 1024:,.1f} GiB"
    return f"{x:,.0f} MiB" if x >= 100 else f"{x:.3g} MiB"


def percent(x: float) -> str:
    """A share of the peak as one says it: ``4%``, ``71%``, ``0.3%``."""
    return f"{100 * x:.0f}%" if abs(x) >= 0.01 else f"{100 * x:.1f}%"


# ---------------------------------------------------------------- what shrinks it


TOLERANCE = 0.10  # how far above its limit a fix's measured peak may be and still count


@dataclass(frozen=True)
class Fix:
    """A config that shrinks the part that dominates: its overrides, what it is predicted to
    hold (None where the prediction is not made: FSDP's shards) and the peak it must stay
    under to count as a fix (``limit_of``: fp32's for a larger batch, else the mode's own)."""

    overrides: tuple[str, ...]
    predicted_mib: float | None
    why: str
    limit_mib: float = 0.0
    limit_of: str = ""

    @property
    def text(self) -> str:
        run = " ".join(self.overrides)
        shown = f", predicted {mib(self.predicted_mib)}" if self.predicted_mib else ""
        return f"{run} ({self.why}{shown})"

    def verdict(self, measured_mib: float | None) -> tuple[bool, str]:
        """Whether a run of the fix measured a step peak within its limit (``TOLERANCE``
        above it allowed), in words with the prediction's error."""
        if not is_number(measured_mib):
            return False, "NOT verified: the run measured no step peak"
        err, predicted = capacity.error_pct(self.predicted_mib, measured_mib), self.predicted_mib
        against = (
            f"predicted {mib(predicted)}, {err:+.1f}%" if predicted and err is not None else ""
        )
        shown = f"step peak {mib(measured_mib)} vs {mib(self.limit_mib)} of {self.limit_of}"
        shown += f" ({against})" if against else ""
        if measured_mib <= self.limit_mib * (1 + TOLERANCE):
            return True, f"fixed: {shown}"
        return False, f"NOT fixed: {shown}"


def pure_of(mode: modes.PrecisionMode) -> modes.PrecisionMode | None:
    """The pure mode of ``mode``'s dtype (its weights and optimizer state in 16 bits)."""
    return next((m for m in modes.MODES.values() if m.pure and m.dtype == mode.dtype), None)


def fixes(base: Breakdown, amp: Breakdown, settings: tuple[str, ...] = ()) -> list[Fix]:
    """What shrinks the part that dominates ``base``'s peak, each predicted from ``amp``'s
    measured step: the weights and optimizer state (a pure mode, FSDP), or the activations (a
    larger batch in the same memory, where autocast halved them). ``settings``: the overrides
    of ``amp``'s precision settings (``Row.precision_overrides``), which a fix that keeps its
    mode keeps too."""
    mode = modes.MODES[amp.mode]
    out = []
    larger = amp.max_batch(base.total * capacity.MIB)
    if larger is not None and larger > amp.batch:
        out.append(
            Fix(
                (f"precision={amp.mode}", *settings, f"{BATCH}={larger}"),
                amp.at(larger).total,
                f"the largest batch {amp.mode} fits in {base.mode}'s peak",
                base.total,
                f"{base.mode} at batch {base.batch}",
            )
        )
    if base.share(*WEIGHTS) >= DOMINANT:
        pure = pure_of(mode)
        if pure is not None and pure.name != amp.mode:
            out.append(
                Fix(
                    (f"precision={pure.name}",),
                    amp.at(mode=pure.name).total,
                    f"weights, gradients and optimizer state in {pure.dtype}, no fp32 copy",
                    amp.total,
                    amp.mode,
                )
            )
        # fp32 copies keep every update and hold as much as fp32's weights: offered only
        # where what it does save (the autocast cache, fp32 activations) makes it smaller
        masters = amp.at(mode=pure.name, master_weights=True) if pure else None
        if pure is not None and masters is not None and masters.total < amp.total:
            out.append(
                Fix(
                    (f"precision={pure.name}", "precision.master_weights=true"),
                    masters.total,
                    f"{pure.dtype} weights and gradients beside fp32 master weights and "
                    "optimizer state, which keep every update: as much weight memory as fp32, "
                    "no autocast cache",
                    amp.total,
                    amp.mode,
                )
            )
        out.append(
            Fix(
                (f"precision={amp.mode}", *settings, "trainer.strategy=fsdp", "trainer.nproc=2"),
                None,
                "each rank holds half the weights, gradients and optimizer state",
            )
        )
    return out


# ---------------------------------------------------------------- the findings


def findings(group: list[Row], base: str, where: str) -> list[str]:
    """The finding that answers the question, for each mode against ``base`` (one
    configuration's rows), then the autocast cache and fp8's weight copies where they matter."""
    found = measured_rows(group)
    ref = next((bd for r, bd in found if r.precision == base), None)
    if ref is None:
        return []
    out = [saved(ref, bd, where, r) for r, bd in found if r.precision != base]
    out += [cache_finding(bd, where, r.mode) for r, bd in found if is_cached(bd)]
    out.append(fp8_finding(found, where))
    return [line for line in out if line]


def saved(ref: Breakdown, bd: Breakdown, where: str, row: Row | None = None) -> str:
    """``bf16 saved 4% of the step's peak against fp32, 812 MiB vs 846 MiB at batch 8: the
    activations, their gradients and backward's temporaries are 9% of fp32's peak; the
    weights, gradients and optimizer state are 71%. What dominates does not shrink with
    autocast: ...``; ``row``: ``bd``'s, whose precision settings name it and its fixes."""
    change = 1 - bd.total / ref.total
    verb = f"saved {percent(change)} of the step's peak against {ref.mode}"
    if change < 0:
        verb = f"used {percent(-change)} more memory than {ref.mode} at the step's peak"
    if abs(change) < 0.005:
        verb = f"saved nothing of the step's peak against {ref.mode}"
    name = row.mode if row is not None else bd.mode
    head = f"{name} {verb}{where}, {mib(bd.total)} vs {mib(ref.total)} at batch {ref.batch}"
    act, weights = ref.share("activations", "activation_grads", "other"), ref.share(*WEIGHTS)
    why = (
        f"the activations, their gradients and backward's temporaries are {percent(act)} of "
        f"{ref.mode}'s peak; the weights, gradients and optimizer state are {percent(weights)}"
    )
    if ref.at_optimizer:  # nothing autocast halves is live at the peak
        weights += ref.share("other")  # (the optimizer's intermediate results of older runs)
        steps = ref.intermediates / ref.total if ref.total else 0.0
        why = (
            f"{ref.mode}'s peak is in the optimizer's step, after backward has freed the "
            f"activations autocast halves: the weights, gradients and optimizer state are "
            f"{percent(ref.share(*WEIGHTS) - steps)} of it, the optimizer's intermediate "
            f"results {percent(steps)}"
        )
    cache = bd.parts.get("autocast_cache", 0.0) + bd.parts.get("fp8", 0.0)
    if change < 0 and cache:
        less = ref.parts.get("activations", 0.0) - bd.parts.get("activations", 0.0)
        why = (
            f"its {modes.MODES[bd.mode].dtype} weight copies ({mib(cache)}) outweigh what it "
            f"saved of the activations ({mib(less)}); {why}"
        )
    if weights >= DOMINANT and not modes.MODES[bd.mode].autocast:
        lead = "what shrinks the rest: "  # a pure mode has halved the weights already
    elif weights >= DOMINANT:
        lead = "what dominates does not shrink with autocast: "
    elif act >= DOMINANT:
        lead = "the activations dominate, so autocast's saving is real: "
    else:
        lead = ""
    settings = row.precision_overrides if row is not None else ()
    shrink = "; ".join(f.text for f in fixes(ref, bd, settings))
    return f"{head}: {why}." + (f" {lead[0].upper()}{lead[1:]}{shrink}." if shrink else "")


def is_cached(bd: Breakdown) -> bool:
    """Whether autocast's cache is a tenth of the peak: worth a finding of its own."""
    return bd.share("autocast_cache") >= NOTABLE


def cache_finding(bd: Breakdown, where: str, name: str) -> str:
    """Autocast's cache of half-precision weight copies, where it is a tenth of the peak
    (``name``: the row's mode with its precision settings)."""
    mode = modes.MODES[bd.mode]
    cache = bd.parts["autocast_cache"]
    pure = pure_of(mode)
    fix = ""
    if pure is not None:
        fix = (
            f": precision={pure.name} keeps none (its weights are {pure.dtype} already; "
            f"predicted {mib(bd.at(mode=pure.name).total)})"
        )
    return (
        f"{name}'s autocast cache holds {mib(cache)} of {mode.dtype} weight copies{where}, "
        f"{percent(cache / bd.total)} of its step's peak{fix}."
    )


def fp8_finding(found: list[tuple[Row, Breakdown]], where: str) -> str:
    """An fp8 mode that used more memory than the 16-bit autocast mode of its dtype (its row
    without precision settings: a module kept in fp32 would not be autocast's plain cost)."""
    for row, bd in found:
        mode = modes.MODES[bd.mode]
        plain = next((b for r, b in found if b.mode == mode.dtype and not r.settings), None)
        if mode.fp8 and plain is not None and bd.total > plain.total:
            copies = bd.parts.get("fp8", 0.0)
            return (
                f"{row.mode} used more memory than {plain.mode}{where} ({mib(bd.total)} vs "
                f"{mib(plain.total)}): its fp8 weight copies and scales ({mib(copies)}) are "
                f"kept beside autocast's {plain.mode} ones without compile; "
                f"trainer.compile=true fuses the casts into the matmuls."
            )
    return ""


def prediction_findings(rows: list[Row], runs: list[RunData]) -> list[str]:
    """Where the sweep ran one configuration at several batch sizes: each larger batch's step
    peak predicted from the smallest batch's run, against what it measured, with the error."""
    params = {r.run_id: r.params for r in runs}
    groups: dict[tuple, list[tuple[Row, Breakdown]]] = {}
    for row, bd in measured_rows(rows):
        # a precision setting parts a series: master weights hold more at every batch
        key = (row.mode, config_key(params.get(row.run_id, {}), ignore=(BATCH, SEED)))
        groups.setdefault(key, []).append((row, bd))
    out = []
    for group in groups.values():
        (first, small), *rest = sorted(group, key=lambda m: m[1].batch)
        checks = []
        for _, bd in rest:
            if bd.batch == small.batch:
                continue
            predicted = small.at(bd.batch).total
            err = capacity.error_pct(predicted, bd.total)
            checks.append(
                f"batch {bd.batch}: predicted {mib(predicted)}, measured {mib(bd.total)} "
                f"({err:+.1f}%)"
            )
        if checks:
            out.append(
                f"{first.mode}'s step peak predicted from its batch-{small.batch} run: "
                + "; ".join(checks)
                + "."
            )
    return out


# ---------------------------------------------------------------- the text report's section


def cell(x: float) -> str:
    """A table's MiB with the digits its size needs: ``1,234``, ``17.2``, ``0.07``."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def table(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells of the memory table: a row per mode, its peak and parts in MiB."""
    found = measured_rows(rows)
    shown = [p for p in capacity.PARTS if any(bd.parts.get(p) for _, bd in found)]
    headers = ["mode", "batch", "step peak", *(PART_NAMES[p] for p in shown)]
    body = [
        [r.mode, str(bd.batch), cell(bd.total), *(cell(bd.parts[p]) for p in shown)]
        for r, bd in found
    ]
    return headers, body


def module_lines(report: Report) -> list[str]:
    """The baseline's modules that saved the most for backward: where activation
    checkpointing or channels_last would act."""
    for r in report.summary:
        top = r.memory.get("activations_by_module") if r.memory else None
        if r.precision == report.baseline_mode and top:
            items = [
                f"{m.get('module') or '(root)'}"
                + (f" ({m['type']})" if m.get("type") else "")
                + f" {mib(m.get('mib', 0.0))}, {percent(m.get('share', 0.0))}"
                for m in top
            ]
            return [f"Saved for backward the most in {r.name}: " + "; ".join(items) + "."]
    return []
