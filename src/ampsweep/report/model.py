"""What a report is made of: the runs read from the store, one row per run, the report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ampsweep.tracking.store import PRECISION


def is_number(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


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

    @property
    def precision(self) -> str:
        return self.tags.get(PRECISION) or self.params.get("precision.name", "?")


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
    extra: dict[str, float] = field(default_factory=dict)  # OPTIONAL_PREFIXES metrics
    note: str = ""
    error: str = ""


@dataclass
class Report:
    sweep: dict[str, str]  # run_id, name, experiment_id, sweep_dir, command
    device: dict[str, str]
    baseline_mode: str
    rows: list[Row]
    findings: list[str]
    runs: list[RunData] = field(default_factory=list)  # for the charts

    def headline_metrics(self) -> dict[str, float]:
        """``speedup/<mode>``, ``acc_delta/<mode>`` (``ppl_ratio/<mode>`` for language models),
        ``activation_ratio/<mode>`` (and ``peak_ratio``) per compared run; the run name replaces
        the mode when a mode repeats."""
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r.precision] = counts.get(r.precision, 0) + 1
        out = {}
        for r in self.rows:
            key = r.precision if counts[r.precision] == 1 else r.name
            for name, value in (
                ("speedup", r.speedup),
                ("acc_delta", r.acc_delta),
                ("ppl_ratio", r.ppl_ratio),
                ("activation_ratio", r.activation_ratio),
                ("peak_ratio", r.peak_ratio),
            ):
                if is_number(value):
                    out[f"{name}/{key}"] = value
        return out
