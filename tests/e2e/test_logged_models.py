"""Every kind of model a run can train is logged as an MLflow model that
``mlflow.pytorch.load_model("runs:/<id>/model")`` loads and that scores, on the run's own
validation split, exactly what the run scored: a timm network, a Hugging Face causal LM, a
float8 (torchao) model and a user's ``_target_`` model. (The built-in CNN, in fp32 and in a
pure half mode, is checked by tests/e2e/test_mlflow_native.py.)"""

from __future__ import annotations

import sys

import pytest

from ampsweep.cli.train import cmd_train
from ampsweep.tracking import store as mlflow_store

pytestmark = pytest.mark.slow

QUICK = ["trainer.epochs=1", "trainer.max_steps=4", "trainer.batch_size=16",
         "trainer.progress=false", "trainer.timing_warmup_steps=1",
         "tracking.system_metrics=false"]  # fmt: skip

KINDS = {
    "timm": ("timm", ["model=timm", "model.arch=test_resnet"]),
    "hugging-face": ("transformers", ["model=hf_causal_lm", "dataset=pysource",
                     "dataset.max_bytes=20000", "dataset.seq_len=32", "model.hidden_size=32",
                     "model.num_attention_heads=2", "model.num_hidden_layers=1"]),
    "fp8": ("torchao", ["precision=fp8_tensorwise", "precision.fp8.emulate=true", "model=mlp",
            "model.width=8"]),
}  # fmt: skip

NETS = """
from torch import nn


def make_net(in_channels, num_classes, hidden=16):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))
"""


def _train(store: str, *overrides: str, flags: tuple[str, ...] = ()):
    """Train one run in this process; the run, as the store has it."""
    assert cmd_train([*flags, f"tracking.uri={store}", *QUICK, *overrides]) == 0
    [run] = mlflow_store.client_for(store).search_runs(
        [mlflow_store.client_for(store).get_experiment_by_name("ampsweep").experiment_id]
    )
    return run


def _scores_of_the_loaded_model(store: str, run) -> dict[str, float]:
    """The logged model loaded by its runs:/ URI and evaluated on the run's own validation
    split, under the run's precision policy (rebuilt from the run's config.yaml)."""
    import mlflow
    import mlflow.pytorch
    from omegaconf import OmegaConf

    from ampsweep.config.compose import to_config
    from ampsweep.engine.build import build
    from ampsweep.engine.loop import evaluate

    mlflow.set_tracking_uri(store)  # runs:/ URIs resolve through the global URI
    try:
        model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/{mlflow_store.MODEL_NAME}")
    finally:
        mlflow.set_tracking_uri(None)
    config = mlflow_store.client_for(store).download_artifacts(run.info.run_id, "config.yaml")
    setup = build(to_config(OmegaConf.load(config)))
    model = setup.policy.prepare_model(model)
    return setup.objective.task.metrics(evaluate(model, setup.val_batches, setup.policy,
                                                 setup.objective))  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_the_logged_model_loads_and_scores_what_the_run_scored(kind, store, tmp_path, monkeypatch):
    library, overrides = KINDS[kind]
    pytest.importorskip(library)
    monkeypatch.chdir(tmp_path)
    run = _train(store, *overrides)
    assert run.info.status == mlflow_store.FINISHED
    scores = _scores_of_the_loaded_model(store, run)
    assert scores and scores == {k: run.data.metrics[k] for k in scores}


def test_a_target_model_loads_and_scores_what_the_run_scored(store, tmp_path, monkeypatch):
    (tmp_path / "mynets_e2e.py").write_text(NETS)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text("_target_: mynets_e2e.make_net\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    run = _train(store, "model=mine", flags=("--config-dir", "conf"))
    assert run.data.params["model._target_"] == "mynets_e2e.make_net"
    scores = _scores_of_the_loaded_model(store, run)
    assert scores == {"val/loss": run.data.metrics["val/loss"],
                      "val/acc": run.data.metrics["val/acc"]}  # fmt: skip
