"""cli/predict.py: what ``ampsweep predict`` shows of fp8's layer filter: per layer and
recipe the predicted speed-up against bf16 beside torchao's choice, and the override."""

from __future__ import annotations

import json

import torch
from torch import nn

from ampsweep.cli.predict import fp8_advice, fp8_json, print_fp8_advice
from ampsweep.config.compose import load
from ampsweep.measure.roofline import gpu_spec


def model() -> nn.Module:
    with torch.device("meta"):  # no memory: shapes only
        return nn.Sequential(nn.Linear(64, 4096), nn.Linear(4096, 8192), nn.Linear(8192, 64),
                             nn.Linear(64, 10))  # fmt: skip


def test_each_fp8_recipe_has_its_rows_verdict_and_override(capsys):
    cfg = load(["trainer.batch_size=16384"])
    advice = fp8_advice(model(), torch.zeros(2, 64), cfg, gpu_spec("h100"))
    assert [a.recipe for a in advice] == ["tensorwise", "rowwise"]
    for a in advice:
        assert a.override() == "precision.fp8.keep_bf16=[2]"  # 8192x64: predicted to lose
    data = fp8_json(advice)
    assert set(data) == {"fp8_tensorwise", "fp8_rowwise"}
    rows = data["fp8_tensorwise"]["layers"]
    assert [(r["name"], r["m"], r["k"], r["n"]) for r in rows][1] == ("1", 16384, 4096, 8192)
    assert rows[1]["speedup"] > 1.2 and rows[1]["fp8"] and rows[1]["torchao"] is True
    print_fp8_advice(advice, top=2)
    out = " ".join(capsys.readouterr().out.split())
    assert "16384x4096x8192" in out and "(2 more Linear layers: --top 4)" in out
    assert "fp8_tensorwise on the H100 SXM at batch 16384: 1 of the 2 Linear layers" in out
    assert out.endswith("the others in bf16: precision.fp8.keep_bf16=[2]")


def test_a_gpu_without_fp8_tensor_cores_gets_no_filter(capsys):
    cfg = load([])
    assert fp8_advice(model(), torch.zeros(2, 64), cfg, gpu_spec("a100")) == []
    print_fp8_advice([], top=5)
    assert capsys.readouterr().out == ""


def test_predict_carries_the_filter_in_its_json_and_refuses_a_bad_keep_bf16(main):
    result = main("predict", "--gpu", "h100", "--format", "json", "model=mlp",
                  "precision.fp8.keep_first_last=false")  # fmt: skip
    assert result.code == 0, result.err
    tensorwise = json.loads(result.out)["fp8_filter"]["fp8_tensorwise"]
    rows = {r["name"]: r for r in tensorwise["layers"]}
    assert list(rows) == ["1", "4", "7"] and rows["4"]["m"] == 64  # the batch's 64 samples
    # at 64 rows fp8's casts cost more than its matmuls save: every layer it takes loses
    assert tensorwise["override"] == "precision.fp8.keep_bf16=[1,4]"
    assert rows["7"]["why"] == "256x10: both dimensions must be divisible by 16"
    bad = main("predict", "--gpu", "h100", "model=mlp", "precision.fp8.keep_bf16=[fc9]")
    assert bad.code == 2 and "precision.fp8.keep_bf16: no nn.Linear layer" in bad.err
