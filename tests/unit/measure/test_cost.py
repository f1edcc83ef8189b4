"""measure/cost.py: the median step time, with the warm-up steps left out; FLOPs of one
training step (counted, not assumed), the GPU peak table, and the speed metrics TFLOPS and MFU
on numbers worked out by hand."""

from __future__ import annotations

import pytest
import torch

from ampsweep.config import compose as config
from ampsweep.engine import build as train
from ampsweep.engine import loop
from ampsweep.measure import cost
from ampsweep.measure.cost import StepTimer
from ampsweep.precision.modes import PrecisionConfig
from ampsweep.precision.policy import build_policy


def test_the_median_leaves_out_the_warm_up_steps(monkeypatch):
    # Five steps, the first two warm-up (the clock is not even read); the other three take 5,
    # 9 and 7 ms, so the median is 7 ms.
    ticks = iter([0.0, 0.005, 1.0, 1.009, 2.0, 2.007])
    monkeypatch.setattr(cost.time, "perf_counter", lambda: next(ticks, 9.0))
    timer = StepTimer(torch.device("cpu"), warmup=2)
    for _ in range(5):
        timer.start()
        timer.stop()
    assert [round(t, 6) for t in timer.times_ms()] == [5.0, 9.0, 7.0]
    assert round(timer.median_ms(), 6) == 7.0
    assert round(timer.last_ms(), 6) == 7.0


def test_no_step_after_the_warm_up_means_no_time():
    timer = StepTimer(torch.device("cpu"), warmup=3)
    for _ in range(3):
        timer.start()
        timer.stop()
    assert timer.median_ms() is None and timer.last_ms() is None


CPU = torch.device("cpu")


def policy(mode: str):
    return build_policy(PrecisionConfig(name=mode), CPU)


def test_train_step_flops_of_a_linear_layer_match_the_formula():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5))
    x, y = torch.randn(8, 3, 2, 2), torch.randint(0, 5, (8,))
    # forward 2*B*in*out; backward: grad of the weight (2*B*in*out) only, the input needs none
    assert cost.train_step_flops(model, x, y, policy("fp32")) == 2 * (2 * 8 * 12 * 5)
    three = cost.train_step_flops(model, x, y, policy("fp32"), micro_batches=3)
    assert three == 3 * 2 * (2 * 8 * 12 * 5)


def test_counting_leaves_the_run_state_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Dropout()
    )
    model.append(torch.nn.Linear(4 * 6 * 6, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(5, 1, 8, 8), torch.randint(0, 3, (5,))
    rng = torch.get_rng_state()
    assert cost.train_step_flops(model, x, y, policy("bf16")) > 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize(
    "name, label",
    [
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla T4", "T4"),
    ],
)
def test_known_gpus_are_found(name, label):
    assert cost.lookup_peak(name)[0] == label


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA GH200 480GB", "NVIDIA B300", "Mystery"])
def test_unknown_or_different_parts_get_no_peak(name):
    assert cost.lookup_peak(name) is None


def test_peaks_are_dense_and_per_dtype():
    h200 = cost.lookup_peak("NVIDIA H200")[1]
    assert (h200.fp32, h200.tf32, h200.bf16) == (67.0, 494.5, 989.5)
    a100 = cost.lookup_peak("NVIDIA A100-SXM4-40GB")[1]
    assert (a100.fp32, a100.tf32, a100.fp16, a100.bf16) == (19.5, 156.0, 312.0, 312.0)
    assert cost.peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # Volta has no bf16


def test_math_kind_follows_the_mode():
    assert [policy(m).mode.flop_kind for m in ("fp32", "fp16", "bf16", "bf16_pure")] == [
        "fp32",
        "fp16",
        "bf16",
        "bf16",
    ]


def test_speed_metrics_on_cpu_have_tflops_but_no_mfu():
    out = cost.speed_metrics(2 * 10**12, 500.0, CPU, policy("fp32"))
    assert out["perf/tflops"] == pytest.approx(4.0)
    assert "perf/mfu" not in out


def test_a_run_records_tflops_of_its_known_flops_over_its_step_time(quick, monkeypatch):
    """The mlp of width 8 on digits: Linear 64->32, 32->32, 32->10, batches of 64, two
    micro-batches a step. Forward 2*64*(64*32 + 32*32 + 32*10) = 434,176 FLOPs; backward the
    same again for the weight gradients plus 2*64*(32*32 + 32*10) = 172,032 for the input
    gradients of the two upper layers: 1,040,384 per micro-batch, 2,080,768 per step. At 8 ms
    a step that is 2,080,768 / 0.008 s = 2.60096e8 FLOP/s = 2.60096e-4 TFLOPS."""
    from ampsweep.measure.cost import StepTimer

    monkeypatch.setattr(StepTimer, "median_ms", lambda self: 8.0)
    cfg = config.load([
        *quick, "tracking=none", "precision=fp32", "model=mlp", "model.width=8",
        "trainer.grad_accum_steps=2",
    ])  # fmt: skip
    summary = loop.fit(train.build(cfg), lambda m, s: None)
    assert summary["perf/gflops_per_step"] == pytest.approx(0.002080768)
    assert summary["perf/tflops"] == pytest.approx(2.60096e-4)
    assert "perf/mfu" not in summary  # no peak on a CPU


def test_mfu_divides_by_the_peak_of_the_gpu_and_the_modes_math(monkeypatch):
    # 494.5 TFLOPS is the H200's dense TF32 peak; bf16 runs against 989.5.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    out = cost.speed_metrics(98_900_000_000, 1000.0, cuda, policy("bf16"))  # 0.0989 TFLOPS
    assert out["perf/tflops"] == pytest.approx(0.0989)
    assert out["perf/mfu"] == pytest.approx(0.0989 / 989.5)
    unknown = cost.speed_metrics(10**12, 1000.0, cuda, policy("fp32"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU")
    assert "perf/mfu" not in cost.speed_metrics(10**12, 1000.0, cuda, policy("fp32"))
    assert unknown["perf/mfu"] == pytest.approx(1.0 / 67.0)  # H200 fp32: 67 TFLOPS
    assert cost.speed_metrics(0, 10.0, cuda, policy("fp32")) == {}
    assert cost.speed_metrics(10**9, None, cuda, policy("fp32")) == {}
