"""A run too short to measure says why its figures are blank and what to set: in the report
(speed not timed, no verdict on quality beside a baseline that has not learned) and in the
Python API (a curve with no logged point)."""

from __future__ import annotations

import pytest

import ampsweep

# Two steps, all of them timing warm-up, logging every 10, at a learning rate that cannot
# move the weights: nothing can be timed, logged or learned.
SHORT = ["model=mlp", "model.width=8", "optimizer=sgd", "optimizer.lr=1e-9"]
SHORT += ["trainer.epochs=1", "trainer.max_steps=2", "trainer.progress=false"]
SHORT += ["trainer.log_every=10", "trainer.timing_warmup_steps=5"]


def test_a_short_sweep_says_why_its_figures_are_blank(store_uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = ampsweep.sweep(["precision=fp32,bf16", *SHORT, f"tracking.uri={store_uri}"])
    assert {r.speedup for r in result.rows} == {None}
    (untimed,) = [f for f in result.findings if "too few steps to time" in f]
    assert untimed == (
        "Samples/s and speed-up are blank for fp32-mlp-digits, bf16-mlp-digits: too few steps "
        "to time (2 trained, the first 5 untimed as warm-up): set trainer.max_steps above 5 "
        "(or trainer.timing_warmup_steps below 2)."
    )
    assert not [f for f in result.findings if " held within" in f]  # beside a baseline at chance
    (verdict,) = [f for f in result.findings if f.startswith("No verdict on quality")]
    assert verdict.endswith("the baseline has not learned.")
    assert "for bf16:" in verdict

    (run,) = [r for r in result.runs if r.name == "bf16-mlp-digits"]
    with pytest.raises(ValueError) as err:
        run.curve("train/loss")
    assert str(err.value) == (
        "train/loss: no point logged: the run trained 2 steps and logs every 10 "
        "(trainer.log_every): set trainer.log_every=2"
    )
    with pytest.raises(ValueError, match="val/f1: this run logged no such metric; it logged: "):
        run.curve("val/f1")
    assert run.curve("val/acc")[0] == [2]  # the evaluation at the end of training
