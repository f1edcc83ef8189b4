"""``ampsweep doctor``: on each model with a known defect it names the module and the format
limit, prescribes a config, writes it as an experiment, and with --verify the sweep of fp32,
the failing mode and the prescription shows the prescription training finite with fp32's
accuracy; a model without a defect gets no prescription; bad input is one line."""

from __future__ import annotations

import pytest
from conftest import all_runs
from omegaconf import OmegaConf

SHORT = ["trainer.max_steps=40", "trainer.epochs=3", "trainer.log_every=5"]


CASES = {
    # model, mode, what the doctor must say, the prescription
    "forward overflow": (
        ["model=overflow_net"], "fp16",
        "fp16 output of amplify (Amplify) (its mul), with finite inputs: it reaches",
        "precision=fp16 precision.keep_fp32=[amplify]",
    ),
    "broken backward kernel": (
        ["model=flaky_net"], "bf16",
        "weight gradient of fc2 (FlakyLinear) (fc2.weight), with finite input and output",
        "precision=bf16 precision.keep_fp32=[fc2]",
    ),
    "parameterless half backward": (
        ["model=fused_net"], "bf16",
        "gradient act (FusedAct) (its _HalfBackwardFails) passed back to its input",
        "precision=bf16 precision.keep_fp32=[act]",
    ),
    "overflow inside a forward": (
        ["model=attention_net"], "fp16",
        "fp16 output of attn (Attention) (its mul), with finite inputs: it reaches",
        "precision=fp16 precision.keep_fp32=[attn]",
    ),
    "gradient underflow": (
        ["experiment=underflow_demo", "trainer.epochs=2"], "fp16_noscale",
        "fp16 flushes 9",  # about 94% of the gradient values
        "precision=fp16 precision.scaler.init_scale=16777216",
    ),
    "lost updates": (
        ["model=heavy_net"], "bf16_pure",
        "bf16 weights round away the updates of",
        "precision=bf16_pure precision.master_weights=true",
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_doctor_names_prescribes_and_proves(case, project, main, store_uri):
    args, mode, says, fix = CASES[case]
    extra = SHORT if args[0].startswith("model=") else []
    res = main("doctor", "--verify", "--config-dir", "conf", "--modes", mode, *args, *extra)
    assert res.code == 0, res.err[-3000:]
    out = " ".join(res.out.split())  # the console wraps long lines
    assert says in out
    assert f"{mode}: {fix}" in out
    verdict = out[out.index("verdict") :]
    assert f"doctor_{mode} ({fix}): fixed: finite," in verdict
    written = OmegaConf.load(project / "conf" / "experiment" / "doctor.yaml")
    assert written.hydra.sweeper.params.precision == f"fp32,{mode},doctor_{mode}"
    option = OmegaConf.load(project / "conf" / "precision" / f"doctor_{mode}.yaml")
    assert option.precision.name == fix.split()[0].split("=")[1]
    assert option.precision.get("master_weights", False) == ("master_weights=true" in fix)
    runs = all_runs(store_uri)
    parents = [r for r in runs if r.data.tags.get("ampsweep.sweep") == "true"]
    assert len(parents) == 1 and len(runs) == 4  # the sweep: a parent with three children


def test_a_model_without_a_defect_gets_no_prescription(project, main, store_uri):
    res = main("doctor", "--modes", "bf16", "model=mlp", "model.width=8", *SHORT)
    assert res.code == 0, res.err[-2000:]
    out = " ".join(res.out.split())
    assert "bf16: held" in out and "No mode failed or lost accuracy: nothing to prescribe." in out
    assert "safe on this model: bf16 (forward headroom 2^" in out
    assert not (project / "conf" / "experiment" / "doctor.yaml").exists()
    assert all_runs(store_uri) == []  # trials are not recorded


@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["precision=fp16,bf16"],
            "precision=fp16,bf16: ampsweep doctor examines one configuration",
        ),
        (["--modes", "fp17"], "--modes fp17: fp17 is not a mode to examine: choose from"),
        (["precision.keep_fp32=[nope]", "--modes", "bf16"], "precision.keep_fp32: no module"),
        (["model.widht=8"], "model.widht"),
    ],
)
def test_bad_input_is_one_line_and_records_nothing(args, words, project, main, store_uri):
    res = main("doctor", "model=mlp", *args)
    assert res.code == 2
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0], res.err
    assert all_runs(store_uri) == []


def test_verify_where_fp32_cannot_train_says_so_and_runs_no_sweep(project, main, store_uri):
    res = main("doctor", "--verify", "--config-dir", "conf", "--modes", "bf16",
               "model=overflow_net", "optimizer.lr=1e30", *SHORT)  # fmt: skip
    assert res.code == 1
    assert "fp32 itself does not train on this config" in res.err and "--verify needs it" in res.err
    out, err = " ".join(res.out.split()), " ".join(res.err.split())
    assert "a divergence, not the format" in out  # where fp32's failure began, and its kind
    assert "fix the config first (a divergence: lower optimizer.lr" in err
    assert all_runs(store_uri) == []


def test_verification_accepts_a_scalers_ordinary_backoff_and_not_more():
    from types import SimpleNamespace

    from ampsweep.cli.prescription import verdict

    base = SimpleNamespace(status="FINISHED", summary={"val/acc": 0.80})

    def run(skipped: int, steps: int = 30):
        summary = {"val/acc": 0.80, "numerics/nonfinite_steps": float(skipped),
                   "amp/skipped_steps": float(skipped), "train/steps": float(steps)}  # fmt: skip
        return SimpleNamespace(status="FINISHED", summary=summary, error="")

    assert verdict(run(2), None, base)[0]  # the scaler backing off at the start
    fixed, words = verdict(run(20), None, base)
    assert not fixed and words.startswith("NOT fixed: 20 non-finite step(s)")
