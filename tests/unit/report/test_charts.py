"""report/charts.py: the sweep's charts written as PNG files, one per measure it has."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ampsweep.report import sweeps
from unit.report.test_sweeps import run


def test_charts_are_written_as_png(tmp_path):
    from ampsweep.report import charts

    runs = [
        run("fp32", acc=0.98, sps=1000.0, act=4.0),
        run("fp16", acc=0.97, sps=800.0, act=2.0, scale=1024.0),
    ]
    runs[0].history = {"val/loss": [(10, 1.0), (20, 0.5)]}
    runs[1].history = {"val/loss": [(10, 1.1), (20, 0.6)], "amp/loss_scale": [(5, 2048.0)]}
    made = charts.write_charts(sweeps.make_report({"run_id": "p"}, runs), tmp_path)
    names = sorted(p.name for p in made)
    assert names == [
        "accuracy.png",
        "loss_scale.png",
        "memory.png",
        "throughput.png",
        "val_loss.png",
    ]
    for p in made:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_charts_leave_the_processs_matplotlib_backend_alone(tmp_path):
    """A notebook that reports a sweep keeps its own backend: charts are drawn without pyplot
    (checked in a fresh process, where nothing else imported pyplot first)."""
    code = textwrap.dedent(f"""
        import sys, matplotlib
        from pathlib import Path
        matplotlib.use("svg")
        from ampsweep.report import charts, sweeps
        from unit.report.test_sweeps import run
        runs = [run("fp32", acc=0.9, sps=10.0, act=4.0), run("bf16", acc=0.9, sps=12.0, act=2.0)]
        report = sweeps.make_report({{"run_id": "p"}}, runs)
        made = charts.write_charts(report, Path({str(tmp_path)!r}))
        assert made and matplotlib.get_backend() == "svg", matplotlib.get_backend()
        assert "matplotlib.pyplot" not in sys.modules
    """)
    tests = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def masters_sweep():
    """fp32, bf16_pure, and bf16_pure again with fp32 master weights (run ids apart)."""
    runs = [run(m, acc=0.98, sps=1000.0, act=a) for m, a in (("fp32", 4), ("bf16_pure", 2))]
    runs.append(run("bf16_pure", acc=0.97, sps=900.0, act=2.0))
    runs[2].run_id += "-masters"
    for r in runs:
        r.params["precision.master_weights"] = str(r is runs[2])
    return sweeps.make_report({"run_id": "p"}, runs)


def test_a_chart_labels_a_row_by_its_mode_and_its_precision_setting():
    from ampsweep.report import charts

    rep = masters_sweep()
    labels = [charts._label(r, rep.summary) for r in rep.summary]
    assert labels == ["fp32", "bf16_pure", "bf16_pure (master_weights=true)"]
