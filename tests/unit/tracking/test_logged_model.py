"""tracking/logged_model.py: the trained model logged as an MLflow model of its run, READY,
with its final metrics linked, loadable where its module is not, and registered; its signature
output from the first rows of its input example, and its requirements pinned from what is
installed, read once per environment."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow.pytorch
import numpy as np
import pytest
import torch
from mlflow.entities import LoggedModelStatus
from mlflow.models import Model

from ampsweep.config.schema import Config, TrackingConfig, validate
from ampsweep.engine import checkpoint
from ampsweep.engine.checkpoint import ModelSnapshot
from ampsweep.engine.data.batches import Batches
from ampsweep.tracking import logged_model
from ampsweep.tracking import store as mlflow_store
from ampsweep.tracking.logged_model import distributions_of, installed_version


def _snapshot():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    x, y = torch.randn(20, 1, 8, 8), torch.arange(20) % 10
    batches = Batches((x, y), 8, torch.device("cpu"), torch.float32, shuffle=False,
                      drop_last=False, seed=0, preload=True)  # fmt: skip
    return checkpoint.snapshot(model, batches)


def test_the_model_is_logged_to_the_runs_experiment_with_its_final_metrics(
    new_recorder, data_inputs
):
    r = new_recorder()
    r.log_params({"precision.name": "fp32"})
    r.log_inputs(data_inputs)
    r.log_metrics({"val/acc": 0.5, "train/loss": 2.0}, 3)
    r.log_metrics({"val/acc": 0.75, "perf/samples_per_s": 10.0}, 7)  # the final step
    model_id = r.log_model(_snapshot(), 7, tags={"precision": "fp32"})
    version = r.register_model(model_id, "toy")
    assert r.register_model(model_id, "toy") == version + 1  # one version per registration
    r.end(mlflow_store.FINISHED)

    model = r.client.get_logged_model(model_id)
    assert model.status == LoggedModelStatus.READY
    assert model.experiment_id == r.experiment_id and model.source_run_id == r.run_id
    assert model.name == mlflow_store.MODEL_NAME
    assert model.params == {"precision.name": "fp32"} and model.tags["precision"] == "fp32"
    linked = {m.key: (m.value, m.step, m.dataset_name) for m in model.metrics}
    assert linked == {"val/acc": (0.75, 7, "toy-val"), "perf/samples_per_s": (10.0, 7, None)}
    # linking did not add points to the run's own history
    assert len(r.client.get_metric_history(r.run_id, "val/acc")) == 2
    outputs = r.client.get_run(r.run_id).outputs.model_outputs
    assert [(o.model_id, o.step) for o in outputs] == [(model_id, 7)]
    files = {f.path for f in r.client.list_logged_model_artifacts(model_id)}
    assert {"MLmodel", "requirements.txt", "input_example.json", "data"} <= files


def test_the_logged_model_loads_predicts_the_same_and_pins_its_requirements(new_recorder):
    snapshot = _snapshot()
    r = new_recorder()
    model_id = r.log_model(snapshot, 1)
    r.end(mlflow_store.FINISHED)
    loaded = mlflow.pytorch.load_model(f"runs:/{r.run_id}/model")
    x = torch.from_numpy(snapshot.example)
    with torch.inference_mode():
        assert torch.equal(loaded(x), snapshot.module(x))
    location = r.client.get_logged_model(model_id).artifact_location.removeprefix("file://")
    requirements = (Path(location) / "requirements.txt").read_text().splitlines()
    pins = logged_model.pinned_requirements(snapshot.packages)
    assert requirements[0].startswith("mlflow==") and requirements[1:] == pins
    signature = Model.load(location).signature
    assert signature.outputs is not None  # from two rows of the example


NETS = """
import torch


def double(x):
    return 2 * x


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x):
        return double(self.fc(x.flatten(1)))
"""

LOAD = """
import json, sys
import mlflow.pytorch, numpy as np, torch
model = mlflow.pytorch.load_model(sys.argv[1])
x = np.array(json.load(open(sys.argv[1] + "/input_example.json")), dtype="float32")
print(type(model).__name__, tuple(model(torch.from_numpy(x)).shape))
"""


def test_a_model_of_a_local_module_loads_where_that_module_is_not(
    new_recorder, tmp_path, monkeypatch
):
    """A model class from the user's own file (a _target_) is pickled by value with its
    helpers: whoever loads the model needs torch, not the file."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mynets.py").write_text(NETS)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    import mynets

    x, y = torch.randn(20, 1, 8, 8), torch.arange(20) % 10
    batches = Batches((x, y), 8, torch.device("cpu"), torch.float32, shuffle=False,
                      drop_last=False, seed=0, preload=True)  # fmt: skip
    snap = checkpoint.snapshot(mynets.Net(), batches)
    r = new_recorder()
    model_id = r.log_model(snap, 1)
    r.end(mlflow_store.FINISHED)
    location = r.client.get_logged_model(model_id).artifact_location
    shutil.copytree(location.removeprefix("file://"), tmp_path / "model")
    assert "mynets" not in (tmp_path / "model" / "requirements.txt").read_text()
    elsewhere = tmp_path / "elsewhere"  # neither src/ nor the repository on the path
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "model")], cwd=elsewhere,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["Net", "(8,", "10)"]


def test_a_model_that_cannot_run_on_the_cpu_is_logged_with_its_inputs_signature(new_recorder):
    class GpuOnly(torch.nn.Linear):
        def forward(self, x):
            raise RuntimeError("float8 matmul needs a GPU")

    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    batches = Batches((x, y), 8, torch.device("cpu"), torch.float32, shuffle=False,
                      drop_last=False, seed=0, preload=True)  # fmt: skip
    r = new_recorder()
    model_id = r.log_model(checkpoint.snapshot(GpuOnly(4, 2), batches), 1)
    r.end(mlflow_store.FINISHED)
    location = r.client.get_logged_model(model_id).artifact_location
    signature = Model.load(location.removeprefix("file://")).signature
    assert signature.inputs is not None and signature.outputs is None


def test_registering_needs_the_model_logged():
    cfg = Config(tracking=TrackingConfig(log_model=False, register_model="digits-cnn"))
    [problem] = [p for p in validate(cfg) if p.startswith("tracking.register_model")]
    assert "tracking.log_model=false" in problem


class Rows(torch.nn.Module):
    """Counts the rows it sees; squeezes its output like some user models do."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(len(x))
        return self.fc(x).squeeze()


def test_the_signature_output_runs_two_rows_and_keeps_the_batch():
    net = Rows()
    output = logged_model.signature_output(ModelSnapshot(net, np.zeros((64, 4), dtype=np.float32)))
    assert net.rows == [2]  # not a forward over the 64 rows of the example
    assert output.shape == (2, 3) and output.dtype == np.float32  # the batch stays a batch


def test_a_model_that_cannot_run_has_no_signature_output():
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("float8 matmul needs a GPU")

    snapshot = ModelSnapshot(Broken(), np.zeros((8, 4), dtype=np.float32))
    assert logged_model.signature_output(snapshot) is None


@pytest.mark.parametrize("packages", [set(), {"torch"}, {"torch", "__main__", "builtins"}])
def test_the_base_requirements_are_always_pinned(packages):
    names = [r.split("==")[0] for r in logged_model.pinned_requirements(packages)]
    assert names == ["torch", "cloudpickle", "numpy"]
    assert logged_model.pickled_by_value(packages) == set()  # a script's classes: cloudpickle's own


def test_requirements_are_pinned_from_what_is_installed():
    reqs = logged_model.pinned_requirements({"torch", "torchvision", "ampsweep", "mynets"})
    names = [r.split("==")[0] for r in reqs]
    assert names == ["torch", "cloudpickle", "numpy", "torchvision"]
    assert all("+" not in r for r in reqs)  # local labels (+cu130) are not on PyPI
    # ampsweep's and a local module's classes travel inside the pickle instead
    assert logged_model.pickled_by_value({"torch", "ampsweep", "mynets"}) == {"ampsweep", "mynets"}


def test_a_package_named_otherwise_than_its_distribution_is_pinned_by_the_distribution():
    # sklearn is scikit-learn's, PIL Pillow's, yaml PyYAML's: importable, hence installed,
    # so their classes travel by reference and loading the model needs the distribution
    pins = logged_model.pinned_requirements({"torch", "sklearn", "PIL", "yaml"})
    for package, dist in (("sklearn", "scikit-learn"), ("PIL", "pillow"), ("yaml", "PyYAML")):
        (pin,) = [p for p in pins if p.split("==")[0].lower() == dist.lower()]
        assert pin.split("==")[1] == installed_version(dist).split("+")[0], package
    assert logged_model.pickled_by_value({"torch", "sklearn", "PIL", "yaml", "mynets"}) == {
        "mynets"
    }


def test_a_packages_distributions_are_those_importlib_names():
    assert distributions_of("torch") == ["torch"]
    assert distributions_of("yaml") == ["PyYAML"]  # not the package's own name
    assert distributions_of("no_such_package_here") == []
    assert installed_version("torch") == importlib.metadata.version("torch")
    assert installed_version("no-such-distribution-here") is None
    whole = importlib.metadata.packages_distributions()
    for package in ("torch", "yaml", "sklearn", "mlflow", "hydra", "numpy", "_pytest"):
        assert set(distributions_of(package)) <= set(whole[package])
