"""The GPU table and the roofline: calibrated against torchao's measured float8 speed-ups."""

import json

import pytest

from ampsweep.measure import roofline
from ampsweep.measure.roofline import gpu_spec, linear_times

# torchao's float8 README (torchao/float8/README.md, "Performance"): measured on an H100, the
# speed-up of a float8 (tensorwise) Linear's forward and backward over bf16, by the forward's
# M, K, N. The model must land within TOLERANCE of each (docs/predict.md states the error).
MEASURED = [((1024, 2048, 1024), 0.80), ((4096, 8192, 16384), 1.39)]
TOLERANCE = 0.20


@pytest.mark.parametrize("shape, measured", MEASURED)
def test_fp8_linear_speedup_lands_near_torchaos_measurement(shape, measured):
    h100 = gpu_spec("h100")
    bf16 = linear_times(h100, *shape, "bf16")
    fp8 = linear_times(h100, *shape, "fp8_tensorwise")
    predicted = bf16.total_s / fp8.total_s
    assert abs(predicted - measured) / measured < TOLERANCE, predicted
    # and on the right side of 1: small shapes lose, large ones gain
    assert (predicted > 1) == (measured > 1)


def test_a_small_linear_is_bound_by_casts_and_launches_a_large_one_by_compute():
    h100 = gpu_spec("h100")
    small = linear_times(h100, 64, 256, 256, "fp8_rowwise")
    assert {k.bound for k in small.kernels} == {"launch"}
    large = linear_times(h100, 8192, 8192, 8192, "bf16")
    assert [k.bound for k in large.kernels] == ["compute"] * 3
    # forward is one of the three matmuls of the same size: about a third of the whole
    assert large.forward_s == pytest.approx(large.total_s / 3, rel=0.01)


def test_fp8_forward_carries_the_casts_of_input_and_weight():
    h100 = gpu_spec("h100")
    fp8 = linear_times(h100, 4096, 4096, 4096, "fp8_tensorwise")
    bf16 = linear_times(h100, 4096, 4096, 4096, "bf16")
    assert len(fp8.forward) == 7 and len(bf16.forward) == 1
    # an fp8 matmul alone is about twice as fast as bf16's; the casts eat part of the gain
    assert 1.2 < bf16.total_s / fp8.total_s < 2.0


def test_a_wave_of_tiles_is_paid_in_full():
    """A matmul with fewer output tiles than multiprocessors takes as long as a full wave."""
    h100 = gpu_spec("h100")
    side = 128 * 11  # 121 tiles: one wave on 132 multiprocessors
    four_tiles = roofline.matmul(h100, 256, 1000, 256, "bf16", 2, 2)
    full_wave = roofline.matmul(h100, side, 1000, side, "bf16", 2, 2)
    two_waves = roofline.matmul(h100, side, 1000, side + 128 * 2, "bf16", 2, 2)
    assert four_tiles.bound == full_wave.bound == "compute"
    assert four_tiles.seconds == pytest.approx(full_wave.seconds, rel=0.01)
    assert two_waves.seconds == pytest.approx(2 * full_wave.seconds, rel=0.01)


def test_a_long_reduction_over_few_tiles_is_split_across_the_idle_multiprocessors():
    """A weight gradient over many rows (128 x 512 out, 65536 rows reduced): split-K spreads it
    over the GPU, so reading its inputs bounds it, not 4 tiles' multiprocessors of 132."""
    h100 = gpu_spec("h100")
    grad_weight = roofline.matmul(h100, 128, 65536, 512, "bf16", 2, 2)
    one_wave = h100.sms * 2.0 * 128 * 128 * 65536 / (h100.peak("bf16") * roofline.MATMUL_EFFICIENCY)
    assert grad_weight.bound == "memory" and grad_weight.seconds < one_wave / 10


@pytest.mark.parametrize(
    "name, label",
    [
        ("h100", "H100 SXM"),
        ("H200", "H200 SXM"),
        ("a100", "A100"),
        ("l4", "L4"),
        ("L40S", "L40S"),
        ("rtx4090", "RTX 4090"),
        ("RTX 4090", "RTX 4090"),
        ("b200", "B200"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ],
)
def test_gpus_are_found_by_key_label_or_cuda_name(name, label):
    assert gpu_spec(name).label == label


def test_every_gpu_has_a_bandwidth_and_multiprocessors():
    for gpu in roofline.GPUS:
        assert gpu.bandwidth > 0.1 and gpu.sms >= 40
        assert gpu.fp16 > gpu.fp32 and (gpu.fp8 is None or gpu.fp8 >= gpu.fp16)


def test_an_unknown_gpu_is_one_line_listing_the_known_ones():
    with pytest.raises(ValueError) as err:
        gpu_spec("h1000")
    message = str(err.value)
    assert "\n" not in message and "h1000" in message
    assert all(gpu.key in message for gpu in roofline.GPUS) and "--gpu-spec" in message


def test_a_format_the_gpu_lacks_is_refused():
    with pytest.raises(ValueError, match="no fp8 tensor cores"):
        linear_times(gpu_spec("a100"), 1024, 1024, 1024, "fp8_rowwise")


def test_a_gpu_spec_file_describes_any_other_gpu(tmp_path):
    path = tmp_path / "mygpu.json"
    spec = {"fp32": 50, "tf32": 200, "fp16": 400, "bf16": 400, "fp8": 800}
    path.write_text(json.dumps({**spec, "bandwidth": 2.0, "sms": 100}))
    gpu = roofline.load_gpu_spec(str(path))
    assert (gpu.key, gpu.fp8, gpu.bandwidth, gpu.sms) == ("mygpu", 800, 2.0, 100)
    path.write_text("fp32: 50\nfp16: 400\nbandwith: 2.0\nsms: 100\n")  # misspelt
    with pytest.raises(ValueError, match="missing bandwidth") as err:
        roofline.load_gpu_spec(str(path))
    assert "\n" not in str(err.value)
