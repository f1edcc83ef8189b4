"""tracking/logged_model.py: the trained model logged as an MLflow model of its run, READY,
with its final metrics linked, loadable where its module is not, and registered."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch
from mlflow.entities import LoggedModelStatus
from mlflow.models import Model

from ampsweep.config.schema import Config, TrackingConfig, validate
from ampsweep.engine import export
from ampsweep.engine.data.batches import Batches
from ampsweep.tracking import store as mlflow_store


def _snapshot():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    x, y = torch.randn(20, 1, 8, 8), torch.arange(20) % 10
    batches = Batches((x, y), 8, torch.device("cpu"), torch.float32, shuffle=False,
                      drop_last=False, seed=0, preload=True)  # fmt: skip
    return export.snapshot(model, batches)


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
    snap = export.snapshot(mynets.Net(), batches)
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
    model_id = r.log_model(export.snapshot(GpuOnly(4, 2), batches), 1)
    r.end(mlflow_store.FINISHED)
    location = r.client.get_logged_model(model_id).artifact_location
    signature = Model.load(location.removeprefix("file://")).signature
    assert signature.inputs is not None and signature.outputs is None


def test_registering_needs_the_model_logged():
    cfg = Config(tracking=TrackingConfig(log_model=False, register_model="digits-cnn"))
    [problem] = [p for p in validate(cfg) if p.startswith("tracking.register_model")]
    assert "tracking.log_model=false" in problem
