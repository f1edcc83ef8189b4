"""precision/modes.py: the table of precision modes and the precision section of the config."""

from __future__ import annotations

from ampsweep.precision import modes
from ampsweep.precision.modes import MODES, PrecisionConfig, ScalerConfig

CPU_MODES = [name for name, mode in MODES.items() if "cpu" in mode.devices]


def test_cpu_modes_cover_every_mode_but_the_cuda_only_ones():
    assert set(CPU_MODES) == set(MODES) - {"tf32", "fp16_pure"}


def test_every_cuda_only_mode_names_its_fallback():
    for mode in MODES.values():
        if "cpu" not in mode.devices:
            assert mode.fallback, mode.name


def test_derived_properties():
    assert [n for n, m in MODES.items() if m.unscaled_fp16] == ["fp16_noscale"]
    assert [n for n, m in MODES.items() if not m.half] == ["fp32", "tf32"]
    assert {n: m.flop_kind for n, m in MODES.items()}["tf32"] == "tf32"
    assert not MODES["fp16_pure"].full_range and MODES["bf16_pure"].full_range


def test_auto_picks_by_hardware():
    assert modes.auto_mode("cpu", bf16_supported=True) == "fp32"
    assert modes.auto_mode("cuda", bf16_supported=True) == "bf16"
    assert modes.auto_mode("cuda", bf16_supported=False) == "fp16"


def test_every_mode_has_its_own_chart_colour():
    colours = [modes.color(n) for n in MODES]
    assert len(set(colours)) == len(colours)
    assert modes.color("fp8_future") == "#777777"  # a mode this table lacks: grey


def test_problems_of_the_precision_section():
    assert modes.problems(PrecisionConfig(name="fp8")) == [
        f"precision.name=fp8: invalid value: choose one of {', '.join(modes.NAMES)}"
    ]
    assert modes.problems(PrecisionConfig(name="auto")) == []
    contradiction = modes.problems(PrecisionConfig(name="fp16", pure=True))
    assert contradiction == [
        "precision.pure=True contradicts precision=fp16, which means pure=False: pick the mode "
        "with precision=<mode> instead of setting precision.pure"
    ]
    scaled_pure = PrecisionConfig(name="bf16_pure", scaler=ScalerConfig(enabled=True))
    assert "GradScaler refuses fp16/bf16 gradients" in modes.problems(scaled_pure)[0]
    for name in ("fp32", "bf16", "auto"):  # fp32 weights already: nothing to keep beside them
        (problem,) = modes.problems(PrecisionConfig(name=name, master_weights=True))
        assert problem.startswith("precision.master_weights=true needs a pure mode")
        assert f"precision={name} updates fp32 weights already" in problem
    assert modes.problems(PrecisionConfig(name="bf16_pure", master_weights=True)) == []
