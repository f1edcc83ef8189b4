"""measure/diagnostics.py: gradient-underflow thresholds, the measurement the loop makes every
N steps, the per-layer tables, and the shipped demo learning worse only without scaling."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from ampsweep.config import compose as config
from ampsweep.config.schema import DiagnosticsConfig
from ampsweep.engine import build as train
from ampsweep.engine import loop
from ampsweep.measure.diagnostics import COUNTS, Diagnostics, _counts

DEMO = ["experiment=underflow_demo", "tracking=none", "trainer.progress=false"]


def counts_of(values, scale=None, grad=None):
    param = torch.nn.Parameter(torch.zeros(len(values)))
    param.grad = None if grad is None else torch.tensor(grad)
    return dict(zip(COUNTS, _counts(param, torch.tensor(values), scale).tolist(), strict=True))


def test_thresholds_count_underflow_subnormal_and_scaled():
    c = counts_of([0.0, 1e-9, 2.0**-25, 2.0**-24, 1e-6, 1e-3], scale=2.0**10)
    assert c["ref_nonzero"] == 5
    assert c["underflow"] == 2  # 1e-9 and 2^-25 round to zero in fp16; 2^-24 does not
    assert c["subnormal"] == 4  # everything below 2^-14
    assert c["underflow_scaled"] == 0  # times 1024 all are representable
    assert c["subnormal_scaled"] == 2  # 1e-9 * 1024 and 2^-25 * 1024 are still subnormal


def test_the_underflow_threshold_is_exactly_what_fp16_rounds_to_zero():
    torch.manual_seed(0)
    values = torch.exp(torch.empty(100_000).uniform_(-25, -5)) * torch.sign(torch.randn(100_000))
    c = counts_of(values.tolist())
    assert c["underflow"] == int((values.half() == 0).sum())
    assert 0 < c["underflow"] < len(values)


def test_flushed_counts_reference_values_the_run_lost():
    c = counts_of([1e-3, 1e-9, 0.0, 2e-3], grad=[1e-3, 0.0, 0.0, 0.0])
    assert c["zero"] == 3 and c["flushed"] == 2  # the 0.0 in both is not a flush


def test_off_by_default_is_one_comparison():
    diag = Diagnostics()
    assert not any(diag.due(step) for step in range(1, 100))
    assert Diagnostics(DiagnosticsConfig(every=5)).due(10)
    assert not Diagnostics(DiagnosticsConfig(every=5)).due(11)


def run(mode: str, extra: list[str]):
    cfg = config.load([*DEMO, f"precision={mode}", *extra])
    setup = train.build(cfg)
    logged: list[tuple[int, dict]] = []
    summary = loop.fit(setup, lambda m, step: logged.append((step, m)))
    diag = [(step, m) for step, m in logged if "amp/grad_underflow_frac" in m]
    return summary, diag, setup


def test_the_loop_measures_every_n_steps_and_sees_fp16_noscale_lose_gradient():
    short = ["trainer.max_steps=6", "diagnostics.every=3"]
    _, fp32, _ = run("fp32", short)
    _, noscale, setup = run("fp16_noscale", short)
    _, scaled, _ = run("fp16", short)
    assert [step for step, _ in fp32] == [3, 6]
    # The reference gradient has the same distribution in every mode: most of it is below
    # fp16's range with the demo's tiny loss.
    for diag in (fp32, noscale, scaled):
        assert diag[0][1]["amp/grad_underflow_frac"] > 0.5
    # fp32 loses nothing; fp16 without a scaler loses most; the scaler keeps nearly all.
    assert fp32[-1][1]["amp/grad_flushed_frac"] == 0.0
    assert noscale[-1][1]["amp/grad_flushed_frac"] > 0.5
    assert scaled[-1][1]["amp/grad_flushed_frac"] < 0.01
    assert scaled[-1][1]["amp/grad_underflow_frac_scaled"] < 0.01
    assert "amp/grad_underflow_frac_scaled" not in noscale[-1][1]  # no scaler, no scale
    table = setup.diagnostics.table()
    assert table[-1]["layer"] == "(all)" and table[0]["layer"] == "1.weight"
    assert table[-1]["grad_flushed_frac"] > 0.5


def test_diagnostics_off_log_nothing(quick):
    summary, diag, setup = run("fp32", [*quick, "diagnostics.every=0"])
    assert diag == [] and setup.diagnostics.table() == []
    assert setup.diagnostics.write_tables(Path("/nonexistent")) == []


def test_per_layer_tables_are_written(tmp_path, quick):
    _, _, setup = run("bf16_pure", [*quick, "diagnostics.every=2"])
    paths = setup.diagnostics.write_tables(tmp_path)
    assert sorted(p.name for p in paths) == [
        "grad_underflow.csv",
        "grad_underflow.json",
        "grad_underflow.md",
    ]
    rows = list(csv.DictReader(paths[0].open()))
    assert rows[-1]["layer"] == "(all)" and "grad_subnormal_frac" in rows[0]
    assert "| layer |" in paths[2].read_text()


@pytest.mark.slow
def test_underflow_demo_learns_worse_only_without_scaling():
    """The shipped demo, as configured: fp16_noscale learns clearly worse; the rest match."""
    acc = {mode: run(mode, [])[0]["val/acc"] for mode in ("fp32", "fp16_noscale", "fp16", "bf16")}
    assert acc["fp32"] > 0.9
    assert acc["fp16_noscale"] < acc["fp32"] - 0.2
    assert abs(acc["fp16"] - acc["fp32"]) <= 0.02
    assert abs(acc["bf16"] - acc["fp32"]) <= 0.02
