#!/usr/bin/env python
"""Print the latest sweep of an MLflow experiment as a table: one row per child run.

  python scripts/sweep_table.py --experiment gpu_check
  python scripts/sweep_table.py --experiment gpu_bench_resnet50 --speedup fp32 --speedup tf32

Used by scripts/gpu_check.sh and scripts/gpu_bench.sh (the speed columns, MFU included, and
the speed-ups the issue's targets are stated in). Reads the store from --tracking-uri, else
$MLFLOW_TRACKING_URI, else outputs/mlflow.db in the current folder.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from ampsweep import tracking  # noqa: E402

COLUMNS = [
    ("samples/s", "perf/samples_per_s", "{:.1f}"),
    ("step ms", "perf/step_time_ms", "{:.2f}"),
    ("TFLOPS", "perf/tflops", "{:.2f}"),
    ("MFU", "perf/mfu", "{:.1%}"),
    ("peak alloc MiB", "mem/peak_allocated_mib", "{:.0f}"),
    ("act MiB", "mem/activation_mib", "{:.1f}"),
    ("val/acc", "val/acc", "{:.4f}"),
    ("skipped", "amp/skipped_steps", "{:.0f}"),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--experiment", required=True)
    p.add_argument("--tracking-uri")
    p.add_argument(
        "--speedup", action="append", default=[], help="print samples/s relative to this mode"
    )
    args = p.parse_args()
    from mlflow import MlflowClient

    client = MlflowClient(tracking.resolve_uri(args.tracking_uri))
    exp = client.get_experiment_by_name(args.experiment)
    parents = []
    if exp is not None:
        parents = client.search_runs(
            [exp.experiment_id],
            filter_string="tags.`ampsweep.sweep` = 'true'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
    if parents:
        parent = parents[0]
        children = client.search_runs(
            [exp.experiment_id],
            filter_string=f"tags.`{tracking.PARENT_TAG}` = '{parent.info.run_id}'",
            order_by=["attributes.start_time ASC"],
        )
        print(f"sweep {parent.info.run_name} ({parent.info.run_id}): {len(children)} runs")
    else:  # no parent run: the jobs of the latest sweep folder (run_dir = <sweep dir>/<job>)
        runs = [] if exp is None else client.search_runs([exp.experiment_id])
        jobs = [r for r in runs if "job_num" in r.data.tags and "run_dir" in r.data.tags]
        if not jobs:
            print(f"no sweep found in experiment {args.experiment!r}", file=sys.stderr)
            return 1
        latest = max(jobs, key=lambda r: r.info.start_time)
        folder = str(Path(latest.data.tags["run_dir"]).parent)
        children = [r for r in jobs if str(Path(r.data.tags["run_dir"]).parent) == folder]
        children.sort(key=lambda r: r.info.start_time)
        print(f"sweep folder {folder}: {len(children)} runs")
    rows = []
    for run in children:
        m, tags = run.data.metrics, run.data.tags
        compiled = run.data.params.get("trainer.compile", "?")
        label = f"{tags.get('precision', '?')}{' +compile' if compiled == 'True' else ''}"
        cells = [label, tags.get("device_name", "?")[:24], run.info.status]
        for _, key, fmt in COLUMNS:
            value = m.get(key)
            cells.append("-" if value is None or math.isnan(value) else fmt.format(value))
        rows.append((cells, tags.get("precision"), compiled, m.get("perf/samples_per_s")))
    header = ["mode", "device", "status", *[c[0] for c in COLUMNS]]
    widths = [max(len(h), *(len(r[0][i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for cells, *_ in rows:
        print("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    for base in args.speedup:
        for compiled in sorted({r[2] for r in rows}):
            ref = next((r[3] for r in rows if r[1] == base and r[2] == compiled), None)
            if not ref:
                continue
            ratios = [
                f"{r[1]} {r[3] / ref:.2f}x" for r in rows if r[2] == compiled and r[3] and r[1]
            ]
            print(f"samples/s vs {base} (compile={compiled}): " + ", ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
