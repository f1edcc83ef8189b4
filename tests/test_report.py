"""The sweep report on known numbers: arithmetic, baseline matching, findings, formats."""

from __future__ import annotations

import csv
import io
import json

import pytest

from ampsweep.report import render, sweeps
from ampsweep.report import rows as report_rows
from ampsweep.report.model import RunData

CPU = {"device": "cpu", "device_name": "x86_64", "cpu_threads": "2", "torch_version": "2.14.1"}
CUDA = {"device": "cuda", "device_name": "NVIDIA H200", "compute_capability": "9.0"}


def run(mode, *, model="cnn", lr="0.001", status="FINISHED", device=CPU, error=None, **metrics):
    params = {"precision.name": mode, "precision.dtype": mode[:4], "model.name": model}
    params["optimizer.lr"] = lr
    tags = {"precision": mode, "model": model, "dataset": "digits", **device}
    if error:
        tags["error"] = error
    names = {"acc": "val/acc", "sps": "perf/samples_per_s", "act": "mem/activation_mib"}
    names |= {"peak": "mem/peak_allocated_mib", "skipped": "amp/skipped_steps"}
    names |= {"scale": "amp/loss_scale", "underflow": "amp/grad_underflow_frac"}
    return RunData(
        run_id=f"{mode}-{model}-{lr}",
        name=f"{mode}-{model}-digits",
        status=status,
        params=params,
        tags=tags,
        metrics={names[k]: v for k, v in metrics.items()},
    )


def test_ratios_and_deltas_on_known_numbers():
    runs = [
        run("fp32", acc=0.98, sps=1000.0, act=4.0, peak=800.0, skipped=0.0),
        run("bf16", acc=0.97, sps=2500.0, act=2.0, peak=500.0, skipped=0.0),
        run("fp16", acc=0.985, sps=2000.0, act=2.2, peak=520.0, skipped=3.0, scale=8192.0),
    ]
    rows = {r.precision: r for r in report_rows.compute_rows(runs)}
    assert rows["fp32"].speedup == 1.0 and rows["fp32"].acc_delta == 0.0
    assert rows["bf16"].speedup == pytest.approx(2.5)
    assert rows["bf16"].acc_delta == pytest.approx(-0.01)
    assert rows["bf16"].activation_ratio == pytest.approx(0.5)
    assert rows["bf16"].peak_ratio == pytest.approx(0.625)
    assert rows["fp16"].speedup == pytest.approx(2.0)
    assert rows["fp16"].activation_ratio == pytest.approx(0.55)
    assert rows["fp16"].skipped_steps == 3.0 and rows["fp16"].loss_scale == 8192.0
    assert rows["bf16"].baseline == "fp32-cnn-digits"
    head = sweeps.make_report({"run_id": "p"}, runs).headline_metrics()
    assert head["speedup/bf16"] == pytest.approx(2.5)
    assert head["acc_delta/fp16"] == pytest.approx(0.005)
    assert head["activation_ratio/fp16"] == pytest.approx(0.55)
    assert head["peak_ratio/bf16"] == pytest.approx(0.625)


def test_baseline_is_the_fp32_run_whose_config_differs_only_in_precision():
    runs = [
        run("fp32", model="cnn", acc=0.9, sps=100.0, act=1.0),
        run("fp32", model="mlp", acc=0.8, sps=400.0, act=0.5),
        run("bf16", model="mlp", acc=0.8, sps=200.0, act=0.25),
        run("bf16", model="cnn", acc=0.9, sps=300.0, act=0.5),
        run("bf16", model="cnn", lr="0.01", acc=0.7, sps=300.0, act=0.5),  # no fp32 at lr=0.01
    ]
    rows = report_rows.compute_rows(runs)
    by_id = {r.run_id: r for r in rows}
    assert by_id["bf16-mlp-0.001"].baseline_run_id == "fp32-mlp-0.001"
    assert by_id["bf16-mlp-0.001"].speedup == pytest.approx(0.5)
    assert by_id["bf16-cnn-0.001"].baseline_run_id == "fp32-cnn-0.001"
    assert by_id["bf16-cnn-0.001"].speedup == pytest.approx(3.0)
    orphan = by_id["bf16-cnn-0.01"]
    assert orphan.baseline is None and orphan.speedup is None and orphan.acc_delta is None
    assert orphan.note == "no fp32 run of the same config"
    # Two runs share a mode, so headline metrics are keyed by run name there.
    head = sweeps.make_report({"run_id": "p"}, runs).headline_metrics()
    assert "speedup/bf16-mlp-digits" in head and "speedup/bf16" not in head


def test_baseline_mode_can_be_chosen_and_failed_baselines_are_not_used():
    runs = [
        run("fp32", status="FAILED", error="boom"),
        run("bf16", acc=0.9, sps=300.0, act=0.5),
        run("fp16", acc=0.91, sps=150.0, act=0.5),
    ]
    rows = {r.precision: r for r in report_rows.compute_rows(runs)}
    assert rows["bf16"].baseline is None and rows["bf16"].note == "no fp32 run of the same config"
    rows = {r.precision: r for r in report_rows.compute_rows(runs, "bf16")}
    assert rows["fp16"].speedup == pytest.approx(0.5)
    assert rows["fp16"].acc_delta == pytest.approx(0.01)
    assert rows["fp32"].status == "FAILED" and rows["fp32"].error == "boom"
    none = report_rows.compute_rows([run("bf16", acc=0.9)])
    assert none[0].note == "no fp32 run in this sweep"


def test_findings_on_cpu_name_fastest_savings_accuracy_and_where_speedups_belong():
    runs = [
        run("fp32", acc=0.986, sps=5000.0, act=4.62),
        run("fp16", acc=0.984, sps=1000.0, act=2.58, skipped=2.0, scale=16384.0),
        run("fp16_noscale", acc=0.90, sps=1100.0, act=2.58, underflow=0.125),
        run("bf16", acc=0.989, sps=2500.0, act=2.31),
        run("tf32", status="FAILED", error="precision=tf32 needs a CUDA GPU"),
    ]
    rep = sweeps.make_report({"run_id": "p", "name": "s"}, runs)
    text = "\n".join(rep.findings)
    assert rep.findings[0] == "Device: cpu (x86_64, 2 threads, torch 2.14.1)."
    assert "Fastest here: fp32 at 5,000 samples/s" in text
    assert "bf16 0.50x" in text and "fp16 0.20x" in text
    assert "Most activation memory saved: bf16, 2.31 MiB per step vs 4.62 MiB for fp32" in text
    assert "(0.50x, 50% less)" in text
    assert "Accuracy held within 1.5 points of fp32's 0.986: fp16 0.984, bf16 0.989." in text
    assert "Accuracy dropped for fp16_noscale: 0.900 (-8.6 points vs fp32)." in text
    assert "fp16 without loss scaling (fp16_noscale) reached 0.900 (-8.6 points vs fp32)" in text
    assert "(12.5% of this run's gradient values did)" in text
    assert "fp16 skipped 2 step(s), final scale 16384" in text
    assert "no tensor cores" in text and "belong to GPUs" in text
    assert "tf32-cnn-digits ended FAILED: precision=tf32 needs a CUDA GPU." in text
    # The optional gradient-underflow column appears only because a run logged it.
    headers, _ = render.table_cells(rep)
    assert "grad_underflow_frac" in headers
    assert "peak MiB" not in headers  # no CUDA peak on CPU


def test_findings_on_a_gpu_name_the_speedup_and_peak_memory():
    runs = [
        run("fp32", device=CUDA, acc=0.95, sps=1000.0, act=40.0, peak=4000.0),
        run("bf16", device=CUDA, acc=0.951, sps=3100.0, act=20.0, peak=2400.0),
    ]
    rep = sweeps.make_report({"run_id": "p"}, runs)
    text = "\n".join(rep.findings)
    assert "Device: cuda (NVIDIA H200, compute capability 9.0)." in text
    assert "Fastest here: bf16, 3.10x the fp32 throughput (3,100 samples/s)." in text
    assert "Lowest peak GPU memory: bf16, 2,400 MiB (0.60x fp32)." in text
    assert "belong to GPUs" not in text
    headers, body = render.table_cells(rep)
    assert "peak MiB" in headers and "grad_underflow_frac" not in headers
    assert body[0][-1] == "(the baseline)"


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


def test_underflow_diagnostics_become_a_finding_with_their_numbers():
    runs = [
        run("fp32", acc=0.975, underflow=0.25),
        run("fp16_noscale", acc=0.47, underflow=0.2),
        run("fp16", acc=0.975, underflow=0.25, scale=65536.0),
    ]
    runs[1].metrics["amp/grad_flushed_frac"] = 0.3
    runs[2].metrics["amp/grad_underflow_frac_scaled"] = 0.001
    text = "\n".join(sweeps.make_report({"run_id": "p", "name": "s"}, runs).findings)
    assert "Gradient underflow: fp16 without loss scaling would flush 25" in text
    assert "measured in fp32" in text
    assert "The fp16_noscale run actually lost 30" in text


def test_a_cpu_with_native_bf16_is_named_in_the_hardware_finding():
    cpu = {**CPU, "cpu_half_isa": "avx512_bf16"}
    runs = [
        run("fp32", acc=0.98, sps=100.0, device=cpu),
        run("bf16", acc=0.98, sps=120.0, device=cpu),
    ]
    text = "\n".join(sweeps.make_report({"run_id": "p", "name": "s"}, runs).findings)
    assert "native half-precision instructions avx512_bf16" in text
    assert "bf16 1.20x" in text and "belong to GPUs" in text


def test_no_memory_saving_is_not_reported_as_one():
    runs = [run("fp32", acc=0.97, act=0.144), run("fp16", acc=0.97, act=0.203, scale=65536.0)]
    text = "\n".join(sweeps.make_report({"run_id": "p", "name": "s"}, runs).findings)
    assert "Most activation memory saved" not in text
    assert "No mode saved activation memory: the least is fp16 with 0.20 MiB" in text
