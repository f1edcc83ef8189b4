"""The report on each mode's quality: its score against the baseline's, in the score's own
direction, unit and tolerance (``config.score``: the task's, as the run recorded it), and its
time to quality.

"Held" is a change within the score's tolerance (accuracy: 1.5 points; perplexity: 5%), a
change beyond it is a loss or, the other way, noise at a short run's length; over repeats the
verdict rests on the 95% interval of the paired change (``report.stats``).

Time to quality: what a practitioner pays for is the time to a given quality, not samples per
second at one batch size (MLPerf's training benchmarks time runs to a target quality the same
way). The target is, by default, as near the baseline's final score as the score's ``target``
says (half a point of accuracy, 2% of perplexity); ``--target`` gives one in the score's own
unit instead. Each run's time is read from the evaluations it logged (each with its step and
MLflow timestamp): the first evaluation at or past the target, as wall time since the run
started (its setup, evaluations and checkpoints included: what the run cost) and optimizer
steps. A run evaluates at the end of each ``trainer.eval_every`` epochs, so the time is that of
the evaluation that saw it.
"""

from __future__ import annotations

import statistics

from ampsweep.config.score import ACCURACY, Score
from ampsweep.report import stats
from ampsweep.report.model import Row, RunData, is_number

# A language model "learnt" when its perplexity is well below the unigram baseline's (what
# predicting each token from its frequency alone gives): below three quarters of it.
LEARNT = 0.75

# What the interval of a paired change says (``stats.compare``; None: a single run)
COMPARE_WORDS = {
    "lower": "is lower than",
    "higher": "is higher than",
    "indistinguishable": "is indistinguishable from",
    None: "compares with",
}


def label(rows: list[Row]) -> str:
    """What the rows' score is called (``accuracy``), or ``quality`` where none was read."""
    return next((r.score.label for r in rows if r.score is not None), "quality")


# ---------------------------------------------------------------- a row's score in words


def value_of(r: Row) -> str:
    """``0.982``, over repeats ``0.982 +/- 0.004``."""
    assert r.score is not None and r.quality is not None  # a row whose score was read
    est = r.ci.get("quality")
    return r.score.show(r.quality, est.half_width if est is not None else None)


def change_of(r: Row, vs: str = "") -> str:
    """``-0.1 +/- 0.3 points, n=5``: a paired change and its interval (``, a single run``)."""
    assert r.score is not None and r.quality_change is not None  # a row compared with its base
    est = r.ci.get("quality_change")
    if est is None or not est.has_interval:
        return f"{r.score.show_change(r.quality_change)}{vs}, a single run"
    return f"{r.score.show_change(r.quality_change, est.half_width)}{vs}, n={est.n}"


def reached(r: Row, base: str) -> str:
    """``reached 0.900 (-8.6 points vs fp32)``, ``reached perplexity 11.000 (-8.3% vs fp32)``:
    what a run of a mode reached (accuracy is named by its value alone)."""
    s = r.score
    if s is None or not is_number(r.quality):
        return f"has no {s.label if s else ACCURACY.label}"
    what = value_of(r) if s.name == ACCURACY.name else f"{s.label} {value_of(r)}"
    if not is_number(r.quality_change):
        return f"reached {what}"
    vs = f" vs {base}"
    if r.n > 1:
        return f"reached {what} ({change_of(r, vs)})"
    return f"reached {what} ({s.show_change(r.quality_change)}{vs})"


# ---------------------------------------------------------------- findings


# Accuracy below this many times chance (1 / classes) is a baseline that has not learned.
CHANCE_FACTOR = 1.5


def not_learned(base: Row) -> str:
    """Why the baseline has not learned, in words with its numbers; "" when it has."""
    # (a binary task's one logit, num_classes 1, has no chance level of 1/classes)
    if is_number(base.val_acc) and base.num_classes and base.num_classes >= 2:
        chance = 1 / base.num_classes
        if base.val_acc < CHANCE_FACTOR * chance:
            return (
                f"{base.mode} reached accuracy {base.val_acc:.3f}, near chance for "
                f"{base.num_classes} classes ({chance:.3f}): the baseline has not learned"
            )
    if is_number(base.val_ppl) and is_number(base.unigram_ppl):
        if base.val_ppl >= LEARNT * base.unigram_ppl:
            return (
                f"{base.mode} reached perplexity {base.val_ppl:.3f}, not far below the "
                f"unigram baseline's {base.unigram_ppl:.3f}: the baseline has not learned"
            )
    return ""


def findings(group: list[Row], base: str, where: str) -> list[str]:
    """Single runs: each mode's score against the baseline's, held within the tolerance, or
    worse or better beyond it (a gain at a short run's length is noise); a language model's
    baseline against the unigram baseline of the same text."""
    rows = [r for r in group if is_number(r.quality_change) and r.precision != base]
    out = _learnt(group, base, where)
    baseline = next((r for r in group if r.precision == base), None)
    unlearned = not_learned(baseline) if baseline is not None else ""
    if rows and unlearned:  # a score held against chance says nothing
        modes = ", ".join(r.mode for r in rows)
        return [*out, f"No verdict on quality{where} for {modes}: {unlearned}."]
    if not rows:
        return out
    # A row with a change against the baseline has its score and its value
    s = rows[0].score
    assert s is not None
    values: dict[str, tuple[float, float]] = {}  # run id -> (value, change)
    for r in rows:
        assert r.quality is not None and r.quality_change is not None
        values[r.run_id] = (r.quality, r.quality_change)
    quality, change = values[rows[0].run_id]
    base_value = quality / (1 + change) if s.relative else quality - change
    verdicts = {r.run_id: s.verdict(values[r.run_id][1]) for r in rows}
    held = [r for r in rows if verdicts[r.run_id] == "held"]
    if held:
        listing = ", ".join(f"{r.mode} {s.show(values[r.run_id][0])}" for r in held)
        out.append(
            f"{s.title} held{where} {s.within()} of {base}'s {s.show(base_value)}: {listing}."
        )
    for r in (r for r in rows if verdicts[r.run_id] == "worse"):
        quality, change = values[r.run_id]
        out.append(
            f"{s.title} {s.worse_word}{where} for {r.mode}: {s.show(quality)} "
            f"({s.show_change(change)} vs {base})."
        )
    for r in (r for r in rows if verdicts[r.run_id] == "better"):
        quality, change = values[r.run_id]
        out.append(
            f"{s.title} {s.better_word}{where} for {r.mode}: {s.show(quality)} "
            f"({s.show_change(change)} vs {base}; at this run length that is noise, "
            "not a gain)."
        )
    return out


def _learnt(group: list[Row], base: str, where: str) -> list[str]:
    """A language model's baseline perplexity against the unigram baseline of the same text
    (what predicting each token from its frequency alone achieves)."""
    ppls = [r for r in group if is_number(r.ppl_ratio) and r.precision != base]
    unigram = next((r.unigram_ppl for r in group if is_number(r.unigram_ppl)), None)
    if not ppls or not unigram:
        return []
    val_ppl, ppl_ratio = ppls[0].val_ppl, ppls[0].ppl_ratio
    assert val_ppl is not None and ppl_ratio is not None  # a ratio of its perplexity
    base_ppl = val_ppl / ppl_ratio
    verdict = "learnt well below it" if base_ppl < LEARNT * unigram else "is not far below it"
    return [
        f"{base} reached validation perplexity {base_ppl:.3f}{where}; predicting each token "
        f"from its frequency alone (the unigram baseline of the same text) gives "
        f"{unigram:.3f}: the model {verdict}."
    ]


def interval_findings(group: list[Row], base: str, where: str) -> list[str]:
    """Repeats: each mode's score against the baseline's, a verdict on the 95% interval of the
    paired change, or that the interval is too wide to judge (wider than the tolerance)."""
    others = [r for r in group if r.precision != base and is_number(r.quality_change)]
    if not others:
        return []
    s = others[0].score
    assert s is not None  # a row with a change against the baseline has its score
    parts = [_interval(r, base) for r in others]
    base_row = next((r for r in group if r.precision == base), None)
    if base_row is not None and is_number(base_row.quality):
        n = est.n if (est := base_row.ci.get("quality")) is not None else base_row.n
        parts.insert(0, f"{base} reached {value_of(base_row)} (n={n})")
    return [f"{s.title}{where}, paired by seed: " + "; ".join(parts) + "."]


def _interval(r: Row, base: str) -> str:
    s, est = r.score, r.ci.get("quality_change")
    assert s is not None  # a row with a change against the baseline has its score
    if est is not None and stats.wide(est, s.tolerance, ratio=False):
        why = stats.too_wide(est, s.tolerance, False, s.plus_minus())
        return f"{r.mode}'s {s.label} against {base}'s is {change_of(r)}, but {why}"
    words = COMPARE_WORDS[stats.compare(est, 0.0)]
    return f"{r.mode}'s {s.label} {words} {base}'s ({change_of(r)})"


def verdict(r: Row) -> str:
    """``held``, ``lost`` or ``open`` (an interval reaching both sides of the tolerance, or no
    score measured): what the recommendation asks (a gain holds)."""
    s = r.score
    if s is None or not is_number(r.quality_change):
        return "open"
    est = r.ci.get("quality_change")
    if est is None or not est.has_interval:
        return "lost" if s.verdict(r.quality_change) == "worse" else "held"
    assert est.low is not None and est.high is not None  # has_interval
    ends = {s.verdict(est.low), s.verdict(est.high)}
    return "held" if "worse" not in ends else "lost" if ends == {"worse"} else "open"


def words(r: Row, base: Row) -> str:
    """``accuracy 0.982 (-0.1 +/- 0.3 points vs fp32)``, ``perplexity 12.100 vs 12.000
    (1.01x)``: the evidence of a mode's quality."""
    s = r.score
    if s is None or not is_number(r.quality_change) or not is_number(r.quality):
        return f"no {s.label if s else ACCURACY.label} measured"
    if s.relative:
        assert base.quality is not None  # the change is against the baseline's value
        return (
            f"{s.label} {s.show(r.quality)} vs {s.show(base.quality)} ({1 + r.quality_change:.2f}x)"
        )
    est = r.ci.get("quality_change")
    spread = est.half_width if est is not None and est.has_interval else None
    change = s.show_change(r.quality_change, spread)
    return f"{s.label} {s.show(r.quality)} ({change} vs {base.mode})"


# ---------------------------------------------------------------- time to quality


def score_of(run: RunData) -> Score | None:
    """The score a run logged evaluations of (with their timestamps)."""
    s = run.score
    return s if s is not None and run.timeline.get(s.name) else None


def time_to(run: RunData, target: float, score: Score) -> tuple[float, int] | None:
    """Seconds since the run started and the step of its first evaluation at the target;
    None when no evaluation reached it."""
    for step, value, stamp in sorted(run.timeline.get(score.name, []), key=lambda e: e[2]):
        if score.reached(value, target):
            return max(0.0, (stamp - run.started_ms) / 1000), step
    return None


def describe_target(target: float, score: Score, base: Row | None, given: bool) -> str:
    """``val acc >= 0.981 (within 0.5 points of fp32's 0.986)``."""
    op = ">=" if score.higher_is_better else "<="
    if given or base is None:
        return f"{score.short} {op} {target:.3f} (--target)"
    why = f"{score.within(score.target)} of {base.mode}'s {base.quality:.3f}"
    return f"{score.short} {op} {target:.3f} ({why})"


def apply(
    rows: list[Row],
    summary: list[Row],
    runs: list[RunData],
    baseline_mode: str,
    target: float | None = None,
) -> dict[str, str]:
    """Fill in each row's time to quality (``Row.target*``), per configuration: the target is
    ``target`` or the default from that configuration's baseline (over repeats: its mean).
    Returns each configuration's target in words (what the finding and the chart say it was)."""
    by_id = {r.run_id: r for r in runs}
    said: dict[str, str] = {}
    for where in dict.fromkeys(r.configuration for r in summary):
        group = [s for s in summary if s.configuration == where and s.status == "FINISHED"]
        members = {m for s in group for m in (s.members or [s.run_id])}
        score = next((found for rid in members if (found := score_of(by_id[rid]))), None)
        base = next((s for s in group if s.precision == baseline_mode), None)
        value = target
        if value is None and score is not None and base is not None and is_number(base.quality):
            value = score.target_from(base.quality)
        if score is None or value is None:
            continue
        said[where] = describe_target(value, score, base, target is not None)
        for row in (r for r in rows if r.run_id in members):
            _fill(row, [by_id[row.run_id]], value, score)
        for s in group:
            _fill(s, [by_id[m] for m in (s.members or [s.run_id])], value, score)
    return said


def _fill(row: Row, members: list[RunData], target: float, score: Score) -> None:
    hits = [h for m in members if (h := time_to(m, target, score)) is not None]
    row.target = target
    row.target_evals = max(len(m.timeline.get(score.name, [])) for m in members)
    row.target_reached = len(hits)
    if hits:
        row.target_s = statistics.fmean(h[0] for h in hits)
        row.target_steps = statistics.fmean(h[1] for h in hits)
    else:
        row.target_s = row.target_steps = None
