"""engine.export: the trained model as it is handed to MLflow."""

from __future__ import annotations

import torch

from ampsweep.engine import export
from ampsweep.engine.data.batches import Batches


def _batches(x, y, dtype=torch.float32) -> Batches:
    return Batches((x, y), 16, torch.device("cpu"), dtype, shuffle=False, drop_last=False,
                   seed=0, preload=True)  # fmt: skip


def test_a_pure_bf16_model_is_copied_to_fp32_and_gives_its_weights_back_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 10), torch.nn.BatchNorm1d(10)
    )
    model = model.to(torch.bfloat16)
    x, y = torch.randn(40, 1, 8, 8), torch.arange(40) % 10
    snap = export.snapshot(model, _batches(x, y, torch.bfloat16))
    copied = dict(snap.module.state_dict())
    for name, t in model.state_dict().items():
        assert copied[name].device.type == "cpu"
        if t.is_floating_point():
            assert copied[name].dtype == torch.float32
            assert torch.equal(copied[name].to(torch.bfloat16), t)
        else:
            assert copied[name].dtype == t.dtype  # e.g. BatchNorm's step count stays int64
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the original untouched
    assert isinstance(next(snap.module.parameters()), torch.nn.Parameter)
    assert not snap.module.training
    # one batch of inputs, in fp32 (numpy has no bf16), and the fp32 model's output on it
    assert snap.example.shape == (16, 1, 8, 8) and snap.example.dtype.name == "float32"
    out = snap.predict(snap.example)
    assert out.shape == (16, 10) and out.dtype.name == "float32"
    assert "torch" in snap.packages


def test_the_compiled_wrapper_is_not_logged_but_its_module():
    model = torch.nn.Linear(4, 2)
    compiled = torch.compile(model)  # wrapping alone compiles nothing
    snap = export.snapshot(compiled, _batches(torch.randn(8, 4), torch.zeros(8, dtype=torch.long)))
    assert type(snap.module) is torch.nn.Linear
    assert torch.equal(snap.module.weight, model.weight)
    assert snap.module.weight.data_ptr() != model.weight.data_ptr()  # a copy


def test_the_input_example_of_large_inputs_is_cut_to_whole_rows():
    x = torch.randn(16, 3, 100, 100)  # 30,000 values a row
    snap = export.snapshot(torch.nn.Flatten(), _batches(x, torch.zeros(16, dtype=torch.long)))
    assert snap.example.shape == (export.EXAMPLE_VALUES // 30_000, 3, 100, 100)
