"""A run's MLflow-native results: the model loads back and scores what the run scored, the data
sets carry the same digests in every run on the same data, the machine's load is charted, and
a sweep's models are registered; a model that cannot be recorded fails its run."""

from __future__ import annotations

import os

import pytest

from ampsweep.tracking import store as mlflow_store

# One worker runs the whole module, so that its module-scoped fixture is built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_e2e_mlflow_native")]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One in-process sweep, fp32 and bf16_pure (half weights: the logged copy is fp32),
    shared by the tests of this module."""
    from ampsweep.cli.train import cmd_train

    folder = tmp_path_factory.mktemp("native")
    store = f"sqlite:///{folder / 'mlflow.db'}"
    args = ["-m", "precision=fp32,bf16_pure", f"tracking.uri={store}", "trainer.epochs=1",
            "trainer.max_steps=12", "trainer.log_every=4", "trainer.progress=false",
            "model.width=8", "tracking.register_model=digits-cnn",
            "tracking.system_metrics_interval=0.1"]  # fmt: skip
    cwd = os.getcwd()
    os.chdir(folder)  # Hydra's run folders go under ./outputs
    try:
        assert cmd_train(args) == 0
    finally:
        os.chdir(cwd)
    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name("ampsweep")
    runs = client.search_runs([exp.experiment_id], f"tags.`{mlflow_store.PARENT}` != ''")
    return {"store": store, "client": client, "runs": {r.info.run_name: r for r in runs}}


@pytest.mark.parametrize("name", ["fp32-cnn-digits", "bf16_pure-cnn-digits"])
def test_the_logged_model_reproduces_the_runs_validation_accuracy(sweep, name):
    import mlflow
    import mlflow.pytorch

    from ampsweep.config.compose import to_config
    from ampsweep.engine.build import build
    from ampsweep.engine.loop import evaluate

    run = sweep["runs"][name]
    assert run.info.status == mlflow_store.FINISHED
    mlflow.set_tracking_uri(sweep["store"])  # runs:/ URIs resolve through the global URI
    try:
        model = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/{mlflow_store.MODEL_NAME}")
    finally:
        mlflow.set_tracking_uri(None)
    assert all(p.dtype.is_floating_point and p.dtype.itemsize == 4 for p in model.parameters())
    # The run's own config rebuilt: the same validation split, batches and precision policy.
    from omegaconf import OmegaConf

    path = sweep["client"].download_artifacts(run.info.run_id, "config.yaml")
    setup = build(to_config(OmegaConf.load(path)))
    model = setup.policy.prepare_model(model)  # bf16_pure: back to the trained bf16 weights
    _, acc = evaluate(model, setup.val_batches, setup.policy)
    assert acc == run.data.metrics["val/acc"]


def test_runs_on_the_same_data_record_the_same_data_sets(sweep):
    seen = []
    for run in sweep["runs"].values():
        inputs = run.inputs.dataset_inputs
        seen.append({(d.dataset.name, d.dataset.digest, d.tags[0].value) for d in inputs})
    assert seen[0] == seen[1]
    assert {(name, context) for name, _, context in seen[0]} == {
        ("digits-train", mlflow_store.TRAINING), ("digits-val", mlflow_store.VALIDATION),
    }  # fmt: skip


def test_each_run_has_its_system_metrics_and_its_model_linked_and_registered(sweep):
    client = sweep["client"]
    versions = client.search_model_versions("name = 'digits-cnn'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    assert {v.run_id for v in versions} == {r.info.run_id for r in sweep["runs"].values()}
    for run in sweep["runs"].values():
        history = client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
        assert len(history) >= 1
        [output] = run.outputs.model_outputs
        model = client.get_logged_model(output.model_id)
        linked = {m.key: m for m in model.metrics}
        assert linked["val/acc"].value == run.data.metrics["val/acc"]
        assert linked["val/acc"].dataset_name == "digits-val"
        assert output.step == int(run.data.params["trainer.max_steps"])


def test_a_model_that_cannot_be_recorded_fails_its_run(store, tmp_path, monkeypatch):
    from ampsweep.config import compose
    from ampsweep.runner import job as runner
    from ampsweep.runner.context import EXIT_FAILED
    from ampsweep.tracking.recorder import MlflowRecorder

    def broken(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(MlflowRecorder, "log_model", broken)
    monkeypatch.chdir(tmp_path)
    cfg = compose.load([f"tracking.uri={store}", "trainer.max_steps=2", "trainer.progress=false",
                        "model.width=4", "tracking.system_metrics=false"])  # fmt: skip
    outcome = runner.run_job(cfg)
    assert (outcome.status, outcome.exit_code) == (mlflow_store.FAILED, EXIT_FAILED)
    run = mlflow_store.client_for(store).get_run(outcome.run_id)
    assert run.info.status == mlflow_store.FAILED
    assert run.data.tags[mlflow_store.ERROR] == (
        "could not record the trained model: OSError: No space left on device"
    )
