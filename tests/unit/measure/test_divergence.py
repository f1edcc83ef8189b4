"""measure/divergence.py: a run whose loss stays non-finite is stopped, but not a dynamic
scaler that is still lowering its scale."""

from __future__ import annotations

import pytest
import torch

from ampsweep.measure.divergence import Diverged, NonfiniteWatch
from ampsweep.precision.policy import StaticGradScaler


def test_watch_ignores_a_scaler_still_lowering_its_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    watch = NonfiniteWatch(3, 1.0, scaler)
    nan, skipped = torch.tensor(float("nan")), torch.tensor(1.0)
    for scale in (4.0, 2.0, 1.0, 0.5, 0.25):  # backing off: only scales below 1.0 count
        scaler._scale.fill_(scale)
        watch.observe(nan, skipped, scaler)
    assert watch.count() == 2
    watch.check(5)  # 2 < 3: not yet
    scaler._scale.fill_(0.125)
    watch.observe(nan, skipped, scaler)
    with pytest.raises(Diverged, match="non-finite for 3 consecutive steps") as err:
        watch.check(6)
    assert "with the loss scale below 1" in str(err.value) and "stopped at step 6" in str(err.value)
    assert err.value.tags == {"diverged": "true"}
    static = NonfiniteWatch(2, 1.0, StaticGradScaler("cpu", init_scale=8.0))
    static.observe(torch.tensor(1.0), skipped, None)  # a static scale never recovers: counts
    static.observe(torch.tensor(1.0), torch.tensor(0.0), None)  # a clean step resets
    assert static.count() == 0


def test_without_a_scaler_only_the_loss_counts():
    off = torch.amp.GradScaler("cpu", enabled=False)
    watch = NonfiniteWatch(2, 1.0, off)
    watch.observe(torch.tensor(float("inf")), torch.tensor(0.0), off)
    watch.observe(torch.tensor(1.0), torch.tensor(0.0), off)  # a finite loss resets the run
    watch.observe(torch.tensor(float("nan")), torch.tensor(0.0), off)
    watch.check(3)
    watch.observe(torch.tensor(float("nan")), torch.tensor(0.0), off)
    with pytest.raises(Diverged, match="loss non-finite for 2 consecutive steps \\(stopped"):
        watch.check(4)


def test_a_limit_of_zero_never_stops():
    off = torch.amp.GradScaler("cpu", enabled=False)
    watch = NonfiniteWatch(0, 1.0, off)
    for _ in range(50):
        watch.observe(torch.tensor(float("nan")), torch.tensor(0.0), off)
    watch.check(50)
    assert watch.count() == 0


def test_a_resumed_run_continues_its_count():
    off = torch.amp.GradScaler("cpu", enabled=False)
    watch = NonfiniteWatch(3, 1.0, off, start=2)
    watch.observe(torch.tensor(float("nan")), torch.tensor(0.0), off)
    with pytest.raises(Diverged):
        watch.check(7)


def test_gradscaler_still_keeps_its_scale_as_a_tensor_on_the_device():
    # NonfiniteWatch reads GradScaler's private scale tensor, without a sync (torch 2.14.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    assert isinstance(scaler._scale, torch.Tensor)  # noqa: SLF001
    assert scaler._scale.item() == scaler.get_scale() == 8.0  # noqa: SLF001
