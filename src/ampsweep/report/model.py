"""What a report is made of: the runs read from the store, one row per run, the report; a mean
over repeats with its interval (``Estimate``); and the words and numbers every part shares."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from ampsweep.config.score import Score, from_tags
from ampsweep.precision import modes
from ampsweep.tracking.store import PRECISION

if TYPE_CHECKING:  # (a type only: no import at run time)
    from typing_extensions import TypeIs


def is_number(x: object) -> TypeIs[float]:
    """Whether ``x`` is a finite number (a value read or computed, not None, inf or nan)."""
    return isinstance(x, int | float) and math.isfinite(x)


def measured(rows: Iterable[Row], name: str) -> list[tuple[Row, float]]:
    """Each row whose field ``name`` holds a finite number, with that number."""
    return [(r, v) for r in rows if is_number(v := getattr(r, name))]


def parse_number(text: str | None) -> float | None:
    """A number from a tag's or a param's text; None for anything else (inf, nan included)."""
    try:
        value = float(text or "")
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def is_mode(name: str, test) -> bool:
    """Whether the mode called ``name`` passes ``test`` (a mode the table lacks never does):
    which modes a finding speaks of is asked of the mode table."""
    mode = modes.get(name)
    return mode is not None and test(mode)


@dataclass(frozen=True)
class Estimate:
    """A mean over ``n`` runs and its confidence interval (``low``/``high`` are None when
    ``n`` is 1: one run has no spread to estimate; ``report.stats`` makes them)."""

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
        if self.low is None or self.high is None:
            return None
        return (self.high - self.low) / 2

    def contains(self, value: float) -> bool:
        return self.low is not None and self.high is not None and self.low <= value <= self.high


def percent(x: float) -> str:
    """A share as the findings write it: ``12.5%``, ``0.0001234%``."""
    return f"{100 * x:.4g}%"


def times(x: float) -> str:
    """A ratio as the report writes it, with the digits its size needs: ``1.40x``, ``12.3x``,
    ``1,586x``, ``0.0012x``."""
    if x >= 100:
        return f"{x:,.0f}x"
    if x >= 10:
        return f"{x:.1f}x"
    return f"{x:.2f}x" if x >= 0.01 else f"{x:.2g}x"


def ratio_range(value: float, est: Estimate | None) -> str:
    """A ratio with its 95% interval as a range, ``1.40x (0.90-2.10x)``: an interval taken on
    the log scale is not symmetric about its mean, so a ``±`` would misstate one side. The
    value alone without an interval, or where every run measured the same."""
    if est is None or est.low is None or est.high is None or times(est.low) == times(est.high):
        return times(value)
    return f"{times(value)} ({times(est.low)[:-1]}-{times(est.high)})"


def how_much(ratio: float) -> str:
    """A speed ratio in words, rounded as one says it: ``1.4x faster``, ``25x slower``
    (0.04x), ``as fast`` (within 5%)."""
    k = ratio if ratio >= 1 else 1 / ratio
    if k < 1.05:
        return "as fast"
    size = f"{k:,.0f}x" if k >= 10 else f"{k:.1f}x"
    return f"{size} {'faster' if ratio >= 1 else 'slower'}"


@dataclass
class RunData:
    """What the report needs of one child run (the latest value of each metric)."""

    run_id: str
    name: str
    status: str
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # The evaluations (val/acc, val/perplexity) as (step, value, MLflow timestamp in ms), and
    # when the run started (ms): its time to quality (``report.quality``)
    timeline: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)
    started_ms: int = 0
    # A relaunch skips a job whose identical config already FINISHED; that earlier run stands
    # in for the job in this launch's report (its job number in this sweep).
    stands_in_for_job: str | None = None
    # The modules that saved the most for backward, largest first (``report.memory``)
    activations_by_module: list[dict] = field(default_factory=list)

    @property
    def precision(self) -> str:
        return self.tags.get(PRECISION) or self.params.get("precision.name", "?")

    @cached_property
    def score(self) -> Score | None:
        """The task's score the run recorded (for an older run: by the metric it logged)."""
        return from_tags(self.tags, self.metrics)


@dataclass
class Row:
    run_id: str
    name: str
    precision: str
    model: str
    dataset: str
    status: str
    job: str | None = None
    baseline: str | None = None  # the baseline run's name; None: no baseline (see note)
    baseline_run_id: str | None = None
    # The task's score (what the findings, the recommendation and time to quality judge by),
    # its final value, and its change against the baseline's in the unit of its tolerance:
    # the difference, or for a relative score (perplexity) the share (0.02: 2% higher).
    score: Score | None = None
    quality: float | None = None
    quality_change: float | None = None
    # The known scores as their own columns: accuracy, perplexity
    val_acc: float | None = None
    acc_delta: float | None = None  # fraction (0.01 = one point)
    # Language models report perplexity instead of accuracy (lower is better).
    val_ppl: float | None = None
    ppl_ratio: float | None = None  # val_ppl / the baseline's (1.02: 2% higher)
    unigram_ppl: float | None = None  # the perplexity of token frequencies on the same text
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    speedup: float | None = None
    activation_mib: float | None = None
    activation_ratio: float | None = None
    peak_mib: float | None = None  # CUDA peak allocated
    peak_ratio: float | None = None
    skipped_steps: float | None = None
    loss_scale: float | None = None
    step_ms: float | None = None
    tflops: float | None = None
    mfu: float | None = None  # fraction of the GPU's peak for the mode's math
    varies: str = ""  # the settings beyond precision that differ between the sweep's runs
    # Precision settings set away from their defaults: (precision.master_weights, True)
    precision_set: tuple[tuple[str, str], ...] = ()
    reused: bool = False  # an earlier launch's FINISHED run standing in for this job
    extra: dict[str, float] = field(default_factory=dict)  # OPTIONAL_PREFIXES metrics
    note: str = ""
    error: str = ""
    seed: str = ""  # trainer.seed
    # capacity: what one sample and the model cost, and the largest batch for the budget
    bytes_per_sample: float | None = None
    model_mib: float | None = None
    max_batch: float | None = None
    max_batch_ratio: float | None = None
    num_classes: int | None = None  # the data's classes (its data.num_classes tag): chance level
    emulated: bool = False  # an fp8 mode in torchao's emulation: its speed means nothing
    fp8_flop_share: float | None = None  # share of the FLOPs in layers converted to fp8
    # What went wrong numerically (read by ``report.sweeps``, judged by ``report.numerics``).
    # Where the first inf/NaN began, as the run located it: the step, the kind (forward, loss,
    # weight_grad, input_grad, not_reproduced), the module, the sentence and the fix;
    # ``nonfinite_runs``: how many of the row's runs had one (the other fields are the first
    # such run's).
    nonfinite_step: int | None = None
    nonfinite_kind: str = ""
    nonfinite_module: str = ""
    nonfinite_where: str = ""
    nonfinite_fix: str = ""
    nonfinite_steps: float | None = None  # how many steps were non-finite
    nonfinite_runs: int = 0
    diverged: bool = False  # stopped for a loss non-finite too many steps in a row
    # The GradScaler (runs with one): the first logged scale, the largest logged over it (1:
    # it never grew), and its settings; the final scale and the skips are above.
    steps: float | None = None  # optimizer steps trained
    scale_first: float | None = None
    scale_growth: float | None = None
    scale_min: float | None = None  # precision.scaler.min_scale
    scale_growth_interval: float | None = None
    scale_dynamic: bool | None = None  # the scale grows and backs off (None: not known)
    # The numerics probe (diagnostics.numerics): its metrics by name, and its two tags
    probe: dict[str, float] = field(default_factory=dict)
    fp16_overflow: str = ""  # modules whose fp16 forward output overflows, with the fp32 value
    update_lost_layers: str = ""  # bf16's share of updates lost, per parameter, largest first
    update_lost_frac: float | None = None  # a pure mode's own steps: updates rounded away
    master_weights: bool = False  # a pure mode's optimizer stepped fp32 copies of its weights
    # A configuration's repeats (same config but the seed) summarised in one row: the field
    # values above are means (ratios: geometric means), ``ci`` their 95% intervals, ``n`` the
    # finished runs (1: a single run, whose row this is), ``members`` their run ids.
    n: int = 1
    ci: dict[str, Estimate] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)
    # How much of the machine the timed steps had (``measure.contention``): the cores this run
    # and every other process used per second, of ``cpu_cores``; ``contended``: the run's or
    # its baseline's timing was contended, so its speed-up is no verdict (over repeats: how
    # many runs were, ``speedup`` then from the others where some were not).
    cpu_used: float | None = None
    cpu_others: float | None = None
    cpu_cores: float | None = None
    contended: bool = False
    contended_runs: int = 0
    # Time to quality: the first evaluation at which the run reached ``target`` (accuracy at
    # least, perplexity at most: ``report.quality``), its training wall time and steps there;
    # None when it never did (``target_evals``: how many evaluations it had to reach it). Over
    # repeats: the means over the runs that reached it, ``target_reached`` how many did.
    target: float | None = None
    target_s: float | None = None
    target_steps: float | None = None
    target_evals: int = 0
    target_reached: int = 0
    # The training step's peak part by part, its batch, the top activation modules
    # (``report.memory.row_memory``; {} where the run recorded no parts)
    memory: dict = field(default_factory=dict)

    @property
    def configuration(self) -> str:
        """The configuration a row belongs to, beyond its precision: ``cnn on digits, lr=0.01``."""
        return f"{self.model} on {self.dataset}" + (f", {self.varies}" if self.varies else "")

    @property
    def config(self) -> str:
        """The config column: the row's precision settings, then its configuration's."""
        return " ".join(x for x in (self.settings, self.varies) if x)

    @property
    def precision_overrides(self) -> tuple[str, ...]:
        """The overrides that set its precision settings: ``precision.master_weights=true``."""
        return tuple(f"{k}={_as_set(v)}" for k, v in self.precision_set)

    @property
    def settings(self) -> str:
        """Its precision settings in words (``master_weights=true``): only where set."""
        return " ".join(f"{k.rsplit('.', 1)[-1]}={_as_set(v)}" for k, v in self.precision_set)

    @property
    def mode(self) -> str:
        """The mode as findings name it: ``bf16_pure (master_weights=true)`` where set."""
        return f"{self.precision} ({self.settings})" if self.settings else self.precision

    @property
    def shown_status(self) -> str:
        return "earlier" if self.reused else self.status

    @property
    def to_target(self) -> str:
        """The time-to-quality cell: ``12.3 s``, ``not reached``, ``12.3 s (2/3)`` where 2 of 3
        runs reached it (their mean), or nothing without a target (the steps: ``target_steps``)."""
        if not is_number(self.target) or not self.target_evals:
            return ""
        if not is_number(self.target_s):
            return "not reached"
        where = f"{self.target_s:.1f} s"
        return (
            where if self.target_reached >= self.n else f"{where} ({self.target_reached}/{self.n})"
        )

    @property
    def timing(self) -> str:
        """``contended`` where the run's timing (or its baseline's) was, else nothing."""
        if not self.contended_runs and not self.contended:
            return ""
        return "contended" if self.n == 1 else f"{self.contended_runs}/{self.n} contended"

    @property
    def scaler_skips(self) -> float | None:
        """Skipped steps where a scaler ran: only a scaler checks steps and skips them."""
        return self.skipped_steps if is_number(self.loss_scale) else None


def _as_set(value: str) -> str:
    """A param's value as an override sets it (MLflow logged Python's ``True``)."""
    return "true" if value == "True" else value


@dataclass(frozen=True)
class Recommendation:
    """``mode`` to use and ``reason`` (with its ``evidence``), and ``command`` to use it; or
    ``mode`` None, the ``open_question`` and in ``command`` the run that would answer it."""

    mode: str | None
    reason: str
    command: str
    evidence: dict[str, str] = field(default_factory=dict)  # what backs it, by name
    open_question: str = ""
    runner_up: str | None = None

    @property
    def text(self) -> str:
        """The recommendation in one paragraph, as the report opens with it."""
        head = f"Use {self.mode}" if self.mode else "Open question"
        return f"{head}: {self.reason} Run: {self.command}"


@dataclass
class Report:
    sweep: dict[str, str]  # run_id, name, experiment_id, sweep_dir, command
    device: dict[str, str]
    baseline_mode: str
    rows: list[Row]  # one per run
    findings: list[str]
    runs: list[RunData] = field(default_factory=list)  # for the charts
    # One row per configuration and mode: its repeats (seeds) summarised; a run that did not
    # finish keeps a row of its own. The same as ``rows`` when nothing was repeated.
    summary: list[Row] = field(default_factory=list)
    budget: str = ""  # the memory budget of the max batch column, in words ("80 GiB")
    # What the report opens with: the mode to use, or the open question (``report.recommend``)
    recommendation: Recommendation | None = None
    # Each configuration's time-to-quality target in words (``report.quality``)
    targets: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.summary:
            self.summary = list(self.rows)

    @property
    def repeated(self) -> bool:
        """Whether some configuration ran more than once (then rows are summarised)."""
        return any(r.n > 1 for r in self.summary)

    def headline_metrics(self) -> dict[str, float]:
        """``speedup/<mode>``, ``acc_delta/<mode>`` (``ppl_ratio/<mode>`` for language models),
        ``activation_ratio/<mode>`` (and ``peak_ratio``, ``max_batch_ratio``) per compared
        configuration; the row's name replaces the mode when a mode repeats. Over repeats: the
        means, and ``<name>_low/<mode>``, ``<name>_high/<mode>`` their 95% interval."""
        counts: dict[str, int] = {}
        for r in self.summary:
            counts[r.precision] = counts.get(r.precision, 0) + 1
        out = {}
        for r in self.summary:
            key = r.precision if counts[r.precision] == 1 else r.name
            for name in (
                "speedup",
                "acc_delta",
                "ppl_ratio",
                "activation_ratio",
                "peak_ratio",
                "max_batch_ratio",
            ):
                value = getattr(r, name)
                if is_number(value):
                    out[f"{name}/{key}"] = value
                est = r.ci.get(name)
                if est is not None and est.low is not None and est.high is not None:
                    out[f"{name}_low/{key}"], out[f"{name}_high/{key}"] = est.low, est.high
        return out
