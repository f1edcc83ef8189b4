"""Each mode's predicted step from a traced one: a step of tiny kernels is called launch-bound,
one of large matmuls gains from half precision and fp8."""

import pytest

from ampsweep.measure.prediction import HELPS, LOSS, OPTIMIZER, Model, against_measured, predict
from ampsweep.measure.roofline import gpu_spec, linear_times
from ampsweep.measure.trace import Op


def tiny() -> Model:
    """A hundred elementwise kernels of a few kilobytes, and one small matmul."""
    ops = [Op("relu", f"act{i}", False, 0.0, 8192, 0) for i in range(100)]
    ops.append(Op("mm", "fc", False, 2.0 * 64 * 64 * 64, 3 * 64 * 64 * 4, 0, (64, 64, 64)))
    return Model(ops, {"fc": 64 * 64}, params=64 * 64, optimizer_states=2)


def large() -> Model:
    """One large Linear layer's three matmuls (fp8 converts it)."""
    m = k = n = 8192
    fwd = Op("mm", "fc", False, 2.0 * m * k * n, 3 * m * k * 4, 0, (m, k, n))
    bwd = [Op("mm", "fc", True, 2.0 * m * k * n, 3 * m * k * 4, 0) for _ in range(2)]
    return Model([fwd, *bwd], {"fc": k * n}, k * n, 2, frozenset({"fc"}), types={"fc": "Linear"})


def test_a_step_of_tiny_kernels_is_launch_bound_and_no_mode_is_sold_as_a_speedup():
    prediction = predict(gpu_spec("h100"), tiny())
    assert all((prediction.speedup(m) or 0) < HELPS for m in prediction.modes)
    verdict = prediction.verdict()
    assert verdict.startswith("no mode is predicted to help this model on an H100 SXM: its GEMMs")
    assert "launch-bound" in verdict and "%" in verdict
    assert prediction.shares()["launch"] > 0.9
    # autocast adds the weight's casts: more kernels than fp32, so slower
    assert prediction.modes["bf16"].step_s > prediction.modes["fp32"].step_s
    assert set(prediction.modes["fp32"].layers) >= {"fc", "act0", OPTIMIZER}
    assert LOSS not in prediction.modes["fp32"].layers  # every op here is in a module


def test_large_matmuls_gain_from_half_precision_and_more_from_fp8():
    prediction = predict(gpu_spec("h100"), large())
    bf16, fp8 = prediction.speedup("bf16"), prediction.speedup("fp8_tensorwise")
    assert bf16 is not None and fp8 is not None and 5 < bf16 < fp8  # fp32 runs on CUDA cores
    assert prediction.speedup("tf32", "tf32") == 1.0
    assert prediction.verdict().startswith("fp8_")
    layer = prediction.modes["fp8_tensorwise"].layers["fc"]
    assert layer.fp8 and layer.type == "Linear" and layer.bound == "compute"
    assert layer.flops == pytest.approx(3 * 2.0 * 8192**3)


def test_a_gpu_without_fp8_or_bf16_names_the_modes_it_cannot_run():
    prediction = predict(gpu_spec("v100"), large())
    assert prediction.cannot["bf16"] == "the V100 SXM2 has no bf16 tensor cores"
    assert prediction.cannot["fp8_rowwise"] == "the V100 SXM2 has no fp8 tensor cores"
    assert "fp16" in prediction.modes and "tf32" not in prediction.modes


def test_fp8_layers_unknown_leave_fp8_unpredicted_with_the_reason():
    model = Model(large().ops, {"fc": 1}, 1, 2, fp8_layers=None)
    prediction = predict(gpu_spec("h100"), model)
    assert "forward pass this model fails" in prediction.cannot["fp8_tensorwise"]
    assert "bf16" in prediction.modes


def test_a_linear_is_timed_by_linear_times_in_every_mode_and_without_a_grad_input_it_skips():
    """One account of a Linear's matmuls: the mode's step and fp8's layer filter agree."""
    h100 = gpu_spec("h100")
    prediction = predict(h100, large())
    for mode, fmt in (("fp32", "fp32"), ("tf32", "tf32"), ("bf16", "bf16"), ("fp16_pure", "fp16")):
        layer = prediction.modes[mode].layers["fc"]
        assert layer.math_s == pytest.approx(linear_times(h100, 8192, 8192, 8192, fmt).matmul_s)
    fp8 = prediction.modes["fp8_tensorwise"].layers["fc"].math_s
    assert fp8 == pytest.approx(linear_times(h100, 8192, 8192, 8192, "fp8_tensorwise").matmul_s)
    # a first layer on the data: autograd computes its weight's gradient only
    m, k, n = 4096, 1024, 8192
    fwd = Op("addmm", "fc", False, 2.0 * m * k * n, 0, 0, (m, k, n))
    grad_weight = Op("mm", "fc", True, 2.0 * m * k * n, 0, 0, (n, m, k))
    first = Model([fwd, grad_weight], {"fc": k * n}, k * n, 2, types={"fc": "Linear"})
    layer = predict(h100, first).modes["bf16"].layers["fc"]
    two = linear_times(h100, m, k, n, "bf16", grad_input=False)
    assert len(two.kernels) == 2 and layer.math_s == pytest.approx(two.matmul_s)
    assert layer.flops == pytest.approx(2 * 2.0 * m * k * n)


def test_a_runs_prediction_against_its_measured_step_is_negative_when_predicted_faster():
    h100 = gpu_spec("h100")
    bf16 = predict(h100, large()).modes["bf16"].step_s * 1e3
    from ampsweep.precision.modes import MODES

    got = against_measured(h100, large(), MODES["bf16"], measured_ms=2 * bf16)
    assert got == pytest.approx({"predict/step_ms": bf16, "predict/error_pct": -50.0})
    slower = against_measured(h100, large(), MODES["bf16"], measured_ms=bf16 / 2)
    assert slower["predict/error_pct"] == pytest.approx(100.0)
    # a mode the GPU cannot run records nothing
    assert against_measured(gpu_spec("v100"), large(), MODES["bf16"], measured_ms=1.0) == {}
