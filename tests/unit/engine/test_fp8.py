"""engine/fp8.py: the fp8 layer filter written as config (precision.fp8.keep_bf16), and the
advice of which layers fp8 is predicted to speed up on a named GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from ampsweep.config.compose import load
from ampsweep.config.schema import ConfigError
from ampsweep.engine.fp8 import plan
from ampsweep.engine.models.vision import mlp
from ampsweep.precision.modes import Fp8Config

X = torch.zeros(2, 1, 8, 8)


def test_keep_bf16_leaves_the_named_layers_and_blocks_out_of_fp8():
    model = mlp((1, 8, 8), 10)  # Linear 64->256 ("1"), 256->256 ("4"), 256->10 ("7")
    planned = plan(model, X, Fp8Config(keep_first_last=False, keep_bf16=["4"]))
    assert planned.converted == ["1"]
    reasons = {la.name: la.reason for la in planned.layers}
    assert reasons["4"] == "kept in bf16 by precision.fp8.keep_bf16"
    # a pattern naming a block keeps every Linear in it, as precision.keep_fp32's do
    block = nn.Sequential(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), nn.Linear(32, 16))
    kept = plan(block, torch.zeros(2, 32), Fp8Config(keep_first_last=False, keep_bf16=["0"]))
    assert kept.converted == ["1"] and kept.kept == ["0.0", "0.1"]
    globbed = plan(block, torch.zeros(2, 32), Fp8Config(keep_first_last=False, keep_bf16=["0.*"]))
    assert globbed.converted == ["1"]


def test_a_keep_bf16_name_that_matches_no_linear_is_one_line_with_the_names():
    with pytest.raises(ConfigError) as err:
        plan(mlp((1, 8, 8), 10), X, Fp8Config(keep_bf16=["4", "fc9"]))
    text = str(err.value)
    assert text.startswith("precision.fp8.keep_bf16: no nn.Linear layer of the model is called fc9")
    assert "(1, 4, 7)" in text and "\n" not in text


def test_an_empty_keep_bf16_pattern_is_refused_when_composed():
    with pytest.raises(ConfigError, match=r"keep_bf16=\[4,\]: an empty pattern"):
        load(["precision=fp8_tensorwise", "precision.fp8.keep_bf16=[4,'']"])


def test_a_bad_keep_bf16_name_exits_2_with_nothing_recorded(main):
    pytest.importorskip("torchao")
    out = main("train", "precision=fp8_tensorwise", "precision.fp8.emulate=true", "model=mlp",
               "precision.fp8.keep_bf16=[fc9]")  # fmt: skip
    assert out.code == 2
    assert "precision.fp8.keep_bf16: no nn.Linear layer of the model is called fc9" in out.err
    assert not Path("outputs").exists()  # the test's own folder: no store, no run folder


def test_an_fp8_run_records_the_layers_keep_bf16_kept(main):
    pytest.importorskip("torchao")
    from ampsweep.engine import build

    cfg = load(["precision=fp8_tensorwise", "precision.fp8.emulate=true", "model=mlp",
                "model.width=16", "precision.fp8.keep_first_last=false",
                "precision.fp8.keep_bf16=[4]", "tracking=none"])  # fmt: skip
    setup = build.build(cfg)
    converted = [n for n, m in setup.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted == ["1"] == setup.fp8.converted
    assert setup.fp8.table()["layers"][1]["reason"] == "kept in bf16 by precision.fp8.keep_bf16"


def wide_and_narrow() -> nn.Module:
    """On the meta device: a wide 4096x8192 layer, then a narrow 8192x64 one."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(64, 4096), nn.Linear(4096, 8192), nn.Linear(8192, 64),
                             nn.Linear(64, 10))  # fmt: skip


def test_the_filter_keeps_the_layers_predicted_to_lose_beside_torchaos_choice():
    from ampsweep.engine.fp8 import fp8_filter
    from ampsweep.measure.roofline import gpu_spec

    planned = plan(wide_and_narrow(), torch.zeros(2, 64), Fp8Config(), "tensorwise")
    advice = fp8_filter(planned, gpu_spec("h100"), batch_size=16384)
    rows = {la.name: la for la in advice.layers}
    wide, narrow = rows["1"], rows["2"]
    assert (wide.m, wide.k, wide.n) == (16384, 4096, 8192)
    # torchao's README measures about 1.4x at M, K, N = 4096, 8192, 16384 on an H100
    assert wide.fp8 and wide.speedup > 1.2 and wide.why == ""
    assert not narrow.fp8 and narrow.speedup < 1.0
    assert narrow.why.startswith("predicted 0.") and narrow.why.endswith("x bf16's speed in fp8")
    assert not rows["0"].fp8 and rows["0"].speedup is None  # the first layer, kept as before
    assert rows["3"].why == "64x10: both dimensions must be divisible by 16"
    if importlib.util.find_spec("torchao") is not None:  # its auto-filter, side by side:
        # it reads K and N alone (tensorwise: keep out K <= 4096 with N <= 1024), so it
        # converts the narrow 8192x64 layer too; not the 64x10 one (not divisible by 16)
        assert wide.torchao is True and narrow.torchao is True and rows["3"].torchao is False
    assert advice.override() == "precision.fp8.keep_bf16=[2]"
    assert advice.verdict() == (
        "fp8_tensorwise on the H100 SXM at batch 16384: 1 of the 2 Linear layers fp8 can take "
        "predicted to gain; the others in bf16: precision.fp8.keep_bf16=[2]"
    )
    # the config's own patterns stay, and a layer they keep is judged again
    given = plan(wide_and_narrow(), torch.zeros(2, 64), Fp8Config(keep_bf16=["1"]), "tensorwise")
    again = fp8_filter(given, gpu_spec("h100"), 16384, ["1"])
    assert again.override() == "precision.fp8.keep_bf16=[1,2]"
    assert {la.name: la.speedup for la in again.layers}["1"] == wide.speedup
    # at a small batch fp8's casts cost more than its matmul saves: nothing gains
    with torch.device("meta"):
        one = nn.Sequential(nn.Linear(4096, 8192))
    alone = plan(one, torch.zeros(2, 4096), Fp8Config(keep_first_last=False), "tensorwise")
    small = fp8_filter(alone, gpu_spec("h100"), batch_size=8)
    assert small.layers[0].speedup < 1.0 and small.override() == "precision.fp8.keep_bf16=[0]"
    assert small.verdict() == (
        "no Linear layer is predicted to gain from fp8_tensorwise on the H100 SXM at batch 8: "
        "stay with bf16"
    )


class ReadsAValue(nn.Module):
    """A model whose forward reads a tensor's value, as Hugging Face's packed-sequence check
    does: it cannot run on the meta device."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(64, 32), nn.Linear(32, 16)

    def forward(self, x):
        x = x.flatten(1)
        if x.sum().item() >= 0:  # a value: .item() on a meta tensor raises
            x = x.abs()
        return self.second(self.first(x))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_model_that_reads_a_value_is_planned_on_the_cpu(device):
    """Planned on the CPU where the meta trace fails, from the model's own tensors, or from
    zeros where it lives on the meta device (the check before a run)."""
    with torch.device(device):
        model = ReadsAValue()
    planned = plan(model, X, Fp8Config(keep_first_last=False), "tensorwise")
    assert planned.converted == ["first", "second"]
    assert planned.total_flops == 2.0 * 2 * (64 * 32 + 32 * 16)
    assert [la.rows for la in planned.layers] == [1.0, 1.0]
    assert next(model.parameters()).device.type == device
