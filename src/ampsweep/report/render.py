"""The report as a console table, Markdown, CSV and JSON.

The console table fits 100 columns: the columns a reader needs to decide (mode, accuracy and
its change, throughput and speed-up, memory saved, MFU on a GPU, the largest batch, what the
loss scaler did), the least needed left out first when they do not fit. With repeated seeds it
has a row per configuration and mode, each cell a mean and its 95% interval (``±`` half its
width; a ratio's as a range).
``--wide`` shows every column; the Markdown, CSV and JSON files always carry everything, and
every run.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import quote

from ampsweep.config.score import OWN_COLUMNS
from ampsweep.report import memory, stats
from ampsweep.report.model import Report, Row, is_number, ratio_range

CONSOLE_WIDTH = 100


@dataclass(frozen=True)
class Column:
    key: str  # a Row attribute, or "extra:<metric>"
    header: str
    fmt: str  # "s" text, "t" text among numbers, "x" ratio, "pt" points, "pct" percent, else a
    # format spec
    console: bool = True  # in the default console table (else only with --wide and in files)
    # "always" | "numbers" (some row has one) | "text" | "differs" | "repeats" (some row
    # summarises repeated runs)
    when: str = "always"
    drop: int = 0  # when the console table is too wide, the highest is left out first (0: never)


COLUMNS = [
    Column("precision", "mode", "s"),
    Column("config", "config", "s", when="text"),
    Column("model", "model", "s", when="differs"),
    Column("dataset", "data", "s", when="differs"),
    Column("shown_status", "status", "s", when="differs"),
    Column("n", "runs", "d", when="repeats", drop=7),
    # accuracy for classifiers, perplexity for language models: as the runs logged them
    Column("val_acc", "val acc", ".4f", when="numbers"),
    Column("acc_delta", "Δacc pt", "pt", when="numbers"),
    Column("val_ppl", "val ppl", ".3f", when="numbers"),
    Column("ppl_ratio", "ppl ratio", "x", when="numbers"),
    # another task's score (headers and units its own: ``_score_columns``)
    Column("quality", "score", ".4g", when="other score"),
    Column("quality_change", "Δscore", "+.3g", when="other score"),
    Column("samples_per_s", "samples/s", ",.0f", drop=5),
    Column("tokens_per_s", "tokens/s", ",.0f", when="numbers", drop=4),
    Column("speedup", "speed-up", "x"),
    Column("timing", "timing", "t", when="text"),  # contended: no speed verdict (never dropped)
    Column("to_target", "to target", "t", when="text", drop=4),  # time to quality
    Column("target_steps", "steps to target", ",.0f", console=False, when="numbers"),
    Column("step_ms", "step ms", ".2f", console=False),
    Column("tflops", "TFLOPS", ".3g", console=False, when="numbers"),
    Column("mfu", "MFU", "pct", when="numbers", drop=4),
    Column("activation_mib", "act MiB", ".3f", console=False),
    Column("activation_ratio", "act mem", "x"),
    Column("peak_mib", "peak MiB", ",.0f", console=False, when="numbers"),
    Column("peak_ratio", "peak mem", "x", when="numbers", drop=2),
    # only there when asked for (report --memory-budget), so never dropped to fit the console
    Column("max_batch", "max batch", ",.0f", when="numbers"),
    Column("max_batch_ratio", "batch x", "x", console=False, when="numbers"),
    Column("bytes_per_sample", "B/sample", ",.0f", console=False, when="numbers"),
    Column("model_mib", "model MiB", ".3g", console=False, when="numbers"),
    Column("fp8_flop_share", "fp8 FLOPs", "pct", console=False, when="numbers"),
    Column("scaler_skips", "skipped", ".0f", console=True, when="numbers", drop=6),
    Column("skipped_steps", "skipped", ".0f", console=False),
    Column("loss_scale", "scale", "g", when="numbers", drop=8),
]


def _number(value, fmt: str) -> str:
    if fmt == "x":
        return f"{value:.2f}x"
    if fmt == "pt":
        return f"{value * 100:+.1f}"
    if fmt == "pct":
        return f"{value:.1%}"
    return format(value, fmt)


def _spread(half: float, fmt: str) -> str:
    """The ``±`` part of a cell: the half-width of the 95% interval in the value's unit."""
    if fmt == "pt":
        return f"±{half * 100:.1f}"
    if fmt == "pct":
        return f"±{half * 100:.1f}"
    return "±" + format(half, fmt.lstrip("+"))


def _cell(value, fmt: str, est=None) -> str:
    """A table cell: the value, and its interval over repeats: a ratio's as a range (taken on
    the log scale, it is not symmetric), a count's or share's as ``±`` half its width, or as a
    range where the interval was cut at its quantity's bounds (no throughput is negative, no
    accuracy above 1)."""
    if fmt in ("s", "t"):
        return str(value) if value is not None else ""
    if not is_number(value):
        return "-"
    if est is None or not est.has_interval:
        return _number(value, fmt)
    if fmt == "x":
        return ratio_range(value, est)
    if fmt == ".4f":  # an accuracy with its interval: three decimals say enough
        fmt = ".3f"
    spread = _spread(est.half_width, fmt)
    if not any(ch in "123456789" for ch in spread):  # the same in every run (at this precision)
        return _number(value, fmt)
    if fmt != "pt" and not math.isclose(value - est.low, est.high - value, abs_tol=1e-12):
        # cut at the range the quantity cannot leave (stats.mean_interval's bounds): a ``±``
        # would claim the side that was cut
        return f"{_number(value, fmt)} ({_number(est.low, fmt)}-{_number(est.high, fmt)})"
    return f"{_number(value, fmt)} {spread}"


def _value(row: Row, key: str):
    return row.extra.get(key[6:]) if key.startswith("extra:") else getattr(row, key)


def _shown(col: Column, rows: list[Row], wide: bool) -> bool:
    values = [_value(r, col.key) for r in rows]
    if col.when == "numbers":
        return any(is_number(v) for v in values)
    if col.when == "text":
        return any(values)
    if col.when == "differs":  # the console names a shared model and data set in the title
        return wide or len(set(values)) > 1 or "earlier" in values  # reused rows: always said
    if col.when == "repeats":
        return any(r.n > 1 for r in rows)
    if col.when == "other score":
        return any(r.score is not None and r.score.name not in OWN_COLUMNS for r in rows)
    return True


def _score_columns(col: Column, rows: list[Row]) -> Column:
    """A score of another task's columns, named after it: ``val rmse``, ``Δrmse %``."""
    score = next((r.score for r in rows if r.score is not None), None)
    if col.when != "other score" or score is None:
        return col
    if col.key == "quality":
        return replace(col, header=score.short)
    unit = " %" if score.relative else " pt" if score.points else ""
    fmt = "pt" if score.relative or score.points else col.fmt
    return replace(col, header=f"Δ{score.label}{unit}", fmt=fmt)


def columns(report: Report, wide: bool = True, rows: list[Row] | None = None) -> list[Column]:
    """The columns worth showing for ``rows`` (default: the report's summary): in the console
    table (``wide=False``) only those a decision needs; with ``wide``, every measured one and
    each ``amp/grad_*`` metric some run logged."""
    rows = report.summary if rows is None else rows
    cols = [
        _score_columns(c, rows)
        for c in COLUMNS
        if (c.console if not wide else c.key != "scaler_skips") and _shown(c, rows, wide)
    ]
    if wide:
        extras = sorted({k for r in rows for k in r.extra})
        cols += [Column(f"extra:{k}", k.split("/", 1)[-1], ".3g") for k in extras]
    return cols


def _baseline_cell(r: Row) -> str:
    if r.baseline_run_id == r.run_id:
        return "(the baseline)"
    return r.baseline or r.note or ""


def table_cells(
    report: Report, wide: bool = True, rows: list[Row] | None = None, width: int | None = None
) -> tuple[list[str], list[list[str]]]:
    """Headers and cells for ``rows`` (default: the summary: a row per configuration and
    mode). ``width``: leave out droppable columns until the table fits that many characters."""
    rows = report.summary if rows is None else rows
    cols = columns(report, wide, rows)
    while True:
        headers = [c.header for c in cols] + (["baseline"] if wide else [])
        body = []
        for r in rows:
            cells = [_cell(_value(r, c.key), c.fmt, r.ci.get(c.key)) for c in cols]
            body.append(cells + ([_baseline_cell(r)] if wide else []))
        droppable = [c for c in cols if c.drop]
        if width is None or _width(headers, body) <= width or not droppable:
            return headers, body
        cols.remove(max(droppable, key=lambda c: c.drop))


def _width(headers: list[str], body: list[list[str]]) -> int:
    """Characters a table takes at the console in rich's SIMPLE_HEAD box without edge
    padding: its columns, three between each two (padding, separator, padding), an edge either
    side."""
    widths = [max(len(row[i]) for row in [headers, *body]) for i in range(len(headers))]
    return sum(widths) + 3 * (len(widths) - 1) + 2


def title(report: Report) -> str:
    rows = report.rows
    what = ""
    models, data = {r.model for r in rows}, {r.dataset for r in rows}
    if len(models) == 1 and len(data) == 1:
        what = f" of {next(iter(models))} on {next(iter(data))}"
    seeds = {r.n for r in report.summary if r.status == "FINISHED"}
    repeats = ""
    if report.repeated:
        each = f"{seeds.pop()} seeds" if len(seeds) == 1 else "several seeds"
        repeats = f", {each} each (mean and its 95% interval)"
    return (
        f"Sweep {report.sweep.get('name', '')} ({report.sweep.get('run_id', '')}): "
        f"{len(rows)} runs{what} vs {report.baseline_mode}{repeats}"
    )


def _markdown_table(headers: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]


def opening(report: Report) -> list[str]:
    """The report's first lines: the recommendation (or the open question) and its command."""
    rec = report.recommendation
    if rec is None:
        return []
    head = f"Use {rec.mode}" if rec.mode else "Open question"
    return [f"{head}: {rec.reason}", f"Run: {rec.command}"]


def to_markdown(report: Report) -> str:
    lines = [f"# {title(report)}", ""]
    opened, rec = opening(report), report.recommendation
    if opened and rec is not None:
        lines += [f"**{opened[0]}**", "", f"`{rec.command}`", ""]
    if report.sweep.get("command"):
        lines += [f"Command: `{report.sweep['command']}`", ""]
    lines += _markdown_table(*table_cells(report))
    if report.repeated:
        lines += ["", "## Every run", ""]
        lines += _markdown_table(*table_cells(report, rows=report.rows))
    best = stats.lines(report)  # a search's best trial of each mode
    lines += ["", "## Best of each mode", ""] + [f"- {b}" for b in best] if best else []
    if memory.measured_rows(report.summary):
        lines += ["", "## Memory of a training step (MiB)", ""]
        lines += _markdown_table(*memory.table(report.summary))
        lines += [""] + memory.module_lines(report) if memory.module_lines(report) else []
    lines += ["", "## Findings", ""] + [f"- {f}" for f in report.findings]
    return "\n".join(lines) + "\n"


def to_note(report: Report, charts: list[str], limit: int) -> str:
    """The sweep parent's MLflow description (Markdown, at most ``limit`` characters): the
    recommendation and its command, the table, the charts (shown from the run's artifacts by
    the MLflow UI's ``get-artifact`` route) and as many findings as fit; the rest, and every
    run, are in report.md."""
    run_id = report.sweep.get("run_id", "")
    lines = [f"### {title(report)}", ""]
    opened, rec = opening(report), report.recommendation
    if opened and rec is not None:
        lines += [f"**{opened[0]}**", "", f"`{rec.command}`", ""]
    lines += _markdown_table(*table_cells(report)) + [""]
    links = [
        f"![{Path(c).stem}](get-artifact?path={quote(c, safe='')}&run_uuid={run_id})"
        for c in charts
    ]
    lines += [" ".join(links), "", "#### Findings", ""] if links else ["#### Findings", ""]
    tail = "Every run and every finding: the artifact report.md."
    text = "\n".join(lines)
    shown = 0
    for f in report.findings:
        item = f"\n- {f}"
        if len(text) + len(item) + len(tail) + 40 > limit:
            break
        text += item
        shown += 1
    left = len(report.findings) - shown
    more = f"{left} more finding(s) and every run: the artifact report.md." if left else tail
    return f"{text}\n\n{more}\n"[:limit]  # (a table too long for it is cut short)


def to_csv(report: Report) -> str:
    """Every field of every run's row, unformatted (speed-up 1.5, not 1.50x)."""
    buf = io.StringIO()
    extras = sorted({k for r in report.rows for k in r.extra})
    probed = sorted({k for r in report.rows for k in r.probe})  # a column per probe metric
    skip = ("extra", "probe", "ci", "members", "n", "memory")  # memory: the JSON's
    # a precision setting in words, as the config column shows it: master_weights=true
    fields = [k if k != "precision_set" else "settings" for k in Row.__dataclass_fields__]
    fields = [k for k in fields if k not in skip]
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(fields + extras + probed)
    for r in report.rows:
        d = asdict(r)
        d["score"] = r.score.name if r.score is not None else None  # the metric, e.g. val/acc
        d["settings"] = r.settings
        writer.writerow(
            ["" if d[k] is None else d[k] for k in fields]
            + [r.extra.get(k, "") for k in extras]
            + [r.probe.get(k, "") for k in probed]
        )
    return buf.getvalue()


def to_json(report: Report) -> str:
    obj = {
        "sweep": report.sweep,
        "device": report.device,
        "baseline_mode": report.baseline_mode,
        "rows": [asdict(r) for r in report.rows],
        "summary": [asdict(r) for r in report.summary],  # repeats summarised, with intervals
        "recommendation": asdict(report.recommendation) if report.recommendation else None,
        "findings": report.findings,
        "headline": report.headline_metrics(),
    }
    return json.dumps(obj, indent=2, default=str)


def print_table(report: Report, console, wide: bool = False) -> None:
    """The report on a rich ``console``: a table, then the findings (word-wrapped at a
    terminal; one line each in a log file)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    headers, body = table_cells(report, wide, width=None if wide else CONSOLE_WIDTH)
    for line in opening(report):
        console.print(escape(line), style="bold" if line == opening(report)[0] else None)
    console.print(title(report))
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    text_columns = sum(1 for c in columns(report, wide) if c.fmt == "s")
    for i, h in enumerate(headers):
        right = text_columns <= i < len(headers) - (1 if wide else 0)
        table.add_column(h, justify="right" if right else "left", no_wrap=True)
    # Text, not markup: a cell or a finding may hold brackets (precision.keep_fp32=[fc1])
    for row in body:
        table.add_row(*map(escape, row))
    needed = _width(headers, body)
    if wide and needed > console.width:
        # As wide as its columns need: rich would squeeze the table into the console's width,
        # cutting every cell short, and a console never renders wider than itself.
        from rich.console import Console

        Console(file=console.file, width=needed, highlight=False, soft_wrap=True).print(table)
    else:  # the console table was fitted to 100 columns
        console.print(table, width=min(console.width, CONSOLE_WIDTH), crop=False)
    for line in stats.lines(report):  # a search's best trial of each mode
        console.print(escape(line))
    _print_memory(report, console, wide)
    console.print("[bold]Findings[/]")
    if console.soft_wrap:  # not a terminal: one line per finding
        for f in report.findings:
            console.print(f"  - {escape(f)}")
        return
    findings = Table.grid(padding=(0, 1))  # a terminal: wrapped under their own first word
    findings.add_column(no_wrap=True)
    findings.add_column()
    for f in report.findings:
        findings.add_row("  -", escape(f))
    console.print(findings)


def _print_memory(report: Report, console, wide: bool) -> None:
    """The memory section: each mode's step peak and its parts, the baseline's top modules."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    if not memory.measured_rows(report.summary):
        return
    headers, body = memory.table(report.summary)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="right" if i else "left", no_wrap=True)
    for row in body:
        table.add_row(*map(escape, row))
    console.print("[bold]Memory of a training step[/] (MiB)")
    needed = _width(headers, body)
    if (wide or console.soft_wrap) and needed > console.width:
        # a log or --wide: every part in full (a mode's setting widens the first column),
        # where rich would cut each cell short to fit the console
        from rich.console import Console

        Console(file=console.file, width=needed, highlight=False, soft_wrap=True).print(table)
    else:
        console.print(table, crop=False)
    for line in memory.module_lines(report):
        console.print(escape(line))


def render(report: Report, fmt: str, console=None, wide: bool = False) -> str | None:
    """The report as text in ``fmt`` (``table`` prints on ``console`` and returns None)."""
    if fmt == "table":
        print_table(report, console, wide)
        return None
    return {"markdown": to_markdown, "csv": to_csv, "json": to_json}[fmt](report)
