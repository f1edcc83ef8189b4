"""report/charts.py: the sweep's charts written as PNG files, one per measure it has."""

from __future__ import annotations

from ampsweep.report import sweeps
from unit.report.test_rows import run


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
