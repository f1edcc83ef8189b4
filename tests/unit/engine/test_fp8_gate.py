"""engine/fp8_gate.py: each converted Linear layer's fp8 output and gradients against bf16's
(torchao's compute_error, in emulation on a CPU); a layer with one outlier weight that
tensorwise scaling cannot carry is named, and kept out with precision.fp8.keep_bf16."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampsweep.engine.fp8_gate import THRESHOLD_DB, measure, sqnr
from ampsweep.precision.modes import MODES, Fp8Config

pytest.importorskip("torchao", reason="fp8 needs the fp8 extra: pip install -e '.[fp8]'")

TENSORWISE = MODES["fp8_tensorwise"]


def outlier_model(outlier: float) -> nn.Module:
    """fc2 holds one ``outlier`` weight on an input that never fires (fc1's last unit)."""
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(32, 64), nn.Linear(64, 64)
    with torch.no_grad():
        fc1.weight[-1].zero_()
        fc1.bias[-1] = 0.0
        fc2.weight[0, -1] = outlier
    return nn.Sequential(OrderedDict(
        fc1=fc1, act1=nn.ReLU(), fc2=fc2, act2=nn.ReLU(),
        fc3=nn.Linear(64, 64), act3=nn.ReLU(), head=nn.Linear(64, 10),
    ))  # fmt: skip


def batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g))
            for _ in range(n)]  # fmt: skip


def test_sqnr_is_torchaos_compute_error_and_exact_agreement_is_infinite():
    x = torch.tensor([3.0, 4.0])
    assert sqnr(x, x + torch.tensor([0.3, 0.4])) == pytest.approx(20.0)  # noise a tenth
    assert math.isinf(sqnr(x, x.clone()))


def test_the_layer_whose_outlier_tensorwise_scaling_loses_is_named_and_kept_out():
    model = outlier_model(1e5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gate = measure(model, batches(), F.cross_entropy, TENSORWISE, Fp8Config(emulate=True))
    assert [la.name for la in gate.layers] == ["fc2", "fc3"]  # fc1 and head: first and last
    fc2, fc3 = gate.layers
    # every ordinary weight of fc2 rounds to zero: its output is mostly noise
    assert fc2.output < 5.0 and fc2.least == ("output", fc2.output)
    assert fc3.least[1] > THRESHOLD_DB  # a layer of ordinary weights passes
    assert [la.name for la in gate.failing] == ["fc2"] and not gate.passed
    assert gate.override() == "precision.fp8.keep_bf16=[fc2]"
    assert "under 20 dB: fc2 " in gate.summary()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    assert all(p.grad is None for p in model.parameters())
    # with the filter the layer stays in bf16, and what fp8 still converts passes
    kept = measure(model, batches(), F.cross_entropy, TENSORWISE,
                   Fp8Config(emulate=True, keep_bf16=["fc2"]))  # fmt: skip
    assert [la.name for la in kept.layers] == ["fc3"] and kept.passed
    assert kept.override() == "precision.fp8.keep_bf16=[fc2]"
    assert "every converted layer >= 20 dB" in kept.summary()


def test_without_the_outlier_every_layer_passes():
    gate = measure(outlier_model(0.1), batches(), F.cross_entropy, TENSORWISE,
                   Fp8Config(emulate=True))  # fmt: skip
    assert gate.passed and len(gate.layers) == 2
    assert all(25.0 < la.output < 45.0 for la in gate.layers)  # e4m3's three mantissa bits
