"""cli/doctor_fp8.py: the doctor's fp8 numerics gate. On examples/doctor's outlier_net, in
torchao's emulation on a CPU, it names fc2 (whose one outlier weight tensorwise scaling cannot
carry), prescribes precision.fp8.keep_bf16=[fc2], and --verify runs it as a sweep whose fp8
runs get the user's precision.fp8.emulate=true."""

from __future__ import annotations

import re

import pytest
from conftest import all_runs
from omegaconf import OmegaConf

from ampsweep.cli.doctor_fp8 import launch_settings

pytest.importorskip("torchao", reason="fp8 needs the fp8 extra: pip install -e '.[fp8]'")


@pytest.mark.slow
def test_the_gate_names_the_layer_prescribes_keep_bf16_and_verify_proves_it(
    project, main, store_uri
):
    res = main("doctor", "--verify", "--config-dir", "conf", "--modes", "fp8_tensorwise",
               "precision.fp8.emulate=true", "model=outlier_net", "trainer.max_steps=30",
               "trainer.epochs=2", "trainer.log_every=5")  # fmt: skip
    assert res.code == 0, res.err[-3000:]
    out = " ".join(res.out.split())  # the console wraps long lines
    gate = "fp8 gate (fp8_tensorwise vs bf16, SQNR of output/input grad/weight grad, 4 batches)"
    assert re.search(re.escape(gate) + r": under 20 dB: fc2 [\d.]+/[\d.]+/[\d.]+ dB (?!, fc3)", out)
    fix = "precision=fp8_tensorwise precision.fp8.keep_bf16=[fc2]"
    assert f"fp8_tensorwise: {fix}" in out
    assert "fp8 loses too much of fc2's output" in out
    verdict = out[out.index("verdict") :]
    assert f"doctor_fp8_tensorwise ({fix}): fixed: finite," in verdict
    assert "with precision.fp8.keep_bf16=[fc2]: fp8 gate" in verdict
    assert "every converted layer >= 20 dB" in verdict
    option = OmegaConf.load(project / "conf" / "precision" / "doctor_fp8_tensorwise.yaml")
    assert list(option.precision.fp8.keep_bf16) == ["fc2"]
    assert "precision.fp8.emulate=true" in out[out.index("launch it:") :].split("\n")[0]
    runs = all_runs(store_uri)
    assert len(runs) == 4  # the sweep's parent, fp32, fp8_tensorwise and the prescription
    emulated = [r for r in runs if r.data.params.get("precision.name", "").startswith("fp8")]
    assert len(emulated) == 2
    assert all(r.data.params["precision.fp8.emulate"] == "True" for r in emulated)


def test_the_sweep_gets_the_users_fp8_settings_but_not_their_keep_bf16():
    tuning = ["precision.fp8.emulate=true", "+precision.fp8.keep_first_last=false",
              "precision.fp8.keep_bf16=[fc1]", "precision.keep_fp32=[fc3]"]  # fmt: skip
    assert launch_settings(tuning) == tuning[:2]
