"""report/underflow.py: the gradient-underflow finding states what fp16 without scaling would
lose, what the unscaled run lost and what the scaler keeps; none when nothing was measured."""

from __future__ import annotations

from ampsweep.report.underflow import underflow_finding as finding


def test_underflow_finding_states_the_loss_and_the_rescue():
    runs = {
        "fp32": {"amp/grad_underflow_frac": 0.4, "amp/grad_subnormal_frac": 0.9, "val/acc": 0.97},
        "fp16_noscale": {
            "amp/grad_underflow_frac": 0.4,
            "amp/grad_flushed_frac": 0.55,
            "val/acc": 0.5,
        },
        "fp16": {
            "amp/grad_underflow_frac": 0.4,
            "amp/grad_underflow_frac_scaled": 0.004,
            "amp/loss_scale": 65536.0,
        },
    }
    text = finding(runs)
    assert "would flush 40% of the non-zero gradient values" in text
    assert "actually lost 55%" in text and "val/acc 0.500 against 0.970 in fp32" in text
    assert "scale 65536 leaves 0.4% below" in text and "keeps 99%" in text
    assert finding({"fp32": {"val/acc": 0.9}}) is None
    assert "not" not in finding({"bf16": {"amp/grad_underflow_frac": 0.2}}).split(".")[0]
    assert "without loss scaling" in finding({"fp32": {"amp/grad_underflow_frac": 0.0}})


def test_no_underflow_says_fp16_would_train_unscaled():
    text = finding({"fp32": {"amp/grad_underflow_frac": 0.0, "amp/grad_subnormal_frac": 0.0}})
    assert text.startswith(
        "No gradient value falls below fp16's range on this model (measured in fp32)"
    )
