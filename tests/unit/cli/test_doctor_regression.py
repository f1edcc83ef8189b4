"""``ampsweep doctor`` on a regression whose targets are far beyond fp16's range (house prices in
dollars, examples/regression): it names the model's head and the targets' size, prescribes the
standardised targets, and the verifying sweep, fp32 on the same targets, shows the
prescription finite with fp32's RMSE; a data set that cannot standardise its targets is told
what to do."""

from __future__ import annotations

import math
import shutil

from conftest import REPO, all_runs
from omegaconf import OmegaConf

from ampsweep.cli.prescription import standardising, targets_advice

# 12 steps: more skipped than a scaler's ordinary backoff (fp16 FAILED), too few to diverge
TINY = ["model=mlp", "model.width=8", "dataset.num_samples=400", "trainer.batch_size=16",
        "trainer.max_steps=12", "trainer.epochs=1", "trainer.log_every=4",
        "tracking.log_model=false", "tracking.system_metrics=false"]  # fmt: skip


def test_the_doctor_names_the_head_prescribes_standardised_targets_and_proves_them(
    tmp_path, monkeypatch, store_uri, main
):
    shutil.copytree(REPO / "examples" / "regression", tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = main("doctor", "--verify", "--config-dir", "conf", "--modes", "fp16", "dataset=prices",
               *TINY)  # fmt: skip
    assert res.code == 0, res.err[-3000:]
    out = " ".join(res.out.split())  # the console wraps long lines
    assert "fp16: FAILED" in out
    head = "7 (Linear, the model's head)"
    assert f"the gradient the loss passed back to the fp16 output of {head}" in out
    assert "the targets reach " in out  # prices of hundreds of thousands of dollars
    fix = "dataset.standardize_targets=true precision=fp16"
    assert f"fp16: {fix} (every run on them, fp32 too: val/rmse in their standard" in out
    assert "its trial held: val/rmse" in out
    assert "launch it: ampsweep train -m --config-dir conf experiment=doctor dataset=prices" in out
    verdict = out[out.index("verdict") :]
    assert f"doctor_fp16 ({fix}): fixed: finite, val/rmse" in verdict
    written = OmegaConf.load(tmp_path / "conf" / "experiment" / "doctor.yaml")
    assert written.dataset.standardize_targets is True  # fp32 too: the same unit
    assert written.hydra.sweeper.params.precision == "fp32,doctor_fp16"
    children = [r for r in all_runs(store_uri) if r.data.tags.get("ampsweep.sweep") != "true"]
    assert len(children) == 2
    for run in children:  # both on standardised targets: RMSE in standard deviations
        rmse = run.data.metrics["val/rmse"]
        assert math.isfinite(rmse) and rmse < 3, (run.data.tags.get("mlflow.runName"), rmse)


def test_a_data_set_without_the_setting_is_told_what_to_change_and_gets_the_head_in_fp32(
    tmp_path, monkeypatch, store_uri, main
):
    shutil.copytree(REPO / "examples" / "regression", tmp_path, dirs_exist_ok=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "raw_prices.py").write_text(
        "from regression_demo.data import prices\n\n\n"
        "def raw_prices(num_samples: int = 400):\n    return prices(num_samples)\n"
    )
    (tmp_path / "conf" / "dataset" / "raw_prices.yaml").write_text(
        "defaults:\n  - override /task@_global_.task: regression\n"
        "  - override /loss@_global_.loss: mse\n  - _self_\n"
        "_target_: raw_prices.raw_prices\nname: raw_prices\n"
    )
    tiny = [o for o in TINY if not o.startswith("dataset.")]
    res = main("doctor", "--config-dir", "conf", "--modes", "fp16", "dataset=raw_prices", *tiny)
    assert res.code == 0, res.err[-3000:]
    said = " ".join((res.out + res.err).split())
    assert "dataset=raw_prices has no standardize_targets setting: standardise the targets" in said
    assert "fp16: precision=fp16 precision.keep_fp32=[7]" in said
    assert "its trial still FAILS" in said  # the gradient grows through every layer before it
    assert all_runs(store_uri) == []  # no --verify: nothing recorded


def test_a_data_set_without_the_setting_is_told_how_to_standardise():
    assert standardising({"standardize_targets": False}) == ["dataset.standardize_targets=true"]
    assert standardising({"standardize_targets": True}) == []  # already standardised
    assert standardising({"num_samples": 100}) == []  # no such setting: no override
    words = targets_advice("prices")
    assert words.startswith("dataset=prices has no standardize_targets setting")
    assert "(y - mean) / std with the training split's mean and std" in words
