"""The report as a console table, Markdown, CSV and JSON."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict

from ampsweep.report.model import Report, Row, is_number

COLUMNS = [  # (key, header, format)
    ("precision", "mode", "s"),
    ("model", "model", "s"),
    ("dataset", "data", "s"),
    ("status", "status", "s"),
    ("val_acc", "val acc", ".4f"),
    ("acc_delta", "Δacc pt", "pt"),
    ("val_ppl", "val ppl", ".3f"),
    ("ppl_ratio", "ppl ratio", "x"),
    ("samples_per_s", "samples/s", ",.0f"),
    ("tokens_per_s", "tokens/s", ",.0f"),
    ("speedup", "speed-up", "x"),
    ("activation_mib", "act MiB", ".3f"),
    ("activation_ratio", "act ratio", "x"),
    ("peak_mib", "peak MiB", ",.0f"),
    ("peak_ratio", "peak ratio", "x"),
    ("skipped_steps", "skipped", ".0f"),
    ("loss_scale", "loss scale", "g"),
]


def _cell(value, fmt: str) -> str:
    if fmt == "s":
        return str(value) if value is not None else ""
    if not is_number(value):
        return "-"
    if fmt == "x":
        return f"{value:.2f}x"
    if fmt == "pt":
        return f"{value * 100:+.1f}"
    return format(value, fmt)


def columns(report: Report) -> list[tuple[str, str, str]]:
    """The columns worth showing: peak memory only when measured (CUDA), loss scale only when
    a scaler ran, accuracy or perplexity (and tokens/s) as the runs logged them, and each
    optional ``amp/grad_*`` metric that some run logged."""
    rows = report.rows
    optional = ("peak_mib", "peak_ratio", "loss_scale", "val_ppl", "ppl_ratio", "tokens_per_s")
    if not any(is_number(r.val_acc) for r in rows) and any(is_number(r.val_ppl) for r in rows):
        optional += ("val_acc", "acc_delta")  # a language model's sweep: perplexity instead
    cols = [
        c for c in COLUMNS if c[0] not in optional or any(is_number(getattr(r, c[0])) for r in rows)
    ]
    extras = sorted({k for r in rows for k in r.extra})
    cols += [(f"extra:{k}", k.split("/", 1)[-1], ".3g") for k in extras]
    return cols


def _value(row: Row, key: str):
    return row.extra.get(key[6:]) if key.startswith("extra:") else getattr(row, key)


def _baseline_cell(r: Row) -> str:
    if r.baseline_run_id == r.run_id:
        return "(the baseline)"
    return r.baseline or r.note or ""


# At the console only the headline diagnostics fit; the files carry every column.
CONSOLE_EXTRAS = ("amp/grad_underflow_frac", "amp/grad_flushed_frac")


def table_cells(report: Report, compact: bool = False) -> tuple[list[str], list[list[str]]]:
    cols = columns(report)
    if compact:
        cols = [c for c in cols if not c[0].startswith("extra:") or c[0][6:] in CONSOLE_EXTRAS]
    headers = [h for _, h, _ in cols] + ["baseline"]
    body = [[_cell(_value(r, k), f) for k, _, f in cols] + [_baseline_cell(r)] for r in report.rows]
    return headers, body


def _title(report: Report) -> str:
    return (
        f"Sweep {report.sweep.get('name', '')} ({report.sweep.get('run_id', '')}): "
        f"{len(report.rows)} runs vs {report.baseline_mode}"
    )


def to_markdown(report: Report) -> str:
    headers, body = table_cells(report)
    lines = [f"# {_title(report)}", ""]
    if report.sweep.get("command"):
        lines += [f"Command: `{report.sweep['command']}`", ""]
    lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body]
    lines += ["", "## Findings", ""] + [f"- {f}" for f in report.findings]
    return "\n".join(lines) + "\n"


def to_csv(report: Report) -> str:
    """Every field of every row, unformatted (speed-up 1.5, not 1.50x)."""
    buf = io.StringIO()
    extras = sorted({k for r in report.rows for k in r.extra})
    fields = [k for k in Row.__dataclass_fields__ if k != "extra"]
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(fields + extras)
    for r in report.rows:
        d = asdict(r)
        writer.writerow(
            ["" if d[k] is None else d[k] for k in fields] + [r.extra.get(k, "") for k in extras]
        )
    return buf.getvalue()


def to_json(report: Report) -> str:
    obj = {
        "sweep": report.sweep,
        "device": report.device,
        "baseline_mode": report.baseline_mode,
        "rows": [asdict(r) for r in report.rows],
        "findings": report.findings,
        "headline": report.headline_metrics(),
    }
    return json.dumps(obj, indent=2, default=str)


def print_table(report: Report) -> None:
    """The report at the console: a table, then the findings."""
    import sys

    from rich import box
    from rich.console import Console
    from rich.table import Table

    # Piped output (CI logs, demo transcripts) gets a wide table instead of 80-column wrapping.
    con = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    headers, body = table_cells(report, compact=True)
    table = Table(title=_title(report), title_justify="left", box=box.SIMPLE_HEAD)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i < 4 or i == len(headers) - 1 else "right")
    for row in body:
        table.add_row(*row)
    con.print(table)
    con.print("[bold]Findings[/]")
    for f in report.findings:
        con.print(f"  - {f}", soft_wrap=True)


def render(report: Report, fmt: str) -> str | None:
    """The report as text in ``fmt`` (``table`` prints directly and returns None)."""
    if fmt == "table":
        print_table(report)
        return None
    return {"markdown": to_markdown, "csv": to_csv, "json": to_json}[fmt](report)
