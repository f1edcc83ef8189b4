"""report/memory.py: the step's peak part by part in every row and the JSON report, the finding
that says what each mode saved and why (a model whose weights and optimizer state dominate, one
whose activations do), what shrinks what dominates, the prediction of another batch against a
run at that batch, the memory table and the stacked-bar chart; on runs built by hand."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from ampsweep.measure import capacity
from ampsweep.report import charts, memory, render, sweeps
from ampsweep.report.model import RunData
from unit.report.test_sweeps import CPU


def run(mode: str, batch: int, parts: dict[str, float], model="mlp", seed="0", **more) -> RunData:
    """A finished run of ``model`` that recorded its step's parts (MiB) and their sum as the
    measured peak."""
    metrics = {f"mem/{p}_mib": v for p, v in parts.items()}
    metrics[capacity.STEP_PEAK] = sum(parts.values())
    metrics.update(more)
    params = {
        "precision.name": mode,
        "model.name": model,
        "trainer.batch_size": str(batch),
        "trainer.seed": seed,
        "optimizer.name": "adamw",
    }
    return RunData(
        run_id=f"{mode}-{model}-{batch}",
        name=f"{mode}-{model}-digits-b{batch}",
        status="FINISHED",
        params=params,
        tags={"precision": mode, "model": model, "dataset": "digits", **CPU},
        metrics=metrics,
    )


# A wide MLP at batch 2: Adam's state and the fp32 weights are nearly all of the step
WIDE_FP32 = {"params": 64.0, "grads": 64.0, "optimizer": 128.0, "activations": 0.5, "other": 3.0}
WIDE_BF16 = {**WIDE_FP32, "autocast_cache": 32.0, "activations": 0.25, "other": 1.5}
# A conv net at batch 512: the activations are nearly all of it
CONV_FP32 = {"params": 0.5, "grads": 0.5, "optimizer": 1.0, "activations": 400.0, "other": 40.0}
CONV_BF16 = {**CONV_FP32, "autocast_cache": 0.25, "activations": 200.0, "other": 20.0}


def report_of(runs):
    return sweeps.make_report({"run_id": "p", "name": "s"}, runs)


def test_weights_and_optimizer_dominate_autocast_saves_nothing_and_the_fix_is_named():
    saved = "mem/activation_mib"  # all saved for backward: autocast's copies among them
    fp32, bf16 = (
        run("fp32", 2, WIDE_FP32, **{saved: 0.5}),
        run("bf16", 2, WIDE_BF16, **{saved: 32.25}),
    )
    rep = report_of([fp32, bf16])
    text = "\n".join(rep.findings)
    head = next(f for f in rep.findings if f.startswith("bf16 "))
    assert head.startswith("bf16 used 12% more memory than fp32 at the step's peak")
    assert ", 290 MiB vs 260 MiB at batch 2:" in head
    assert "its bf16 weight copies (32 MiB) outweigh what it saved of the activations" in head
    assert "the activations, their gradients and backward's temporaries are 1% of fp32's" in head
    assert "the weights, gradients and optimizer state are 99%" in head
    assert "What dominates does not shrink with autocast" in head
    # bf16_pure: weights, gradients and Adam's state halved, no cache: about half of fp32's
    assert "precision=bf16_pure (weights, gradients and optimizer state in bf16" in head
    assert "predicted 130 MiB" in head
    # fp32 master weights: fp32's 256 MiB of weights, gradients and state, but no cache
    masters = "precision=bf16_pure precision.master_weights=true (bf16 weights and gradients"
    assert masters in head
    assert "as much weight memory as fp32, no autocast cache, predicted 258 MiB" in head
    assert "precision=bf16 trainer.strategy=fsdp trainer.nproc=2" in head
    # the cache is over a tenth of bf16's peak: a finding of its own, with its fix
    assert "bf16's autocast cache holds 32 MiB of bf16 weight copies, 11% of" in text
    # the memory finding comes first among the memory findings
    assert text.index("at the step's peak") < text.index("No mode saved activation memory")


def test_a_peak_in_the_optimizers_step_is_said_so_and_a_pure_mode_predicted_from_it():
    # As a wide MLP at batch 2 measured it: the peak falls in AdamW's step, where backward has
    # freed what it saved (bf16's copies of the weights among it) and the optimizer's
    # intermediate results (in its part, beside its state) are as large as the parameters
    fp32_step = {"params": 64.0, "grads": 64.0, "optimizer": 192.0}
    at_opt = {capacity.AT_OPTIMIZER: 1.0, capacity.INTERMEDIATES: 64.0}
    fp32 = run("fp32", 2, fp32_step, **at_opt, **{capacity.SAVED: 0.06})
    bf16 = run("bf16", 2, fp32_step, **at_opt, **{capacity.SAVED: 32.03})
    rep = report_of([fp32, bf16])
    head = next(f for f in rep.findings if f.startswith("bf16 "))
    assert head.startswith("bf16 saved nothing of the step's peak against fp32, 320 MiB vs")
    assert (
        "fp32's peak is in the optimizer's step, after backward has freed the activations" in head
    )
    assert "the weights, gradients and optimizer state are 80% of it" in head
    assert "the optimizer's intermediate results 20%" in head
    # pure bf16: weights, gradients, state and the optimizer's temporaries all halve
    assert "precision=bf16_pure (weights, gradients and optimizer state in bf16" in head
    assert "predicted 160 MiB" in head
    assert rep.rows[1].memory["peak_at_optimizer"] is True


def test_activations_dominate_autocast_halves_the_peak_and_a_larger_batch_fits():
    rep = report_of([run("fp32", 512, CONV_FP32, model="cnn"), run("bf16", 512, CONV_BF16, "cnn")])
    head = next(f for f in rep.findings if f.startswith("bf16 "))
    assert head.startswith("bf16 saved 50% of the step's peak against fp32")
    assert ", 222 MiB vs 442 MiB at batch 512:" in head
    assert "the activations, their gradients and backward's temporaries are 100% of fp32's" in head
    assert "The activations dominate, so autocast's saving is real" in head
    # bf16's step at batch b: 2.25 + 220 b / 512 MiB; fp32's peak 442 MiB: b = 1023
    assert "precision=bf16 trainer.batch_size=1023 (the largest batch bf16 fits in fp32" in head
    assert "bf16_pure" not in head and "fsdp" not in head
    assert "autocast cache holds" not in "\n".join(rep.findings)


def test_the_json_report_carries_each_rows_memory_and_its_top_modules():
    fp32 = run("fp32", 2, WIDE_FP32)
    fp32.activations_by_module = [
        {"module": f"fc{i}", "type": "Linear", "mib": 0.1, "share": 0.2} for i in range(7)
    ]
    rows = json.loads(render.to_json(report_of([fp32, run("bf16", 2, WIDE_BF16)])))["rows"]
    mem = {r["precision"]: r["memory"] for r in rows}
    assert mem["fp32"]["step_peak_mib"] == pytest.approx(259.5)
    assert mem["bf16"]["parts"]["autocast_cache"] == 32.0
    assert set(mem["bf16"]["parts"]) == set(capacity.PARTS)
    assert mem["bf16"]["batch"] == 2
    assert [m["module"] for m in mem["fp32"]["activations_by_module"]] == [
        f"fc{i}" for i in range(memory.TOP_MODULES)
    ]
    assert "activations_by_module" not in mem["bf16"]


def test_a_run_without_parts_has_no_memory_and_no_finding():
    bare = run("fp32", 2, {})
    del bare.metrics[capacity.STEP_PEAK]
    rep = report_of([bare, run("bf16", 2, WIDE_BF16)])
    assert rep.rows[0].memory == {}
    assert not any("step's peak" in f for f in rep.findings)
    # an older run: its model's parts and what it saved, but no step peak: no finding on it
    older = run("fp32", 2, {"params": 64.0}, **{capacity.SAVED: 0.5})
    del older.metrics[capacity.STEP_PEAK]
    rep = report_of([older, run("bf16", 2, WIDE_BF16)])
    assert rep.rows[0].memory["step_peak_mib"] is None
    assert rep.rows[0].memory["parts"]["activations"] == 0.5
    assert not any("step's peak" in f for f in rep.findings)


def test_the_text_report_has_the_memory_table_and_the_baselines_top_modules():
    fp32 = run("fp32", 512, CONV_FP32, model="cnn")
    fp32.activations_by_module = [{"module": "conv1", "type": "Conv2d", "mib": 300, "share": 0.75}]
    md = render.to_markdown(report_of([fp32, run("bf16", 512, CONV_BF16, model="cnn")]))
    section = md.split("## Memory of a training step (MiB)")[1].split("## Findings")[0]
    assert "| mode | batch | step peak | params | grads | optimizer | autocast cache |" in section
    assert "| bf16 | 512 | 222 | 0.50 | 0.50 | 1.0 | 0.25 | 200 | 20.0 |" in section
    assert "master weights" not in section  # no mode kept any
    assert "conv1 (Conv2d) 300 MiB, 75%" in section


def test_the_chart_stacks_each_modes_parts(tmp_path):
    rep = report_of([run("fp32", 512, CONV_FP32, model="cnn"), run("bf16", 512, CONV_BF16, "cnn")])
    made = charts.write_charts(rep, tmp_path)
    assert tmp_path / "memory_breakdown.png" in made
    assert (tmp_path / "memory_breakdown.png").read_bytes()[:4] == b"\x89PNG"
    assert charts.memory_breakdown(report_of([run("fp32", 2, {})]), tmp_path / "x.png") is None


def test_another_batch_predicted_from_the_smallest_against_what_it_measured():
    slope = 200.0 / 256 * capacity.MIB  # bytes per sample: 200 MiB of activations at 256
    small = {**CONV_BF16, "activations": 200.0, "other": 20.0}
    big = {**CONV_BF16, "activations": 400.0, "other": 44.0}  # other grew more than predicted
    per = {capacity.BYTES_PER_SAMPLE: slope}
    runs = [run("bf16", 256, small, "cnn", **per), run("bf16", 512, big, "cnn", **per)]
    rep = report_of(runs)
    line = next(f for f in rep.findings if "predicted from its batch-256 run" in f)
    # predicted: 2.25 fixed + 400 activations + 40 other = 442.25; measured 446.25
    assert "batch 512: predicted 442 MiB, measured 446 MiB (-0.9%)" in line


def test_fp8_that_holds_more_than_bf16_is_said_so_with_its_copies():
    fp8_step = {**CONV_BF16, "fp8": 30.0}
    runs = [run("fp32", 512, CONV_FP32, "cnn"), run("bf16", 512, CONV_BF16, "cnn")]
    rep = report_of([*runs, run("fp8_tensorwise", 512, fp8_step, "cnn")])
    line = next(f for f in rep.findings if f.startswith("fp8_tensorwise used more memory"))
    assert line.startswith("fp8_tensorwise used more memory than bf16 (252 MiB vs 222 MiB)")
    assert "its fp8 weight copies and scales (30 MiB)" in line
    assert "trainer.compile=true" in line


def test_a_mode_with_and_without_master_weights_is_named_apart_and_predicted_apart():
    # the doctor's verify sweep: bf16_pure beside bf16_pure with fp32 master weights, each at
    # batch 2 and 8 (a 16-bit copy of Adam's state beside fp32's, the fp32 copy of the weights)
    pure = {"params": 32.0, "grads": 32.0, "optimizer": 64.0, "activations": 0.25, "other": 1.5}
    masters = {**pure, "optimizer": 128.0, "master_weights": 64.0}
    runs = [run("fp32", 2, WIDE_FP32)]
    for batch, grown in ((2, 1.0), (8, 4.0)):
        bigger = {"activations": 0.25 * grown, "other": 1.5 * grown}
        for parts, setting in ((pure, "False"), (masters, "True")):
            one = run("bf16_pure", batch, {**parts, **bigger})
            one.run_id += f"-{setting}"
            one.params["precision.master_weights"] = setting
            runs.append(one)
    rep = report_of(runs)
    named = "bf16_pure (master_weights=true)"
    head = next(f for f in rep.findings if f.startswith(f"{named} saved"))
    # a fix that keeps the mode keeps its setting: running it measures what was predicted
    assert "precision=bf16_pure precision.master_weights=true trainer.strategy=fsdp" in head
    assert sum(f.startswith("bf16_pure saved") for f in rep.findings) == 1
    series = [f for f in rep.findings if "predicted from its batch-2 run" in f]
    assert sorted(f.split("'s step peak")[0] for f in series) == ["bf16_pure", named]
    # each batch-8 run is predicted from its own setting's batch-2 run: within 1%
    assert all(f.count("batch 8:") == 1 and "(+0.0%)" in f for f in series), series
    headers, body = memory.table(rep.rows)
    assert {r[0] for r in body} == {"fp32", "bf16_pure", named}
    # a log (not a terminal) prints the table whole, however long a row's mode
    log = io.StringIO()
    render.print_table(rep, Console(file=log, width=80, soft_wrap=True))
    assert re.search(rf" {re.escape(named)} +2 +258 ", log.getvalue()), log.getvalue()
