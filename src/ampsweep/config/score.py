"""A task's score: the quality metric a run is judged by besides its loss, and how to judge it.

The task owns its score (``engine.tasks``: classification scores ``val/acc``, language
modeling ``val/perplexity``, regression ``val/rmse``, binary ``val/auroc``, multi-label
``val/f1``, segmentation ``val/miou``); a run records it as tags (``Score.tags``), and
everything that compares two runs' quality asks the score: the report's findings, its
recommendation and time to quality, the doctor's verdict on a fix, ``reproduce``. A new task
with a new score is then one ``Score`` (here, or a user task's own), and every reader follows
its direction.

Torch-free: the report reads scores without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

PREFIX = "score."  # the run's tags: score.name, score.higher_is_better, score.tolerance, ...


@dataclass(frozen=True)
class Score:
    """A quality metric and how to compare two values of it.

    ``tolerance``: the change against the baseline that still counts as "quality held"; a
    share of the baseline's value when ``relative`` (perplexity: 5%), else in the metric's own
    unit (accuracy: 0.015, 1.5 points). ``target``: the default time-to-quality target, as near
    the baseline's final value as that. ``points``: a fraction shown in points (0.01, one)."""

    name: str  # the metric, e.g. val/acc
    label: str  # what the report calls it: accuracy
    higher_is_better: bool = True
    tolerance: float = 0.0
    relative: bool = False
    points: bool = False
    target: float = 0.0
    low: float | None = None  # the range a value cannot leave (an accuracy lies in [0, 1])
    high: float | None = None

    @property
    def title(self) -> str:
        """The label opening a sentence: ``Accuracy``; one written with capitals of its own
        stays as written (``mIoU``, ``AUROC``)."""
        if self.label != self.label.lower():
            return self.label
        return self.label[:1].upper() + self.label[1:]

    @property
    def short(self) -> str:
        """The metric in words: ``val acc``."""
        return self.name.replace("/", " ")

    @property
    def worse_word(self) -> str:
        return "dropped" if self.higher_is_better else "rose"

    @property
    def better_word(self) -> str:
        return "rose" if self.higher_is_better else "fell"

    # ------------------------------------------------------------ comparing two values

    def change(self, value: float, base: float) -> float | None:
        """``value`` against ``base`` in the unit the tolerance is in: their difference, or
        for a ``relative`` score the share of ``base`` (0.02: 2% higher); None where a share
        of a non-positive base means nothing."""
        if not self.relative:
            return value - base
        return value / base - 1.0 if base > 0 else None

    def verdict(self, change: float, tolerance: float | None = None) -> str:
        """``held`` (within the tolerance either way), ``better`` or ``worse`` beyond it, in
        the score's direction."""
        tol = self.tolerance if tolerance is None else tolerance
        gain = change if self.higher_is_better else -change
        return "held" if abs(change) <= tol else "better" if gain > 0 else "worse"

    def held(self, value: float, base: float) -> bool:
        """Whether ``value`` is no worse than ``base`` beyond the tolerance (a gain holds)."""
        change = self.change(value, base)
        return change is not None and self.verdict(change) != "worse"

    def beats(self, a: float, b: float) -> bool:
        """Whether ``a`` is the better value."""
        return a > b if self.higher_is_better else a < b

    def target_from(self, base: float) -> float:
        """The default time-to-quality target from the baseline's final value."""
        sign = -1.0 if self.higher_is_better else 1.0
        return base * (1 + sign * self.target) if self.relative else base + sign * self.target

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    # ------------------------------------------------------------ in words

    def show(self, value: float, spread: float | None = None) -> str:
        """``0.982``; with the half-width of its interval, ``0.982 +/- 0.004``."""
        return f"{value:.3f}" + (f" +/- {spread:.3f}" if spread is not None else "")

    def show_change(self, change: float, spread: float | None = None) -> str:
        """``+0.3 points``, ``+1.2%``, ``+0.013``; with the half-width of its interval,
        ``+0.3 +/- 0.2 points``."""
        if self.relative or self.points:
            unit = "%" if self.relative else " points"
            plus = f" +/- {spread * 100:.1f}" if spread is not None else ""
            return f"{change * 100:+.1f}{plus}{unit}"
        return f"{change:+.3g}" + (f" +/- {spread:.3g}" if spread is not None else "")

    def within(self, amount: float | None = None) -> str:
        """``within 1.5 points``, ``within 5%``: a tolerance (default: the score's)."""
        return f"within {self._amount(amount)}"

    def plus_minus(self, amount: float | None = None) -> str:
        """``+/- 1.5 points``: an interval's half-width as wide as ``amount`` (the tolerance)."""
        return f"+/- {self._amount(amount)}"

    def _amount(self, amount: float | None) -> str:
        amount = self.tolerance if amount is None else amount
        if self.relative:
            return f"{amount:.0%}"
        return f"{amount * 100:.1f} points" if self.points else f"{amount:g}"

    # ------------------------------------------------------------ recorded on a run

    def tags(self) -> dict[str, str]:
        """The score as a run's tags, so that a report reads it from the run."""
        return {f"{PREFIX}{f.name}": str(getattr(self, f.name)) for f in fields(self)}


ACCURACY = Score(
    "val/acc", "accuracy", tolerance=0.015, points=True, target=0.005, low=0.0, high=1.0
)
# Perplexity "held" within 5% of the baseline's: a validation loss within about 0.05 nats.
# Short runs vary more than that with the seed alone, so a difference beyond it on a short run
# is a reason to repeat, not proof.
PERPLEXITY = Score(
    "val/perplexity",
    "perplexity",
    higher_is_better=False,
    tolerance=0.05,
    relative=True,
    target=0.02,
    low=1.0,
)
# Regression: the RMSE held within 5% of the baseline's (its unit is the targets').
RMSE = Score(
    "val/rmse", "RMSE", higher_is_better=False, tolerance=0.05, relative=True, target=0.02, low=0.0
)
AUROC = Score("val/auroc", "AUROC", tolerance=0.015, points=True, target=0.005, low=0.0, high=1.0)
F1 = Score("val/f1", "F1", tolerance=0.015, points=True, target=0.005, low=0.0, high=1.0)
MIOU = Score("val/miou", "mIoU", tolerance=0.015, points=True, target=0.005, low=0.0, high=1.0)
KNOWN = {s.name: s for s in (ACCURACY, PERPLEXITY, RMSE, AUROC, F1, MIOU)}
# The scores the report shows in columns of their own (val acc, val ppl); any other score
# shows in its "score" column under its own name.
OWN_COLUMNS = frozenset({ACCURACY.name, PERPLEXITY.name})


def from_tags(tags: dict[str, str], metrics: dict[str, float] | None = None) -> Score | None:
    """The score a run recorded in its tags; for a run recorded before scores were (no
    ``score.name`` tag), the known score whose metric it logged (perplexity before accuracy);
    None when it has neither."""
    name = tags.get(f"{PREFIX}name")
    if not name:
        metrics = metrics or {}  # a language model may log an accuracy too: perplexity first
        return next((s for s in (PERPLEXITY, ACCURACY) if s.name in metrics), None)
    known = KNOWN.get(name, Score(name, name.rsplit("/", 1)[-1]))
    changes = {}
    for f in fields(Score):
        text = tags.get(f"{PREFIX}{f.name}")
        if text is None or f.name == "name":
            continue
        value = _parse(text, getattr(known, f.name))
        if value is not _BAD:
            changes[f.name] = value
    return replace(known, **changes)


_BAD = object()


def _parse(text: str, like):
    """A tag's text as the type of the field's value ``like`` (a malformed tag is ignored)."""
    if isinstance(like, bool):
        return {"True": True, "False": False}.get(text, _BAD)
    if isinstance(like, str):
        return text
    if text == "None":
        return None
    try:
        return float(text)
    except ValueError:
        return _BAD


def of_metrics(metrics: dict[str, float]) -> Score | None:
    """The known score among a run's final metrics (an untracked run's summary)."""
    return from_tags({}, metrics)
