"""What a run shows at the console: a progress bar per epoch, then a summary.

At a terminal, text is word-wrapped at its width. When the output is not a terminal (a log
file, CI, ``tee``) nothing is wrapped (``soft_wrap``): a path or a run id stays whole on one
line, and tables are laid out for 100 columns instead of rich's assumed 80.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TextIO, cast

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ampsweep.config import score
from ampsweep.tracking.secrets import MaskedStream

PIPED_WIDTH = 100  # tables in a log file: rich would assume 80 columns


def _console(stderr: bool = False) -> Console:
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    # Every line goes through the masking of secrets: an error may quote a path or a value
    # that holds one (dataset.root=/data/$MY_TOKEN).
    stream = MaskedStream("stderr" if stderr else "stdout")
    return Console(
        file=cast(TextIO, stream),  # a text stream by duck typing: write, the rest delegated
        highlight=False,
        soft_wrap=not tty,
        width=None if tty else PIPED_WIDTH,
    )


console = _console()
errors = _console(stderr=True)


@contextlib.contextmanager
def quiet_unless_main(is_main: bool):
    """Ranks other than 0 print nothing but errors (the user reads one run's console)."""
    saved = console.quiet
    console.quiet = not is_main or saved
    try:
        yield
    finally:
        console.quiet = saved


def error(message: str) -> None:
    """One line on stderr, no traceback. The message is plain text, never markup: errors quote
    paths, library messages such as gloo's "[/path/pair.cc:545] Connection closed" and fixes
    such as pip install 'ampsweep[cluster]'."""
    errors.print(f"[bold red]error:[/] {escape(message)}", markup=True)


def note(message: str) -> None:
    """A remark on stderr that does not change the outcome (plain text, as for error)."""
    errors.print(f"[dim]note:[/] {escape(message)}", markup=True)


def progress_bar(wanted: bool):
    """A progress bar when wanted and the console is a terminal, else one that shows nothing
    (a bar redrawn into a log file is noise)."""
    from ampsweep.engine.loop import NoProgress

    return EpochProgress() if wanted and sys.stdout.isatty() else NoProgress()


class EpochProgress:
    """One bar per epoch: steps done, the latest loss, step time and loss scale, the time
    spent and left. (The job's and the sweep's time left are printed once, after the first
    timed steps: ``runner.estimate``.)"""

    def __init__(self) -> None:
        self._progress: Progress | None = None
        self._task: TaskID | None = None  # the epoch's bar, with _progress
        self._offset = 0

    def start_epoch(self, epoch: int, epochs: int, steps: int) -> None:
        self._progress = Progress(
            TextColumn(f"epoch {epoch + 1}/{epochs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),  # this epoch's, at the steps' pace so far
            console=console,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=steps, info="")
        self._offset = epoch * steps

    def update(self, step: int, metrics: dict, step_ms: float | None) -> None:
        if not self._progress or self._task is None:
            return
        info = f"loss {metrics['train/loss']:.4f}"
        if step_ms is not None:
            info += f"  {step_ms:.1f} ms/step"
        if "amp/loss_scale" in metrics:
            info += f"  scale {metrics['amp/loss_scale']:g}"
        self._progress.update(self._task, completed=step - self._offset, info=info)

    def end_epoch(self) -> None:
        if self._progress:
            self._progress.stop()
            self._progress = None


def _fmt(value, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return format(value, spec)


def print_summary(title: str, summary: dict, where: str | None) -> None:
    table = Table(title=title, show_header=False, title_justify="left", box=None)
    table.add_column(style="bold")
    table.add_column()
    rows = []
    for key in (k for k in summary if k.startswith("val/") and k != "val/loss"):  # the score
        known = score.KNOWN.get(key)
        label = known.label if known else key.split("/", 1)[1]
        spec = ".4f" if key == score.ACCURACY.name else ".3f"
        rows.append((f"validation {label}", _fmt(summary[key], spec)))
        if key == score.PERPLEXITY.name and "data/unigram_perplexity" in summary:
            # a language model: beside the floor of the same text
            rows.append(("unigram baseline", _fmt(summary["data/unigram_perplexity"], ".3f")))
    rows += [
        ("validation loss", _fmt(summary.get("val/loss"))),
        ("samples/s", _fmt(summary.get("perf/samples_per_s"), ".1f")),
        *(
            [("tokens/s", _fmt(summary["perf/tokens_per_s"], ",.0f"))]
            if "perf/tokens_per_s" in summary
            else []
        ),
        ("step time (median)", _fmt(summary.get("perf/step_time_ms"), ".2f") + " ms"),
        ("activation memory", _fmt(summary.get("mem/activation_mib"), ".2f") + " MiB"),
        ("per sample", _fmt(summary.get("mem/activation_bytes_per_sample"), ",.0f") + " bytes"),
        ("model memory", _fmt(summary.get("mem/model_mib"), ".2f") + " MiB (batch-independent)"),
        ("peak RSS", _fmt(summary.get("mem/peak_rss_mib"), ".0f") + " MiB"),
    ]
    if "mem/peak_allocated_mib" in summary:
        rows.append(
            ("peak CUDA allocated", _fmt(summary["mem/peak_allocated_mib"], ".0f") + " MiB")
        )
        rows.append(("peak CUDA reserved", _fmt(summary["mem/peak_reserved_mib"], ".0f") + " MiB"))
    if "mem/max_batch_predicted" in summary:
        gib = summary.get("mem/budget_gib", float("nan"))
        rows.append(
            (
                "largest batch",
                f"{summary['mem/max_batch_predicted']:,.0f} (predicted, {gib:.0f} GiB)",
            )
        )
    if "fp8/flop_share" in summary:
        rows.append(("fp8 FLOPs", _fmt(summary["fp8/flop_share"], ".0%") + " in converted layers"))
    rows.append(("skipped steps", _fmt(summary.get("amp/skipped_steps"), ".0f")))
    if "amp/loss_scale" in summary:
        rows.append(("final loss scale", _fmt(summary["amp/loss_scale"], "g")))
    rows.append(("wall time", _fmt(summary.get("perf/wall_s"), ".1f") + " s"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if where:
        console.print(f"recorded in {where}")
