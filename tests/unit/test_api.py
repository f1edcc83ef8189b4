"""app/api: ampsweep.train and ampsweep.sweep record exactly what the command line records."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ampsweep
from ampsweep.cli.train import cmd_train
from ampsweep.tracking import store as mlflow_store

SMALL = [
    "trainer.epochs=1", "trainer.max_steps=6", "trainer.log_every=2", "trainer.progress=false",
    "trainer.timing_warmup_steps=1", "trainer.deterministic=true", "model.width=8",
]  # fmt: skip
# Tags that say when and where a run happened rather than what it is.
PLACE = {"run_dir", "mlflow.runName", "checkpoint_dir", "mlflow.source.name", "host"}


def test_importing_ampsweep_is_light():
    heavy = "('torch', 'mlflow', 'hydra')"
    code = f"import sys, ampsweep; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_train_records_as_the_command_line_does(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = [*SMALL, "precision=bf16", f"tracking.uri={store}"]
    run = ampsweep.train(overrides)
    assert cmd_train(overrides) == 0
    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name("ampsweep")
    api, cli = sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)
    assert api.info.run_id == run.run_id and run.name == "bf16-cnn-digits"
    assert run.summary["val/loss"] == api.data.metrics["val/loss"] == cli.data.metrics["val/loss"]
    assert api.data.params == cli.data.params
    same = {k: v for k, v in api.data.tags.items() if k not in PLACE}
    assert same == {k: v for k, v in cli.data.tags.items() if k not in PLACE}
    assert api.data.tags["overrides"] == " ".join(overrides)  # Hydra's record, as from the CLI
    history = [client.get_metric_history(r.info.run_id, "train/loss") for r in (api, cli)]
    assert [m.value for m in history[0]] == [m.value for m in history[1]]
    # the result carries what the run logged, step by step, and the config as it ran
    assert run.history["train/loss"] == [(m.step, m.value) for m in history[0]]
    assert run.curve("train/loss")[0] == [2, 4, 6]  # log_every=2, max_steps=6
    assert run.curve("val/acc")[1] == [run.summary["val/acc"]]
    assert run.config["precision"]["name"] == "bf16" and run.config["trainer"]["max_steps"] == 6
    # the task's score: recorded on the run for the report, and the result's own
    assert run.score.name == api.data.tags["score.name"] == "val/acc"
    assert run.score.tolerance == float(api.data.tags["score.tolerance"]) == 0.015


def test_a_refused_command_raises_its_one_line_and_records_nothing(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ampsweep.ConfigError) as err:
        ampsweep.train(["trainer.epoch=3", f"tracking.uri={store}"])
    assert str(err.value).startswith("trainer.epoch=3: unknown key 'epoch'")
    with pytest.raises(ampsweep.ConfigError, match="trainer.device=cuda: no CUDA GPU"):
        ampsweep.train([*SMALL, "trainer.device=cuda", f"tracking.uri={store}"])
    client = mlflow_store.client_for(store)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


def test_sweep_returns_the_parent_and_the_report_rows(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = ampsweep.sweep([*SMALL, "precision=fp32,bf16", f"tracking.uri={store}"])
    client = mlflow_store.client_for(store)
    parent = client.get_run(result.parent_run_id)
    assert parent.data.tags[mlflow_store.SWEEP] == "true"
    assert parent.data.tags["command"].startswith("ampsweep train -m ")
    assert [r.name for r in result.rows] == ["fp32-cnn-digits", "bf16-cnn-digits"]
    assert [r.status for r in result.rows] == ["FINISHED", "FINISHED"]
    assert result.rows[1].baseline == "fp32-cnn-digits"
    assert {r.run_id for r in result.runs} == {r.run_id for r in result.rows}
    assert [r.config["precision"]["name"] for r in result.runs] == ["fp32", "bf16"]
    assert [r.precision for r in result.summary] == ["fp32", "bf16"]  # nothing repeated
    assert all(r.history["train/loss"] for r in result.runs)
    # the parent's MLflow description is the report's answer, with its table and charts
    note = parent.data.tags[mlflow_store.NOTE]
    assert note.splitlines()[2] == f"**{ampsweep_opening(result)}**"
    assert "| mode |" in note and "get-artifact?path=charts%2Fthroughput.png&run_uuid=" in note
    assert "#### Findings" in note and "- Device:" in note
    assert any(f.startswith("Device:") for f in result.findings)
    # a few steps of training leave fp32 near chance (its data.num_classes tag says 10): the
    # recommendation is that open question, with the run that would answer it
    rec = result.recommendation
    assert rec.mode is None and "baseline learns" in rec.open_question
    assert "near chance for 10 classes (0.100): the baseline has not learned" in rec.reason
    assert rec.command.startswith("ampsweep train -m ")
    assert rec.command.endswith(" trainer.epochs=4 trainer.max_steps=24")  # 4x as long


def ampsweep_opening(result) -> str:
    rec = result.recommendation
    return f"{'Use ' + rec.mode if rec.mode else 'Open question'}: {rec.reason}"


def test_train_with_a_config_folder(store, tmp_path, monkeypatch):
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "wide_mlp.yaml").write_text("name: mlp\nwidth: 8\ndepth: 1\ndropout: 0.0\n")
    monkeypatch.chdir(tmp_path)
    overrides = [o for o in SMALL if not o.startswith("model.")]
    run = ampsweep.train([*overrides, "model=wide_mlp", f"tracking.uri={store}"], tmp_path / "conf")
    params = mlflow_store.client_for(store).get_run(run.run_id).data.params
    assert (params["model.name"], params["model.width"], params["model.depth"]) == ("mlp", "8", "1")


@pytest.mark.parametrize(
    "sweep,modes",
    [
        (["precision=glob(*,exclude=[tf32,fp8*,auto,fp16*,bf16_pure])"], ["bf16", "fp32"]),
        (
            ["precision=choice(fp32,bf16)", "trainer.seed=range(0,2)"],
            ["bf16", "bf16", "fp32", "fp32"],
        ),
    ],
    ids=["glob-exclude", "choice-range"],
)
def test_sweep_takes_hydras_whole_sweep_grammar(sweep, modes, store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = ampsweep.sweep([*SMALL, "model=mlp", *sweep, f"tracking.uri={store}"])
    assert sorted(r.precision for r in result.rows) == modes
    assert all(r.status == "FINISHED" for r in result.rows)


def test_sweep_refuses_a_search_range_without_a_sweeper_that_searches(store):
    with pytest.raises(
        ampsweep.ConfigError, match=r"interval\(0.0001,0.01\): .*hydra/sweeper=optuna"
    ):
        ampsweep.sweep(["optimizer.lr=interval(0.0001,0.01)", f"tracking.uri={store}"])
