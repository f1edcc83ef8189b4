"""``cli.prescription``'s fix for a pure mode, and the doctor asking for it: fp32 master
weights where a pure mode trained finite but lost its score or a layer's updates, the autocast
mode where it went non-finite (master weights leave fp16's range as it is), nothing for a pure
mode that held or for an autocast mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ampsweep.cli.prescription import Trial, pure_fix

BASE = Trial("fp32", ["precision=fp32"], score=0.94, peak_mib=1.0)
LOSING = {"(all)": 0.79, "norm.weight": 1.0, "fc1.weight": 0.94, "head.weight": 0.02}


def trial(mode: str, score: float, **kw) -> Trial:
    return Trial(mode, [f"precision={mode}"], score=score, steps=40, **kw)


@pytest.mark.parametrize("mode", ["bf16_pure", "fp16_pure"])
def test_a_pure_mode_that_lost_its_score_gets_master_weights(mode):
    rx = pure_fix(mode, trial(mode, 0.88), BASE, {"(all)": 0.03})
    assert rx is not None and rx.option == f"doctor_{mode}"
    assert rx.overrides == [f"precision={mode}", "precision.master_weights=true"]
    assert rx.precision == {"name": mode, "master_weights": True}
    dtype = mode.split("_")[0]
    assert f"finite, so not the range: {dtype} weights round away small updates (3.0%" in rx.problem
    assert f"or precision={dtype} (autocast, fp32 weights)" in rx.note


def test_a_pure_mode_that_held_but_loses_a_layers_updates_gets_master_weights():
    rx = pure_fix("bf16_pure", trial("bf16_pure", 0.94), BASE, LOSING)
    assert rx is not None and "precision.master_weights=true" in rx.overrides
    assert "bf16 weights round away the updates of norm.weight 100%, fc1.weight 94%" in rx.problem


def test_a_pure_mode_that_held_and_keeps_its_updates_needs_nothing():
    assert pure_fix("bf16_pure", trial("bf16_pure", 0.94), BASE, {"fc1.weight": 0.3}) is None


def test_a_pure_mode_that_overflowed_gets_the_autocast_mode_not_master_weights():
    overflowed = trial("fp16_pure", 0.1, status="diverged", error="16 of the last 16 (x): y")
    rx = pure_fix("fp16_pure", overflowed, BASE, LOSING)
    assert rx is not None and rx.overrides == ["precision=fp16"]
    assert not rx.precision.get("master_weights")


@pytest.fixture
def doctor(monkeypatch):
    """A doctor whose trials are given: the prescription's trial, with its step's peak."""
    from ampsweep.cli import doctor as doctor_cli

    doc = doctor_cli.Doctor(["model=mlp"], None, "bf16,bf16_pure")
    ran = []

    def fake_trial(mode, overrides):
        ran.append(overrides)
        return Trial(mode, overrides, score=0.939, steps=40, peak_mib=0.124)

    monkeypatch.setattr(doc, "trial", fake_trial)
    doc.ran = ran
    return doc


def test_the_doctor_prescribes_and_tries_master_weights_with_their_cost(doctor):
    found = SimpleNamespace(update_lost={"bf16": LOSING})
    failing = trial("bf16_pure", 0.88, peak_mib=0.0862)
    rx = doctor.prescribe("bf16_pure", failing, BASE, found)
    assert rx is not None and rx.trial is not None and rx.trial.held(BASE)
    assert doctor.ran == [["precision=bf16_pure", "precision.master_weights=true"]]
    assert rx.note.startswith("step peak 0.124 MiB, bf16_pure's 0.0862 MiB; fp32 copies")


def test_the_doctor_offers_no_master_weights_to_an_autocast_mode(doctor):
    found = SimpleNamespace(update_lost={"bf16": LOSING}, grad_underflow=lambda scale=None: 0.0)
    assert doctor.prescribe("bf16", trial("bf16", 0.88), BASE, found) is None
    assert doctor.ran == []
