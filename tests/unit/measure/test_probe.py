"""measure/probe.py: module ranges at fp32 against each format's, the fp16 overflow and
underflow it predicts, the loss scale it suggests, the updates a pure half model would round
away (half an ulp of each format, the share of an optimizer step's updates a half-precision
weight rounds away, from the optimizer's own state with the run's weights untouched); a run
that asks for it (diagnostics.numerics=true) records it, and a pure run measures its lost
updates on its own steps."""

from __future__ import annotations

import math

import torch
from conftest import QUICK, Gain, all_runs
from torch import nn

from ampsweep import api
from ampsweep.engine.tasks import default_objective
from ampsweep.measure.probe import half_ulp, probe, update_lost_shares
from ampsweep.tracking.store import client_for


def batches(n: int = 2):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(n)]  # fmt: skip


def test_a_module_beyond_fp16s_range_is_named_with_its_value_and_negative_headroom():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Gain(1e5), nn.LayerNorm(8), nn.Linear(8, 3))
    found = probe(model, batches(), default_objective())
    ((name, value),) = found.fp16_overflow()
    assert name == "1" and value > 65504
    least = found.forward_headroom("fp16")
    assert least[0] == "1" and least[1] == math.log2(65504 / value) < 0
    assert found.metrics()["numerics/fp16_forward_headroom_log2"] < 0
    assert found.tags()["numerics.fp16_overflow"].startswith("1=")
    assert found.forward_headroom("bf16")[1] > 100  # bf16 has fp32's range


def test_tiny_gradients_are_measured_and_the_suggested_scale_keeps_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    found = probe(model, batches(), default_objective(), loss_weight=1e-6)
    assert found.grad_underflow() > 0.5  # most of the gradient is below 2^-25
    scale = found.suggested_scale()
    assert math.log2(scale).is_integer() and 1 <= scale <= 2**24
    top = max(m.output_grad.absmax for m in found.modules)
    assert top * scale < 65504  # the largest scaled gradient still fits
    assert found.grad_underflow(scale) < 0.01
    plain = probe(model, batches(), default_objective())
    assert plain.grad_underflow() < found.grad_underflow()


def test_updates_below_half_a_bf16_ulp_are_counted_as_lost():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].weight.mul_(64.0)  # |w| ~ 16: half a bf16 ulp ~ 0.03 >> lr
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    found = probe(model, batches(), default_objective(), optimizer=opt)
    bf16 = found.update_lost["bf16"]
    assert bf16["0.weight"] > 0.9 and bf16["2.weight"] < 0.5
    assert found.update_lost["fp16"]["0.weight"] < bf16["0.weight"]  # fp16 has 3 bits more
    assert found.tags()["numerics.update_lost_layers"].startswith(("0.weight=", "1.weight="))
    assert model[0].weight.grad is None and opt.state == {}  # nothing of the run changed


def test_a_run_with_the_probe_records_its_ranges(store_uri):
    res = api.train([*QUICK, "model=mlp", "precision=bf16", "diagnostics.numerics=true",
                     "trainer.loss_multiplier=1e-5", f"tracking.uri={store_uri}"])  # fmt: skip
    (run,) = all_runs(store_uri)
    m = run.data.metrics
    assert m["numerics/fp16_grad_underflow_frac"] > 0.5
    assert m["numerics/suggested_init_scale"] >= 2**16
    assert "numerics/bf16_update_lost_frac" in m and "numerics/fp16_forward_headroom_log2" in m
    files = {f.path for f in client_for(store_uri).list_artifacts(res.run_id, "numerics")}
    assert files == {"numerics/probe.json", "numerics/probe.md"}


def test_linear_layers_beyond_fp8s_range_are_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.mul_(2000.0)  # weights past e4m3's 448, outputs with them
    found = probe(model, batches(), default_objective())
    named = {(n, what) for n, what, _, _ in found.fp8_saturating()}
    assert {("0", "weight"), ("0", "output")} <= named
    assert not any(n == "1" and what == "weight" for n, what in named)
    assert found.tags()["numerics.fp8_saturating"].startswith("0.weight=")


def test_half_an_ulp_is_the_formats_spacing_over_two():
    w = torch.tensor([1.0, 1.5, 64.0, -0.25])
    assert half_ulp(w, "bf16").tolist() == [2**-8, 2**-8, 2**-2, 2**-10]
    assert half_ulp(w, "fp16").tolist() == [2**-11, 2**-11, 2**-5, 2**-13]


def test_lost_shares_follow_the_optimizers_own_state():
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    grads = {"weight": torch.tensor([[2**-9, 2**-6]])}  # SGD update = lr * grad
    shares = update_lost_shares(model, opt, grads, ("bf16",))["bf16"]
    assert shares == {"weight": 0.5, "(all)": 0.5}  # 2^-9 < 2^-8 is lost, 2^-6 is kept
    assert model.weight.tolist() == [[1.0, 1.0]]


def test_a_pure_run_measures_the_updates_its_own_rounding_loses(store_uri):
    api.train([*QUICK, "model=mlp", "precision=bf16_pure", "diagnostics.every=2",
               f"tracking.uri={store_uri}"])  # fmt: skip
    (run,) = all_runs(store_uri)
    history = client_for(store_uri).get_metric_history(run.info.run_id, "amp/update_lost_frac")
    assert [h.step for h in history] == [2, 4, 6]
    assert all(0.0 <= h.value <= 1.0 for h in history)
    assert "numerics.update_lost_layers" in run.data.tags


class Scores(nn.Module):
    """Attention-like scores inline in ``forward`` (``q @ k.T * scale``), then a softmax: the
    module's output is small, the op inside it is not."""

    def __init__(self, scale: float):
        super().__init__()
        self.q, self.k, self.scale = nn.Linear(4, 4), nn.Linear(4, 4), scale

    def forward(self, x):
        return torch.softmax(self.q(x) @ self.k(x).T * self.scale, -1) @ x


def test_the_op_with_the_least_headroom_inside_a_forward_is_named_with_its_module():
    torch.manual_seed(0)
    model = nn.Sequential(Scores(1e6), nn.Linear(4, 3))
    found = probe(model, batches(), default_objective())
    name, room = found.forward_headroom("fp16")
    assert name == "0 (its mul)" and room < 0  # not the softmax's output, which is below 1
    assert found.ops["0"]["mul"] > 65504 and found.fp16_overflow()[0][0] == "0"
    assert found.as_dict()["ops"]["0"]["matmul"] < found.ops["0"]["mul"]
