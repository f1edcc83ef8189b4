"""Capacity: memory sizes, the max-batch prediction, the largest-batch search, and what a run
measures (bytes per sample, the model's memory by dtype) on a model small enough to count by
hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampsweep.measure import capacity
from ampsweep.measure.memory import capacity_metrics
from ampsweep.precision.modes import PrecisionConfig
from ampsweep.precision.policy import build_policy


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 1024**3),
        ("80 GiB", 80 * 1024**3),
        ("40GB", 40 * 10**9),
        ("512MiB", 512 * 1024**2),
        ("1.5TiB", int(1.5 * 1024**4)),
        ("80gib", 80 * 1024**3),
        ("4096", 4096),
    ],
)
def test_sizes_as_people_write_them(text, expected):
    assert capacity.parse_size(text) == expected


@pytest.mark.parametrize("text", ["80 apples", "GiB", "-3GiB", "0GiB", "eighty", "", "1e3GB"])
def test_what_is_not_a_size(text):
    with pytest.raises(capacity.SizeError, match="not a memory size"):
        capacity.parse_size(text)


def test_format_size():
    assert capacity.format_size(80 * 1024**3) == "80 GiB"
    assert capacity.format_size(139.8 * 1024**3) == "140 GiB"
    assert capacity.format_size(512 * 1024**2) == "512 MiB"


def test_predicted_max_batch():
    gib = 1024**3
    assert capacity.predict_max_batch(80 * gib, 2 * gib, 1024**2) == 78 * 1024
    assert capacity.predict_max_batch(1000, 200, 3) == 266  # floor(800 / 3)
    assert capacity.predict_max_batch(100, 200, 3) == 0  # the model alone does not fit
    assert capacity.predict_max_batch(100, 0, 0) is None  # nothing measured


def test_per_sample_from_two_batch_sizes():
    # 4096 bytes whatever the batch, plus 392 a sample
    fixed, slope = capacity.per_sample({64: 4096 + 64 * 392, 32: 4096 + 32 * 392})
    assert (fixed, slope) == (4096, 392)


class Fits:
    """A fake device: a batch fits when it is at most ``largest``; counts the tries."""

    def __init__(self, largest: int):
        self.largest, self.calls = largest, []

    def __call__(self, batch: int) -> bool:
        self.calls.append(batch)
        return batch <= self.largest


@pytest.mark.parametrize(("largest", "start"), [(37, 8), (1000, 64), (64, 64), (5, 64), (1, 4)])
def test_the_search_finds_the_exact_largest_batch(largest, start):
    fits = Fits(largest)
    found = capacity.search(fits, start, limit=1 << 20)
    assert found.largest == largest
    assert found.first_failure == largest + 1  # it saw the edge from both sides
    assert [b for b, _ in found.tried] == fits.calls
    # doubling (or halving) then bisecting: a logarithmic number of tries
    assert len(fits.calls) <= 2 * math.ceil(math.log2(max(largest, start) + 1)) + 2


def test_the_search_doubles_then_bisects():
    fits = Fits(37)
    capacity.search(fits, 8, limit=1000)
    assert fits.calls == [8, 16, 32, 64, 48, 40, 36, 38, 37]


def test_the_search_stops_at_its_limit_and_when_nothing_fits():
    found = capacity.search(Fits(10**9), 8, limit=100)
    assert found.largest == 100 and found.limit_reached
    nothing = capacity.search(Fits(0), 8, limit=100)
    assert nothing.largest == 0 and [b for b, _ in nothing.tried] == [8, 4, 2, 1]
    with pytest.raises(ValueError):
        capacity.search(Fits(3), 0, limit=10)


def two_layers(mode: str):
    """Linear(64, 64), ReLU, Linear(64, 32) after one AdamW step, and a batch of 16."""
    torch.manual_seed(0)
    policy = build_policy(PrecisionConfig(name=mode), torch.device("cpu"))
    model = policy.prepare_model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)))
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(16, 64, dtype=policy.param_dtype), torch.randint(0, 32, (16,))
    with policy.autocast():
        nn.functional.cross_entropy(model(x).float(), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    return capacity_metrics(model, optimizer, x, y, policy)


MIB = 1024**2


def test_fp32_bytes_per_sample_and_model_memory_by_hand():
    m = two_layers("fp32")
    # Saved for backward, per sample: the input (64 fp32 = 256 B; the first layer needs it for
    # its weight gradient), ReLU's output (256 B, which the second layer saves too: counted
    # once), log_softmax's output (32 fp32 = 128 B) and the label (int64, 8 B).
    assert m["mem/activation_bytes_per_sample"] == 256 + 256 + 128 + 8
    params = (64 * 64 + 64 + 64 * 32 + 32) * 4  # 24,960 B
    assert m["mem/params_fp32_mib"] * MIB == params
    assert m["mem/grads_fp32_mib"] * MIB == params
    # AdamW: exp_avg and exp_avg_sq per parameter, and a float32 step count per tensor (4)
    assert m["mem/optimizer_fp32_mib"] * MIB == 2 * params + 4 * 4
    assert m["mem/model_mib"] * MIB == 4 * params + 16
    assert "mem/autocast_cache_mib" not in m  # fp32 keeps no copies
    assert "mem/max_batch_predicted" not in m  # on a CPU no budget is assumed


def test_bf16_halves_the_samples_and_adds_weight_copies():
    m = two_layers("bf16")
    # bf16 input copy 128 B, ReLU output 128 B, log_softmax of the fp32 logits 128 B, label 8 B
    assert m["mem/activation_bytes_per_sample"] == 128 + 128 + 128 + 8
    # autocast's bf16 copy of the second layer's weight, saved to compute the input gradient
    # whatever the batch (the first layer's is not: its input needs no gradient)
    assert m["mem/autocast_cache_bf16_mib"] * MIB == 64 * 32 * 2
    assert m["mem/params_fp32_mib"] * MIB == 24960  # the fp32 master weights stay


def test_pure_bf16_keeps_bf16_parameters_gradients_and_optimizer_state():
    m = two_layers("bf16_pure")
    assert m["mem/params_bf16_mib"] * MIB == 24960 / 2
    assert m["mem/grads_bf16_mib"] * MIB == 24960 / 2
    assert m["mem/optimizer_bf16_mib"] * MIB == 24960
    assert "mem/params_fp32_mib" not in m


# ---------------------------------------------------------------- the step's parts, predicted

FP32_STEP = {"params": 4.0, "grads": 4.0, "optimizer": 8.0, "activations": 32.0, "other": 4.0}


def test_another_batch_grows_the_activations_and_other_with_it():
    bd = capacity.Breakdown("fp32", 16, dict(FP32_STEP))
    assert bd.per_sample == 2.0 * capacity.MIB  # 32 MiB at 16
    at64 = bd.at(64)
    assert at64.parts["activations"] == pytest.approx(128.0)
    assert at64.parts["other"] == pytest.approx(16.0)  # scales with the activations
    assert at64.parts["optimizer"] == 8.0 and not at64.measured and bd.measured
    assert at64.total == pytest.approx(4 + 4 + 8 + 128 + 16)


def test_every_other_mode_from_the_mode_table():
    bd = capacity.Breakdown("fp32", 16, dict(FP32_STEP))
    bf16, pure, fp8 = bd.at(mode="bf16"), bd.at(mode="bf16_pure"), bd.at(mode="fp8_rowwise")
    assert bf16.parts["params"] == 4.0 and bf16.parts["activations"] == 16.0
    assert bf16.parts["autocast_cache"] == 2.0 and bf16.estimated == ("autocast_cache",)
    assert pure.parts["params"] == 2.0 and pure.parts["optimizer"] == 4.0
    assert pure.parts["autocast_cache"] == 0.0 and pure.parts["activations"] == 16.0
    assert fp8.parts["fp8"] == 1.0 and fp8.parts["autocast_cache"] == 2.0
    # a measured cache carries over to another autocast mode; fp32 has none
    measured = capacity.Breakdown("bf16", 16, {**FP32_STEP, "autocast_cache": 1.5})
    assert measured.at(mode="fp16").parts["autocast_cache"] == 1.5
    assert measured.at(mode="fp16").estimated == ()
    assert measured.at(mode="fp32").parts["autocast_cache"] == 0.0
    assert measured.at(mode="fp32").parts["activations"] == 64.0


def test_the_largest_batch_of_each_mode_for_a_budget():
    bd = capacity.Breakdown("fp32", 16, dict(FP32_STEP))
    # fp32: 16 MiB fixed + 2.25 MiB a sample (other grows with the activations, 1/8 of them)
    assert bd.max_batch(1024 * capacity.MIB) == math.floor((1024 - 16) / 2.25)
    assert bd.max_batch(10 * capacity.MIB) == 0
    kinds = capacity.by_mode(bd, 64, 1024 * capacity.MIB)
    names = {n[0]: (b, largest) for n, b, largest in kinds}
    assert set(names) == {"fp32", "bf16", "bf16_pure", "fp8_tensorwise"}
    assert names["bf16"][1] == math.floor((1024 - 18) / 1.125)
    assert names["bf16_pure"][0].batch == 64


def test_a_runs_metrics_as_its_breakdown_old_names_included():
    old = {"mem/params_mib": 1.0, "mem/weight_copies_mib": 0.5, "mem/activation_mib": 3.5}
    bd = capacity.breakdown(old, "bf16", 8)
    assert bd is not None
    assert bd.parts["autocast_cache"] == 0.5 and bd.parts["activations"] == 3.0
    assert capacity.breakdown({"mem/activation_mib": 1.0}, "bf16", 8) is None
    assert capacity.breakdown(old, "no_such_mode", 8) is None


def test_a_peak_in_the_optimizers_step_holds_until_backwards_outgrows_it():
    # AdamW's step: 16 MiB of weights, gradients and state, 8 MiB of its temporaries; backward
    # saved 1 MiB of activations at batch 16 (and, in bf16, 2 MiB of weight copies)
    metrics = {"mem/params_mib": 4.0, "mem/grads_mib": 4.0, "mem/optimizer_mib": 8.0}
    metrics |= {"mem/other_mib": 8.0, capacity.AT_OPTIMIZER: 1.0, capacity.SAVED: 3.0}
    bd = capacity.breakdown(metrics, "bf16", 16)
    assert bd is not None and bd.at_optimizer and bd.copies == 2.0 and bd.saved == 1.0
    assert bd.at(64).total == 24.0  # backward's 16 + 2 + 4 MiB: the optimizer's peak stands
    at256 = bd.at(256)  # backward's 16 + 2 + 16 MiB outgrow it
    assert at256.total == 34.0 and at256.parts["activations"] == 16.0
    assert at256.parts["autocast_cache"] == 2.0 and at256.parts["other"] == 0.0
    assert bd.max_batch(40 * capacity.MIB) == 16 * 22  # (40 - 18) MiB at 1/16 MiB a sample
    assert bd.max_batch(20 * capacity.MIB) == 0  # the optimizer's step alone does not fit
    pure = bd.at(mode="bf16_pure")
    assert pure.total == 12.0 and pure.copies == 0.0  # temporaries halve with the weights


def test_fp32_master_weights_are_predicted_as_a_pure_modes_fp32_copies_and_state():
    # fp32's step with AdamW: 4 + 4 + 8 B a parameter (1 Mi of them), 10 MiB saved for backward
    metrics = {"mem/params_mib": 4.0, "mem/grads_mib": 4.0, "mem/optimizer_mib": 8.0}
    metrics |= {"mem/activations_mib": 10.0, "mem/other_mib": 1.0}
    fp32 = capacity.breakdown(metrics, "fp32", 8)
    assert fp32 is not None and not fp32.master_weights
    masters = fp32.at(mode="bf16_pure", master_weights=True)
    assert masters.master_weights
    parts = {k: masters.parts[k] for k in ("params", "master_weights", "grads", "optimizer")}
    assert parts == {"params": 2.0, "master_weights": 4.0, "grads": 2.0, "optimizer": 8.0}
    assert masters.parts["activations"] == 5.0
    # the weights take as much as fp32's (16 B a parameter): the saving is the activations'
    held = ("params", "master_weights", "grads", "optimizer")
    assert sum(masters.parts[k] for k in held) == sum(fp32.parts[k] for k in held[:1] + held[2:])
    assert fp32.at(mode="bf16_pure").parts["optimizer"] == 4.0  # without: state in bf16
    assert not fp32.at(mode="bf16", master_weights=True).master_weights  # a pure mode's only
    # and back: a run that kept them predicts the pure mode without them, and fp32
    back = capacity.breakdown({f"mem/{k}_mib": v for k, v in masters.parts.items()}, "bf16_pure", 8)
    assert back is not None and back.master_weights and back.at().master_weights
    assert back.at(master_weights=False).parts["master_weights"] == 0.0
    assert back.at(master_weights=False).parts["optimizer"] == 4.0
    assert back.at(mode="fp32").parts["optimizer"] == 8.0
    assert back.at(mode="fp32").parts["master_weights"] == 0.0


def test_master_weights_at_a_peak_in_the_optimizers_step_hold_fp32_copies_of_the_gradients():
    # fp32's AdamW step (1 Mi parameters): 16 MiB held and 8 MiB of its intermediate results
    metrics = {"mem/params_mib": 4.0, "mem/grads_mib": 4.0, "mem/optimizer_mib": 16.0}
    metrics |= {capacity.AT_OPTIMIZER: 1.0, capacity.INTERMEDIATES: 8.0}
    fp32 = capacity.breakdown(metrics, "fp32", 2)
    assert fp32 is not None
    masters = fp32.at(mode="bf16_pure", master_weights=True)
    # the step casts the bf16 gradients (2 MiB) into fp32 ones (4 MiB): 2 MiB more in it
    assert masters.parts["optimizer"] == 18.0 and masters.intermediates == 10.0
    assert masters.total == 2.0 + 4.0 + 2.0 + 18.0  # 2 MiB over fp32's: the bf16 weights
    assert masters.at(mode="fp32").total == fp32.total


def test_the_gradients_of_activations_grow_with_the_batch_and_take_the_compute_dtype():
    bd = capacity.Breakdown("fp32", 16, {**FP32_STEP, "activation_grads": 8.0})
    assert bd.at(64).parts["activation_grads"] == pytest.approx(32.0)
    assert bd.at(mode="bf16").parts["activation_grads"] == pytest.approx(4.0)
    assert bd.at(mode="bf16_pure").parts["activation_grads"] == pytest.approx(4.0)


def test_the_optimizers_intermediate_results_are_not_held_in_a_larger_batchs_backward():
    # A peak in AdamW's step: 4 + 4 MiB of weights and gradients, 8 MiB of state and 4 MiB of
    # its intermediate results; 1 MiB saved for backward at batch 2
    metrics = {"mem/params_mib": 4.0, "mem/grads_mib": 4.0, "mem/optimizer_mib": 12.0}
    metrics |= {capacity.AT_OPTIMIZER: 1.0, capacity.INTERMEDIATES: 4.0, capacity.SAVED: 1.0}
    bd = capacity.breakdown(metrics, "fp32", 2)
    assert bd is not None and bd.intermediates == 4.0 and bd.held == 16.0 and bd.total == 20.0
    # backward's peak, 16 MiB held and 0.5 MiB a sample saved, fits 20 MiB up to batch 8
    assert bd.max_batch(20 * capacity.MIB) == 8
    at16 = bd.at(16)  # backward's peak now: the state without the intermediate results
    assert at16.parts["optimizer"] == 8.0 and at16.parts["activations"] == 8.0
    assert at16.total == 24.0 and at16.intermediates == 0.0
    assert bd.at(mode="bf16_pure").intermediates == 2.0  # in the dtype of the state
