"""The precision comparison report of a sweep: one row per child run, and findings in words.

Reading the store (``load_sweep``) is kept apart from the arithmetic (``compute_rows``,
``findings``), which are pure functions of plain run data so tests can check them on known
numbers. The baseline of a run is the run of the baseline mode (fp32 unless ``--baseline``)
in the same sweep whose config differs from it only in ``precision.*``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, field

FINISHED = "FINISHED"
ACC_TOLERANCE = 0.015  # accuracy "held" within 1.5 points of the baseline (issue 2's target)
HISTORY_KEYS = ("val/loss", "amp/loss_scale")  # step-wise metrics the charts draw
OPTIONAL_PREFIXES = ("amp/grad_",)  # e.g. amp/grad_underflow_frac: columns only when logged


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
        return self.tags.get("precision") or self.params.get("precision.name", "?")


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
    samples_per_s: float | None = None
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
        """``speedup/<mode>``, ``acc_delta/<mode>``, ``activation_ratio/<mode>`` (and
        ``peak_ratio``) per compared run; the run name replaces the mode when a mode repeats."""
        counts: dict[str, int] = {}
        for r in self.rows:
            counts[r.precision] = counts.get(r.precision, 0) + 1
        out = {}
        for r in self.rows:
            key = r.precision if counts[r.precision] == 1 else r.name
            for name, value in (
                ("speedup", r.speedup),
                ("acc_delta", r.acc_delta),
                ("activation_ratio", r.activation_ratio),
                ("peak_ratio", r.peak_ratio),
            ):
                if is_number(value):
                    out[f"{name}/{key}"] = value
        return out


# ---------------------------------------------------------------- arithmetic


def is_number(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if is_number(value) and is_number(base) and base > 0 else None


def config_key(params: dict[str, str]) -> tuple:
    """A run's config apart from its precision: runs with equal keys are comparable."""
    return tuple(sorted((k, v) for k, v in params.items() if not k.startswith("precision.")))


def find_baseline(run: RunData, runs: list[RunData], mode: str) -> RunData | None:
    key = config_key(run.params)
    for other in runs:
        if other.precision == mode and other.status == FINISHED and config_key(other.params) == key:
            return other
    return None


def compute_rows(runs: list[RunData], baseline_mode: str = "fp32") -> list[Row]:
    rows = []
    for run in runs:
        m = run.metrics
        row = Row(
            run_id=run.run_id,
            name=run.name,
            precision=run.precision,
            model=run.tags.get("model") or run.params.get("model.name", "?"),
            dataset=run.tags.get("dataset") or run.params.get("dataset.name", "?"),
            status=run.status,
            job=run.tags.get("job_num"),
            val_acc=m.get("val/acc"),
            samples_per_s=m.get("perf/samples_per_s"),
            activation_mib=m.get("mem/activation_mib"),
            peak_mib=m.get("mem/peak_allocated_mib"),
            skipped_steps=m.get("amp/skipped_steps"),
            loss_scale=m.get("amp/loss_scale"),
            extra={k: v for k, v in sorted(m.items()) if k.startswith(OPTIONAL_PREFIXES)},
            error=run.tags.get("error", ""),
        )
        base = find_baseline(run, runs, baseline_mode)
        if base is None:
            same_mode = any(r.precision == baseline_mode for r in runs)
            row.note = (
                f"no {baseline_mode} run of the same config"
                if same_mode
                else f"no {baseline_mode} run in this sweep"
            )
        elif run.status == FINISHED:
            b = base.metrics
            row.baseline, row.baseline_run_id = base.name, base.run_id
            if is_number(row.val_acc) and is_number(b.get("val/acc")):
                row.acc_delta = row.val_acc - b["val/acc"]
            row.speedup = ratio(row.samples_per_s, b.get("perf/samples_per_s"))
            row.activation_ratio = ratio(row.activation_mib, b.get("mem/activation_mib"))
            row.peak_ratio = ratio(row.peak_mib, b.get("mem/peak_allocated_mib"))
        rows.append(row)
    return rows


# ---------------------------------------------------------------- findings


def describe_device(tags: dict[str, str]) -> str:
    kind = tags.get("device", "unknown device")
    name = tags.get("device_name", "")
    extra = []
    if kind == "cuda" and tags.get("compute_capability"):
        extra.append(f"compute capability {tags['compute_capability']}")
    if kind == "cpu" and tags.get("cpu_threads"):
        extra.append(f"{tags['cpu_threads']} threads")
    if tags.get("torch_version"):
        extra.append(f"torch {tags['torch_version']}")
    if tags.get("cuda_version"):
        extra.append(f"CUDA {tags['cuda_version']}")
    inner = ", ".join(x for x in [name, *extra] if x)
    return f"{kind} ({inner})" if inner else kind


def _capability(tags: dict[str, str]) -> float | None:
    try:
        return float(tags["compute_capability"])
    except (KeyError, ValueError):
        return None


def _pts(delta: float) -> str:
    return f"{delta * 100:+.1f} points"


def findings(rows: list[Row], device: dict[str, str], baseline_mode: str = "fp32") -> list[str]:
    """Plain-language conclusions, each with the numbers behind it."""
    out = [f"Device: {describe_device(device)}."]
    done = [r for r in rows if r.status == FINISHED]
    compared = [r for r in done if r.baseline]
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in compared:
        groups.setdefault((r.model, r.dataset), []).append(r)
    for (model, dataset), group in groups.items():
        where = f" ({model} on {dataset})" if len(groups) > 1 else ""
        out.extend(_group_findings(group, baseline_mode, where))
    out.extend(_noscale_findings(done, baseline_mode))
    out.extend(_underflow_findings(done))
    out.extend(_hardware_findings(compared, device, baseline_mode))
    missing = [r for r in done if not r.baseline]
    if missing:
        names = ", ".join(r.name for r in missing)
        out.append(
            f"No {baseline_mode} baseline for {len(missing)} run(s) ({names}): their config "
            "differs from every baseline run beyond precision, so their comparisons are blank."
        )
    for r in rows:
        if r.status != FINISHED:
            out.append(f"{r.name} ended {r.status}: {r.error or 'no error recorded'}.")
    return out


def _group_findings(group: list[Row], base: str, where: str) -> list[str]:
    out = []
    timed = [r for r in group if is_number(r.speedup)]
    if timed:
        best = max(timed, key=lambda r: r.speedup)
        if best.precision == base or best.speedup <= 1.0:
            others = [r for r in timed if r is not best]
            slower = ", ".join(f"{r.precision} {r.speedup:.2f}x" for r in others)
            out.append(
                f"Fastest here{where}: {best.precision} at {best.samples_per_s:,.0f} samples/s; "
                f"every other mode is slower (throughput relative to {base}: {slower})."
            )
        else:
            out.append(
                f"Fastest here{where}: {best.precision}, {best.speedup:.2f}x the {base} "
                f"throughput ({best.samples_per_s:,.0f} samples/s)."
            )
    act = [r for r in group if is_number(r.activation_ratio) and r.precision != base]
    if act:
        best = min(act, key=lambda r: r.activation_ratio)
        saved = (1 - best.activation_ratio) * 100
        base_mib = best.activation_mib / best.activation_ratio
        if best.activation_ratio < 1.0:
            out.append(
                f"Most activation memory saved{where}: {best.precision}, "
                f"{best.activation_mib:.2f} MiB per step vs {base_mib:.2f} MiB for {base} "
                f"({best.activation_ratio:.2f}x, {saved:.0f}% less)."
            )
        else:
            # Autocast saves half-precision copies of the weights for backward; on a model
            # whose activations are small next to its weights, those copies dominate.
            out.append(
                f"No mode saved activation memory{where}: the least is {best.precision} with "
                f"{best.activation_mib:.2f} MiB per step vs {base_mib:.2f} MiB for {base} "
                f"({best.activation_ratio:.2f}x). Autocast keeps half-precision copies of the "
                "weights for backward, which outweigh the activations on a model this small."
            )
    peak = [r for r in group if is_number(r.peak_ratio) and r.precision != base]
    if peak:
        best = min(peak, key=lambda r: r.peak_ratio)
        out.append(
            f"Lowest peak GPU memory{where}: {best.precision}, {best.peak_mib:,.0f} MiB "
            f"({best.peak_ratio:.2f}x {base})."
        )
    accs = [r for r in group if is_number(r.acc_delta) and r.precision != base]
    if accs:
        base_acc = accs[0].val_acc - accs[0].acc_delta
        held = [r for r in accs if abs(r.acc_delta) <= ACC_TOLERANCE]
        lost = [r for r in accs if r.acc_delta < -ACC_TOLERANCE]
        gained = [r for r in accs if r.acc_delta > ACC_TOLERANCE]
        if held:
            listing = ", ".join(f"{r.precision} {r.val_acc:.3f}" for r in held)
            out.append(
                f"Accuracy held{where} within {ACC_TOLERANCE * 100:.1f} points of {base}'s "
                f"{base_acc:.3f}: {listing}."
            )
        for r in lost:
            out.append(
                f"Accuracy dropped{where} for {r.precision}: {r.val_acc:.3f} "
                f"({_pts(r.acc_delta)} vs {base})."
            )
        for r in gained:
            out.append(
                f"Accuracy rose{where} for {r.precision}: {r.val_acc:.3f} "
                f"({_pts(r.acc_delta)} vs {base}; at this run length that is noise, not a gain)."
            )
    return out


def _noscale_findings(done: list[Row], base: str) -> list[str]:
    out = []
    for r in done:
        if r.precision != "fp16_noscale":
            continue
        acc = f"reached {r.val_acc:.3f}" if is_number(r.val_acc) else "has no accuracy"
        delta = f" ({_pts(r.acc_delta)} vs {base})" if is_number(r.acc_delta) else ""
        text = (
            f"fp16 without loss scaling (fp16_noscale) {acc}{delta}. With no scaler no step is "
            "checked or skipped: gradients too small for fp16 silently become zero"
        )
        under = {k: v for k, v in r.extra.items() if "underflow" in k}
        if under:
            text += " (" + ", ".join(f"{k} {v:.3g}" for k, v in under.items()) + ")"
        scaled = [x for x in done if x.precision in ("fp16", "fp16_static") and x.model == r.model]
        if scaled:
            parts = [
                f"{x.precision} skipped {x.skipped_steps or 0:.0f} step(s), final scale "
                f"{x.loss_scale:g}"
                for x in scaled
                if is_number(x.loss_scale)
            ]
            if parts:
                text += "; with scaling, " + "; ".join(parts)
        out.append(text + ".")
    return out


def _underflow_findings(done: list[Row]) -> list[str]:
    """What the gradient-underflow diagnostics measured (runs with diagnostics.every > 0):
    how much of the gradient fp16 without scaling loses on this model, what the scaler keeps."""
    from ampsweep.diagnostics import finding

    groups: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
    for r in done:
        if r.extra:
            metrics = {**r.extra, "val/acc": r.val_acc if is_number(r.val_acc) else float("nan")}
            if is_number(r.loss_scale):
                metrics["amp/loss_scale"] = r.loss_scale
            groups.setdefault((r.model, r.dataset), {})[r.precision] = metrics
    out = []
    for (model, dataset), runs in groups.items():
        text = finding(runs)
        if text:
            out.append(
                f"Gradient underflow{f' ({model} on {dataset})' if len(groups) > 1 else ''}: {text}"
            )
    return out


def _hardware_findings(compared: list[Row], device: dict[str, str], base: str) -> list[str]:
    half = [
        r for r in compared if r.precision not in (base, "fp32", "tf32") and is_number(r.speedup)
    ]
    rel = ", ".join(f"{r.precision} {r.speedup:.2f}x" for r in half)
    rel = f" ({rel})" if rel else ""
    kind = device.get("device")
    if kind == "cpu":
        isa = [f for f in device.get("cpu_half_isa", "none").split(",") if f and f != "none"]
        has = (
            ("native half-precision instructions " + ", ".join(isa))
            if isa
            else ("no native fp16/bf16 arithmetic")
        )
        return [
            f"This CPU has no tensor cores and {has}, so its timings of half precision{rel} "
            "say little about a GPU: the speed-ups of mixed precision belong to GPUs with "
            "tensor cores. What carries over from a CPU run is the activation memory saved and "
            "whether accuracy held."
        ]
    cap = _capability(device)
    if kind == "cuda" and cap is not None and cap < 7.0:
        return [
            f"This GPU (compute capability {cap}) has no tensor cores, so half precision mostly "
            f"saves memory and bandwidth here{rel}; tensor-core GPUs (7.0+) gain more speed."
        ]
    if (
        kind == "cuda"
        and cap is not None
        and cap < 8.0
        and any("bf16" in r.precision for r in half)
    ):
        return [f"This GPU (compute capability {cap}) has no native bf16: bf16 modes are emulated."]
    return []


# ---------------------------------------------------------------- formats

COLUMNS = [  # (key, header, format)
    ("precision", "mode", "s"),
    ("model", "model", "s"),
    ("dataset", "data", "s"),
    ("status", "status", "s"),
    ("val_acc", "val acc", ".4f"),
    ("acc_delta", "Δacc pt", "pt"),
    ("samples_per_s", "samples/s", ",.0f"),
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
    a scaler ran, and each optional ``amp/grad_*`` metric that some run logged."""
    rows = report.rows
    cols = [
        c
        for c in COLUMNS
        if c[0] not in ("peak_mib", "peak_ratio", "loss_scale")
        or any(is_number(getattr(r, c[0])) for r in rows)
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


# ---------------------------------------------------------------- the store


class ReportError(Exception):
    """The report cannot be made (no store, no sweep, unknown run): one line with the fix."""


def find_sweep(client, sweep: str = "latest", experiment: str | None = None):
    """The parent run of a sweep: ``latest`` (newest sweep, in ``experiment`` or in any
    experiment), or a run id."""
    if sweep != "latest":
        try:
            return client.get_run(sweep)
        except Exception:
            raise ReportError(
                f"--sweep {sweep}: no such run in this store: pass a sweep's parent run id "
                "(see `ampsweep ui`), or --sweep latest"
            ) from None
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise ReportError(f"--experiment {experiment}: no such experiment in this store")
        ids = [exp.experiment_id]
    else:
        ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(
        ids,
        filter_string="tags.`ampsweep.sweep` = 'true'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    ) if ids else []  # fmt: skip
    if not runs:
        where = f"experiment {experiment}" if experiment else "this store"
        raise ReportError(
            f"no sweep in {where}: run one first, e.g. ampsweep train -m experiment=precision_sweep"
        )
    return runs[0]


def load_sweep(client, parent) -> tuple[dict[str, str], list[RunData]]:
    from ampsweep.tracking import PARENT_TAG

    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=10000,
    )
    if not runs:
        raise ReportError(
            f"--sweep {parent.info.run_id}: run {parent.info.run_name} has no child runs: "
            "it is not a sweep's parent run"
        )
    data = []
    for r in runs:
        history = {
            key: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, key)]
            for key in HISTORY_KEYS
            if key in r.data.metrics
        }
        data.append(
            RunData(
                run_id=r.info.run_id,
                name=r.info.run_name,
                status=r.info.status,
                params=dict(r.data.params),
                tags=dict(r.data.tags),
                metrics=dict(r.data.metrics),
                history=history,
            )
        )
    # Jobs are numbered by Hydra; order rows that way (start times tie in parallel launchers).
    data.sort(key=lambda d: int(d.tags.get("job_num", "0") or 0))
    t = parent.data.tags
    sweep = {
        "run_id": parent.info.run_id,
        "name": parent.info.run_name,
        "experiment_id": parent.info.experiment_id,
        "sweep_dir": t.get("sweep_dir", ""),
        "command": t.get("command", ""),
    }
    return sweep, data


def make_report(sweep: dict, runs: list[RunData], baseline_mode: str = "fp32") -> Report:
    rows = compute_rows(runs, baseline_mode)
    finished = [r for r in runs if r.status == FINISHED and r.tags.get("device")]
    source = (finished or [r for r in runs if r.tags.get("device")] or runs)[0].tags
    device = {
        k: source[k]
        for k in ("device", "device_name", "compute_capability", "cpu_threads", "cpu_half_isa",
                  "torch_version", "cuda_version")
        if k in source
    }  # fmt: skip
    return Report(sweep, device, baseline_mode, rows, findings(rows, device, baseline_mode), runs)


def build_report(client, parent_run_id: str, baseline_mode: str = "fp32") -> Report:
    parent = find_sweep(client, parent_run_id)
    sweep, runs = load_sweep(client, parent)
    return make_report(sweep, runs, baseline_mode)


def publish(client, report: Report) -> None:
    """Log the report to the sweep's parent run: report.md/.csv/.json, the charts under
    charts/, and the headline numbers as parent metrics."""
    import tempfile
    import time
    from pathlib import Path

    from mlflow.entities import Metric

    from ampsweep import charts

    run_id = report.sweep["run_id"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "report.md").write_text(to_markdown(report))
        (folder / "report.csv").write_text(to_csv(report))
        (folder / "report.json").write_text(to_json(report))
        charts.write_charts(report, folder / "charts")
        client.log_artifacts(run_id, str(folder))
    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, 0) for k, v in report.headline_metrics().items()]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[i : i + 1000])
