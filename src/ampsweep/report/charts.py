"""PNG charts of a sweep report (matplotlib figures, drawn by its Agg renderer: no display).

One figure per question: how fast (throughput, speed-up), how much memory (activations, GPU
peak), how accurate (for language models: what perplexity), how training went (validation
loss over steps), how soon each mode reaches a quality (quality against wall time), and
what the loss scaler did (scale over steps). They are logged to the
sweep's parent run under charts/.
"""

from __future__ import annotations

from pathlib import Path

# Figures made without pyplot: saving one to PNG draws it with the Agg renderer, so no
# display is needed, the process's matplotlib backend is left as it was (a notebook's too),
# and pyplot's import (about half of matplotlib's, at the end of every sweep) is skipped.
from matplotlib.figure import Figure

from ampsweep.precision.modes import color as _color
from ampsweep.report import memory as parts
from ampsweep.report import quality
from ampsweep.report.model import Report, Row, is_number, measured
from ampsweep.tracking.store import FINISHED


def _label(row: Row, rows: list[Row]) -> str:
    """The mode (with its precision settings) alone when each appears once, else the run name."""
    return row.mode if sum(r.mode == row.mode for r in rows) == 1 else row.name


def _errors(rows: list[Row], key: str):
    """Error bars: each bar's 95% interval over repeats (none for a single run), as matplotlib's
    2 x N (below, above) distances; None when no bar has one. The intervals are already cut
    at their quantity's bounds (``stats.BOUNDS``): none reaches below zero."""
    below, above = [], []
    for r in rows:
        est, value = r.ci.get(key), getattr(r, key)
        if est is not None and est.low is not None and est.high is not None and is_number(value):
            below.append(value - est.low)
            above.append(est.high - value)
        else:
            below.append(0.0)
            above.append(0.0)
    return [below, above] if any(below) or any(above) else None


def _bars(
    ax, rows: list[Row], values: list[float], notes: list[str], ylabel: str, key: str = ""
) -> None:
    labels = [_label(r, rows) for r in rows]
    errors = _errors(rows, key) if key else None
    bars = ax.bar(labels, values, color=[_color(r.precision) for r in rows], yerr=errors, capsize=4)
    for bar, note in zip(bars, notes, strict=True):
        if note:
            ax.annotate(
                note,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", labelrotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")


def _x(value) -> str:
    return f"{value:.2f}x" if is_number(value) else ""


def _figure(*grid: int, figsize: tuple[float, float], squeeze: bool = True):
    """A figure and its axes, as ``pyplot.subplots`` returns them."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*grid, squeeze=squeeze)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _over(report: Report) -> str:
    """What the bars are, with repeats: means, and error bars for their 95% intervals."""
    return "; mean and 95% interval over seeds" if report.repeated else ""


def throughput(report: Report, path: Path) -> Path | None:
    found = measured(report.summary, "samples_per_s")
    if not found:
        return None
    rows = [r for r, _ in found]
    fig, ax = _figure(figsize=(8, 4.5))
    notes = [_x(r.speedup) + (" (emulated)" if r.emulated else "") for r in rows]
    _bars(ax, rows, [v for _, v in found], notes, "samples/s", "samples_per_s")
    ax.set_title(
        f"Training throughput (labels: speed-up over {report.baseline_mode}{_over(report)})"
    )
    return _save(fig, path)


def memory(report: Report, path: Path) -> Path | None:
    found = measured(report.summary, "activation_mib")
    if not found:
        return None
    rows = [r for r, _ in found]
    peak = measured(rows, "peak_mib")
    fig, axes = _figure(1, 2 if peak else 1, figsize=(12 if peak else 8, 4.5), squeeze=False)
    _bars(
        axes[0][0],
        rows,
        [v for _, v in found],
        [_x(r.activation_ratio) for r in rows],
        "MiB saved for backward per step",
        "activation_mib",
    )
    axes[0][0].set_title(f"Activation memory (labels: ratio to {report.baseline_mode})")
    if peak:
        _bars(
            axes[0][1],
            [r for r, _ in peak],
            [v for _, v in peak],
            [_x(r.peak_ratio) for r, _ in peak],
            "MiB (CUDA peak allocated)",
            "peak_mib",
        )
        axes[0][1].set_title("Peak GPU memory")
    return _save(fig, path)


def memory_breakdown(report: Report, path: Path) -> Path | None:
    """A stacked bar per mode: its training step's peak, part by part (``report.memory``)."""
    found = parts.measured_rows(report.summary)
    if not found:
        return None
    rows = [r for r, _ in found]
    labels = [f"{_label(r, rows)}\nbatch {bd.batch}" for r, bd in found]
    fig, ax = _figure(figsize=(8, 4.5))
    bottom = [0.0] * len(found)
    for part, name in parts.PART_NAMES.items():
        heights = [bd.parts.get(part, 0.0) for _, bd in found]
        if not any(heights):
            continue
        ax.bar(labels, heights, bottom=bottom, label=name, color=parts.PART_COLORS[part])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:,.1f}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("MiB at the training step's peak")
    ax.set_title("Memory of a training step, part by part (labels: the peak in MiB)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def accuracy(report: Report, path: Path) -> Path | None:
    found = measured(report.summary, "val_acc")
    if not found:
        return None
    rows, values = [r for r, _ in found], [v for _, v in found]
    fig, ax = _figure(figsize=(8, 4.5))
    notes = [f"{r.acc_delta * 100:+.1f} pt" if is_number(r.acc_delta) else "" for r in rows]
    _bars(ax, rows, values, notes, "validation accuracy", "val_acc")
    low = min(values)
    ax.set_ylim(max(0.0, low - 0.1), 1.0 if low > 0.5 else None)
    ax.set_title(f"Validation accuracy (labels: points vs {report.baseline_mode}{_over(report)})")
    return _save(fig, path)


def capacity(report: Report, path: Path) -> Path | None:
    found = measured(report.summary, "max_batch")
    if not found or not report.budget:
        return None
    rows = [r for r, _ in found]
    fig, ax = _figure(figsize=(8, 4.5))
    notes = [_x(r.max_batch_ratio) for r in rows]
    _bars(ax, rows, [v for _, v in found], notes, "samples per step", "max_batch")
    ax.set_title(
        f"Largest batch predicted {report.budget} (labels: ratio to {report.baseline_mode})"
    )
    return _save(fig, path)


def perplexity(report: Report, path: Path) -> Path | None:
    found = measured(report.rows, "val_ppl")
    if not found:
        return None
    rows = [r for r, _ in found]
    fig, ax = _figure(figsize=(8, 4.5))
    _bars(
        ax,
        rows,
        [v for _, v in found],
        [_x(r.ppl_ratio) for r in rows],
        "validation perplexity (lower is better)",
    )
    unigram = next((r.unigram_ppl for r in rows if is_number(r.unigram_ppl)), None)
    if unigram:
        ax.axhline(unigram, color="grey", linestyle="--", label=f"unigram baseline {unigram:.2f}")
        ax.legend(fontsize=8)
    ax.set_title(f"Validation perplexity (labels: ratio to {report.baseline_mode})")
    return _save(fig, path)


def _curves(report: Report, key: str, path: Path, title: str, ylabel: str, log: bool):
    runs = [r for r in report.runs if r.status == FINISHED and r.history.get(key)]
    if not runs:
        return None
    rows = {r.run_id: r for r in report.rows}
    # With repeats, one line per run in its mode's colour, the legend naming each mode once.
    group_of = {m: s for s in report.summary for m in s.members}
    fig, ax = _figure(figsize=(8, 4.5))
    labelled = set()
    for run in runs:
        steps, values = zip(*sorted(run.history[key]), strict=True)
        row = group_of.get(run.run_id, rows[run.run_id])
        label = _label(row, report.summary)
        ax.plot(
            steps,
            values,
            marker=".",
            label=None if label in labelled else label,
            color=_color(row.precision),
            alpha=0.6 if row.n > 1 else 1.0,
        )
        labelled.add(label)
    if log:
        ax.set_yscale("log", base=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def time_to_quality(report: Report, path: Path) -> Path | None:
    """Validation quality against wall time since each run started, a line per run in its
    mode's colour, and the time-to-quality target as a dashed line: which mode gets there
    first, and whether it does at all."""
    runs = [r for r in report.runs if r.status == FINISHED and quality.score_of(r)]
    if not runs:
        return None
    rows = {r.run_id: r for r in report.rows}
    group_of = {m: s for s in report.summary for m in s.members}
    score = quality.score_of(runs[0])
    assert score is not None  # runs are those with a score
    fig, ax = _figure(figsize=(8, 4.5))
    labelled = set()
    for run in runs:
        points = sorted(run.timeline.get(score.name, []), key=lambda e: e[2])
        if not points:
            continue
        seconds = [max(0.0, (stamp - run.started_ms) / 1000) for _, _, stamp in points]
        row = group_of.get(run.run_id, rows[run.run_id])
        label = _label(row, report.summary)
        ax.plot(
            seconds,
            [v for _, v, _ in points],
            marker=".",
            color=_color(row.precision),
            label=None if label in labelled else label,
            alpha=0.6 if row.n > 1 else 1.0,
        )
        labelled.add(label)
    targets = {r.target for r in report.rows if is_number(r.target)}
    if len(targets) == 1:  # one configuration (several: each its own target, none drawn)
        words = next(iter(report.targets.values()), "")
        ax.axhline(targets.pop(), color="grey", linestyle="--", label=f"target: {words}")
    ax.set_xlabel("wall time since the run started (s)")
    lower = "" if score.higher_is_better else " (lower is better)"
    ax.set_ylabel(f"validation {score.label}{lower}")
    ax.set_title("Time to quality: validation quality against wall time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def write_charts(report: Report, folder: Path) -> list[Path]:
    """Every chart that has data, as PNG files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    made = [
        throughput(report, folder / "throughput.png"),
        memory(report, folder / "memory.png"),
        memory_breakdown(report, folder / "memory_breakdown.png"),
        accuracy(report, folder / "accuracy.png"),
        perplexity(report, folder / "perplexity.png"),
        capacity(report, folder / "max_batch.png"),
        time_to_quality(report, folder / "time_to_quality.png"),
        _curves(
            report, "val/loss", folder / "val_loss.png", "Validation loss", "val/loss", log=False
        ),
        _curves(
            report,
            "amp/loss_scale",
            folder / "loss_scale.png",
            "Loss scale (runs with a GradScaler)",
            "loss scale (log2)",
            log=True,
        ),
    ]
    return [p for p in made if p is not None]
