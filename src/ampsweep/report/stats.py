"""Statistics of repeated runs: means with confidence intervals, as pure functions.

A configuration run N times with different seeds gives N values of each metric. Its mean gets
a two-sided confidence interval from Student's t distribution (scipy), which is right for small
N (the normal approximation is far too narrow at N=3). A mode is compared with the baseline
*paired*: each run against the baseline run of the same seed, so what the seed changes (the
initial weights, the data order) cancels out of the difference. Ratios (speed-up, memory ratio)
are averaged on the log scale: the interval of a ratio is then symmetric in "x times faster"
and "x times slower", and never crosses zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LEVEL = 0.95  # the confidence level of every interval in the report
# Below three runs an interval is too wide to judge unless it clears the null value anyway:
# with two runs Student's t is 12.7 (4.3 with three), so one noisy pair spans orders of
# magnitude.
MIN_REPEATS = 3
# How narrow an interval must be to be worth its runs: a ratio within 10% either way of its
# mean, a mean within 10% of itself. What "repeats needed" aims at.
PRECISION_WANTED = 0.10
MAX_REPEATS = 100  # beyond this many repeats the report says "more than 100"


@dataclass(frozen=True)
class Estimate:
    """A mean over ``n`` runs and its confidence interval (``low``/``high`` are None when
    ``n`` is 1: one run has no spread to estimate)."""

    mean: float
    low: float | None
    high: float | None
    n: int

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def half_width(self) -> float | None:
        """Half the interval's width (``mean +/- half_width`` for a symmetric interval)."""
        return (self.high - self.low) / 2 if self.has_interval else None

    def contains(self, value: float) -> bool:
        return self.has_interval and self.low <= value <= self.high


def t_quantile(level: float, dof: int) -> float:
    """The two-sided critical value of Student's t with ``dof`` degrees of freedom: the
    inverse of its distribution function (scipy.special's, the one ``scipy.stats.t.ppf``
    calls, without importing scipy.stats, a much larger import, at the end of a sweep)."""
    from scipy import special

    return float(special.stdtrit(dof, 0.5 + level / 2))


def mean_interval(
    values: Sequence[float],
    level: float = LEVEL,
    bounds: tuple[float | None, float | None] = (None, None),
) -> Estimate | None:
    """The mean of ``values`` and its t interval; None for no values. ``bounds``: the range
    the quantity cannot leave (an accuracy lies in [0, 1]); the t interval, symmetric by
    construction, is cut at them rather than reporting e.g. an accuracy of up to 1.24."""
    xs = [float(v) for v in values if _finite(v)]
    n = len(xs)
    if n == 0:
        return None
    mean = sum(xs) / n
    if n == 1:
        return Estimate(mean, None, None, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    lowest, highest = bounds
    low = mean - half if lowest is None else max(lowest, mean - half)
    high = mean + half if highest is None else min(highest, mean + half)
    return Estimate(mean, low, high, n)


def paired_difference(
    values: Sequence[float], baselines: Sequence[float], level: float = LEVEL
) -> Estimate | None:
    """The mean of ``values[i] - baselines[i]`` (each pair from the same seed) and its
    interval: the paired t interval."""
    if len(values) != len(baselines):
        raise ValueError("paired_difference needs one baseline per value")
    return mean_interval([v - b for v, b in zip(values, baselines, strict=True)], level)


def ratio_interval(ratios: Sequence[float], level: float = LEVEL) -> Estimate | None:
    """The geometric mean of positive ratios (each a run over its same-seed baseline) and its
    interval, computed on the log scale and mapped back."""
    logs = [math.log(r) for r in ratios if _finite(r) and r > 0]
    est = mean_interval(logs, level)
    if est is None:
        return None
    if not est.has_interval:
        return Estimate(math.exp(est.mean), None, None, est.n)
    return Estimate(math.exp(est.mean), math.exp(est.low), math.exp(est.high), est.n)


def paired_ratio(
    values: Sequence[float], baselines: Sequence[float], level: float = LEVEL
) -> Estimate | None:
    """``ratio_interval`` of ``values[i] / baselines[i]``."""
    if len(values) != len(baselines):
        raise ValueError("paired_ratio needs one baseline per value")
    pairs = zip(values, baselines, strict=True)
    return ratio_interval([v / b for v, b in pairs if _finite(v) and _finite(b) and b > 0], level)


def repeats_needed(
    est: Estimate | None, target: float, ratio: bool = False, level: float = LEVEL
) -> int | None:
    """The number of runs at which the interval's half-width would fall to ``target`` at the
    spread ``est`` observed (its standard deviation, recovered from its half-width and t);
    for a ``ratio`` the half-width is on the log scale, so ``target`` 0.10 means within a
    factor 1.10 either way. None without an interval; ``MAX_REPEATS + 1`` when even
    ``MAX_REPEATS`` would not do."""
    if est is None or not est.has_interval:
        return None
    if ratio:
        half, target = (math.log(est.high) - math.log(est.low)) / 2, math.log(1 + target)
    else:
        half = est.half_width
    sd = half * math.sqrt(est.n) / t_quantile(level, est.n - 1)
    for n in range(2, MAX_REPEATS + 1):
        if t_quantile(level, n - 1) * sd / math.sqrt(n) <= target:
            return n
    return MAX_REPEATS + 1


def compare(est: Estimate | None, null: float) -> str | None:
    """Where an interval lies against the value of "no difference" (0 for a difference, 1 for
    a ratio): "lower" or "higher" when the whole interval lies on that side (at any number of
    runs), "indistinguishable" when it contains ``null`` over ``MIN_REPEATS`` runs or more,
    "too wide" when it contains ``null`` over fewer (too few runs to call it a tie); None
    without an interval."""
    if est is None or not est.has_interval:
        return None
    if est.high < null:
        return "lower"
    if est.low > null:
        return "higher"
    return "indistinguishable" if est.n >= MIN_REPEATS else "too wide"


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
