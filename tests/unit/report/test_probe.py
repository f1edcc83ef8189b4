"""report/probe.py: the numerics probe's verdicts, once per configuration: where fp16
overflows and the fix (no module to keep when it is the model itself), the share fp16 loses
and the scale that keeps it, the updates a pure mode loses, and which half modes are safe
(never one whose run went wrong); the gradient-underflow finding states what fp16 without
scaling would lose, what the unscaled run lost and what the scaler keeps, none when nothing was
measured."""

from __future__ import annotations

from ampsweep.precision import modes
from ampsweep.report.probe import underflow_finding as finding
from unit.report.test_numerics import (
    HEALTHY,
    _logged,
    numeric_findings,
    origin,
    probed_runs,
    run,
)


def test_the_probe_names_the_modules_fp16_overflows_in_and_the_fix():
    found = numeric_findings(probed_runs())
    overflow = [f for f in found if "overflows in the forward pass" in f]
    assert overflow == [
        "Numerics probe: fp16 overflows in the forward pass: amplify reaches 1.83e+05, "
        "blocks.1.attn 7.1e+04 in fp32, beyond fp16's largest value 65504 (headroom 2^-1.5), "
        "so every fp16 mode turns them into inf; fix: "
        "precision.keep_fp32=[amplify,blocks.1.attn] (those modules in fp32), or "
        "precision=bf16 (fp32's range)."
    ]  # once, though two runs measured it


def test_an_overflow_of_the_model_itself_is_no_module_to_keep_in_fp32():
    tags = {"numerics.fp16_overflow": "(model)=9e+04"}
    (text,) = [f for f in numeric_findings(probed_runs(tags=tags)) if "overflows" in f]
    assert "(model) reaches 9e+04 in fp32" in text
    assert text.endswith("; fix: precision=bf16 (fp32's range).")
    assert "keep_fp32" not in text


def test_the_probe_gives_the_share_fp16_loses_and_the_scale_that_keeps_it():
    found = numeric_findings(probed_runs())
    assert (
        "Numerics probe: fp16 without loss scaling (fp16_noscale, fp16_pure) would flush 12.5% "
        "of the non-zero gradient values to zero; a loss scale of 1024 keeps all but 0.01%: "
        "precision=fp16 precision.scaler.init_scale=1024."
    ) in found


def test_the_probe_names_the_updates_a_pure_mode_loses_and_the_remedy():
    (text,) = [f for f in numeric_findings(probed_runs()) if "round away" in f]
    assert text == (
        "Numerics probe: a pure bf16 model (bf16_pure) would round away 37% of one optimizer "
        "step's non-zero updates (smaller than half a unit in the last place of their weight); "
        "in bf16 most in fc1.weight (100%), fc2.weight (42%), fc3.weight (10%); fix: "
        "precision=bf16_pure precision.master_weights=true (fp32 master weights, as much "
        "weight memory as fp32) or precision=bf16 (autocast, fp32 weights) keeps them."
    )
    assert "fp16_pure" not in text  # its 1% is within the tolerance


def test_a_probe_that_finds_nothing_wrong_says_which_half_modes_are_safe():
    (text,) = numeric_findings(probed_runs(HEALTHY, tags={}))
    half = [m.name for m in modes.MODES.values() if m.half and not m.fp8]
    assert text == (
        f"Numerics probe: {', '.join(half)} are safe here (the largest forward value is 2^9.3 "
        "below fp16's and 2^121 below bf16's largest; a pure model would round away 0.2% "
        "(bf16) and 0.01% (fp16) of one step's updates)."
    )


def test_only_the_modes_nothing_rules_out_are_called_safe():
    found = numeric_findings(probed_runs())
    assert "Numerics probe: bf16 is safe here (the largest forward value is 2^111 below " \
        "bf16's largest)." in found  # fmt: skip
    unscaled_only = {**HEALTHY, "numerics/fp16_grad_underflow_frac": 0.01}
    (safe,) = [f for f in numeric_findings(probed_runs(unscaled_only, {})) if "safe" in f]
    assert "fp16, fp16_static, bf16, bf16_pure are safe" in safe
    assert "fp16_noscale" not in safe and "fp16_pure" not in safe


def test_each_configuration_gets_its_own_probe_findings():
    runs = probed_runs() + probed_runs(HEALTHY, tags={}, lr="0.01")
    found = [f for f in numeric_findings(runs) if f.startswith("Numerics probe")]
    assert sum("overflows" in f for f in found) == 1
    assert any(
        f.startswith("Numerics probe (cnn on digits, lr=0.001): fp16 overflows") for f in found
    )
    assert any(f.startswith("Numerics probe (cnn on digits, lr=0.01): fp16, ") for f in found)


def test_a_pure_mode_that_lost_updates_on_its_own_steps_is_not_called_safe():
    runs = probed_runs(HEALTHY, tags={}) + [
        run("bf16_pure", amp__update_lost_frac=0.18, **_logged(HEALTHY))
    ]
    found = numeric_findings(runs)
    (safe,) = [f for f in found if "safe here" in f]
    assert "bf16_pure" not in safe
    assert "fp16, fp16_static, fp16_noscale, bf16, fp16_pure are safe here" in safe
    assert any(
        f.startswith("bf16_pure-cnn-digits: its bf16 weights rounded away 18%") for f in found
    )


def test_a_mode_whose_run_went_wrong_is_not_called_safe_whatever_the_probe_saw():
    # A faulty kernel, say: ranges the probe finds fine, and a run whose scale collapsed
    runs = probed_runs(HEALTHY, tags={}) + [
        run("fp16", tags=origin(), amp__loss_scale=1.0, **_logged(HEALTHY)),
        run("fp16_noscale", status="FAILED", tags=origin(), **_logged(HEALTHY)),
    ]
    (safe,) = [f for f in numeric_findings(runs) if "safe here" in f]
    assert "Numerics probe: fp16_static, bf16, fp16_pure, bf16_pure are safe here" in safe


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
