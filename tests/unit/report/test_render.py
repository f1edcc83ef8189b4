"""report/render.py: the report as a table, Markdown, CSV and JSON, with the same numbers in
each, and the columns that appear only when a run logged them."""

from __future__ import annotations

import csv
import io
import json

import pytest

from ampsweep.report import render, sweeps
from unit.report.test_sweeps import CUDA, run


def test_formats_carry_the_same_numbers():
    runs = [
        run("fp32", acc=0.98, sps=1000.0, act=4.0),
        run("bf16", acc=0.97, sps=2500.0, act=2.0),
    ]
    rep = sweeps.make_report({"run_id": "p", "name": "sweep-x", "command": "ampsweep train"}, runs)
    obj = json.loads(render.to_json(rep))
    assert obj["rows"][1]["speedup"] == pytest.approx(2.5)
    assert obj["headline"]["activation_ratio/bf16"] == pytest.approx(0.5)
    assert obj["findings"] == rep.findings
    rows = list(csv.DictReader(io.StringIO(render.to_csv(rep))))
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    assert float(rows[1]["speedup"]) == pytest.approx(2.5)
    md = render.to_markdown(rep)
    assert "| bf16 | cnn | digits | FINISHED | 0.9700 | -1.0 | 2,500 | 2.50x |" in md
    assert "## Findings" in md and "Command: `ampsweep train`" in md


def test_the_underflow_column_appears_only_when_a_run_logged_it():
    runs = [
        run("fp32", acc=0.986, sps=5000.0, act=4.62),
        run("fp16_noscale", acc=0.90, sps=1100.0, act=2.58, underflow=0.125),
    ]
    headers, _ = render.table_cells(sweeps.make_report({"run_id": "p", "name": "s"}, runs))
    assert "grad_underflow_frac" in headers
    assert "peak MiB" not in headers  # no CUDA peak on CPU
    plain = [run("fp32", acc=0.986, sps=5000.0), run("bf16", acc=0.98, sps=100.0)]
    headers, _ = render.table_cells(sweeps.make_report({"run_id": "p"}, plain))
    assert "grad_underflow_frac" not in headers


def test_a_gpu_sweep_has_the_peak_memory_column_and_marks_the_baseline():
    runs = [
        run("fp32", device=CUDA, acc=0.95, sps=1000.0, act=40.0, peak=4000.0),
        run("bf16", device=CUDA, acc=0.951, sps=3100.0, act=20.0, peak=2400.0),
    ]
    headers, body = render.table_cells(sweeps.make_report({"run_id": "p"}, runs))
    assert "peak MiB" in headers and "grad_underflow_frac" not in headers
    assert body[0][-1] == "(the baseline)"


def test_the_parent_runs_description_opens_with_the_answer_and_fits_mlflows_limit():
    runs = [
        run("fp32", acc=0.98, sps=1000.0, act=4.0),
        run("bf16", acc=0.97, sps=2500.0, act=2.0),
    ]
    rep = sweeps.make_report(
        {"run_id": "abc", "name": "sweep-x", "command": "ampsweep train"}, runs
    )
    charts = ["charts/throughput.png", "charts/time_to_quality.png"]
    note = render.to_note(rep, charts, 8000)
    lines = note.splitlines()
    assert lines[0] == f"### {render.title(rep)}"
    assert lines[2] == f"**{render.opening(rep)[0]}**" and rep.recommendation.command in lines[4]
    assert "| bf16 |" in note
    assert "![throughput](get-artifact?path=charts%2Fthroughput.png&run_uuid=abc)" in note
    assert all(f"- {f}" in note for f in rep.findings)
    assert note.rstrip().endswith("Every run and every finding: the artifact report.md.")
    short = render.to_note(rep, charts, 1500)
    assert len(short) <= 1500 and "more finding(s) and every run: the artifact report.md" in short


def test_a_precision_setting_is_in_words_in_the_csv_and_by_its_key_in_the_json():
    from unit.report.test_charts import masters_sweep

    rep = masters_sweep()
    rows = list(csv.DictReader(io.StringIO(render.to_csv(rep))))
    assert [r["settings"] for r in rows] == ["", "", "master_weights=true"]
    shown = [r["precision_set"] for r in json.loads(render.to_json(rep))["rows"]]
    assert shown == [[], [], [["precision.master_weights", "True"]]]
