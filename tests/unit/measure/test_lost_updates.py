"""measure/lost_updates.py: half an ulp of each format, the share of an optimizer step's
updates a half-precision weight rounds away (from the optimizer's own state, the run's weights
untouched), and a pure run measuring it on its own steps."""

from __future__ import annotations

import torch
from conftest import QUICK, all_runs
from torch import nn

from ampsweep.app import api
from ampsweep.measure.lost_updates import half_ulp, update_lost_shares
from ampsweep.tracking.store import client_for


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
