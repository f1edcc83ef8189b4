"""tracking.recorder: the data sets, system metrics and model a run records, and RunCloser."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time

import pytest
import torch

from ampsweep.config.schema import TrackingConfig
from ampsweep.engine import export
from ampsweep.engine.data.batches import Batches
from ampsweep.engine.fingerprint import DataInput
from ampsweep.tracking import modellog
from ampsweep.tracking import recorder as rec
from ampsweep.tracking import store as mlflow_store


def _recorder(store: str) -> rec.MlflowRecorder:
    folder = mlflow_store.sqlite_path(store).parent  # the test's temporary folder
    cfg = TrackingConfig(uri=store, artifact_root=str(folder / "mlartifacts"))
    return rec.MlflowRecorder.start(cfg, "unit", uri=store)


def _input(split: str, digest: str) -> DataInput:
    return DataInput(f"toy-{split}", digest, split, "code", {"tags": {"loader": "x.y"}}, 12,
                     ("float32", (1, 8, 8)), ("int64", ()))  # fmt: skip


def test_data_sets_are_recorded_with_digest_context_schema_and_size(store):
    r = _recorder(store)
    inputs = [_input("train", "aaaa"), _input("val", "bbbb")]
    r.log_inputs(inputs)
    r.log_inputs(inputs)  # a resumed run logs them again: still two
    r.end(mlflow_store.FINISHED)
    got = r.client.get_run(r.run_id).inputs.dataset_inputs
    by_name = {d.dataset.name: d for d in got}
    assert set(by_name) == {"toy-train", "toy-val"}
    train = by_name["toy-train"]
    assert train.dataset.digest == "aaaa" and train.dataset.source_type == "code"
    assert [t.value for t in train.tags] == [mlflow_store.TRAINING]
    assert [t.value for t in by_name["toy-val"].tags] == [mlflow_store.VALIDATION]
    assert json.loads(train.dataset.profile)["num_rows"] == 12
    features = json.loads(json.loads(train.dataset.schema)["mlflow_tensorspec"]["features"])
    assert features[0]["tensor-spec"] == {"dtype": "float32", "shape": [-1, 1, 8, 8]}


def test_system_metrics_are_sampled_until_training_stops(store):
    r = _recorder(store)
    r.start_system_metrics(0.05)
    time.sleep(0.5)
    r.stop_system_metrics()
    r.log_metrics({"train/loss": 1.0}, 1)  # training numbers after it are not samples
    r.end(mlflow_store.FINISHED)
    history = r.client.get_metric_history(r.run_id, "system/cpu_utilization_percentage")
    steps = sorted(m.step for m in history)
    assert len(steps) >= 3 and steps == list(range(len(steps)))
    assert all(0 <= m.value <= 100 for m in history)
    keys = set(r.client.get_run(r.run_id).data.metrics)
    assert "system/system_memory_usage_megabytes" in keys
    assert not any(t.name.startswith("ampsweep-system") for t in threading.enumerate())


def test_a_run_shorter_than_the_interval_still_has_its_sample(store):
    r = _recorder(store)
    r.start_system_metrics(3600)
    r.end(mlflow_store.FINISHED)  # ending stops the sampler: one last sample
    history = r.client.get_metric_history(r.run_id, "system/cpu_utilization_percentage")
    assert [m.step for m in history] == [0]


def _snapshot():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    x, y = torch.randn(20, 1, 8, 8), torch.arange(20) % 10
    batches = Batches((x, y), 8, torch.device("cpu"), torch.float32, shuffle=False,
                      drop_last=False, seed=0, preload=True)  # fmt: skip
    return export.snapshot(model, batches)


def test_the_model_is_logged_to_the_runs_experiment_with_its_final_metrics(store):
    r = _recorder(store)
    r.log_params({"precision.name": "fp32"})
    r.log_inputs([_input("train", "aaaa"), _input("val", "bbbb")])
    r.log_metrics({"val/acc": 0.5, "train/loss": 2.0}, 3)
    r.log_metrics({"val/acc": 0.75, "perf/samples_per_s": 10.0}, 7)  # the final step
    model_id = r.log_model(_snapshot(), 7, tags={"precision": "fp32"})
    version = r.register_model(model_id, "toy")
    assert r.register_model(model_id, "toy") == version + 1  # one version per registration
    r.end(mlflow_store.FINISHED)

    from mlflow.entities import LoggedModelStatus

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


def test_requirements_are_pinned_from_what_is_installed():
    reqs = modellog.pinned_requirements({"torch", "torchvision", "ampsweep", "mynets"})
    names = [r.split("==")[0] for r in reqs]
    assert names == ["torch", "cloudpickle", "numpy", "torchvision"]
    assert all("+" not in r for r in reqs)  # local labels (+cu130) are not on PyPI
    # ampsweep's and a local module's classes travel inside the pickle instead
    assert modellog.pickled_by_value({"torch", "ampsweep", "mynets"}) == {"ampsweep", "mynets"}


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


def test_a_model_of_a_local_module_loads_where_that_module_is_not(store, tmp_path, monkeypatch):
    """A model class from the user's own file (a _target_) is pickled by value with its
    helpers: whoever loads the model needs torch, not the file."""
    import shutil
    import subprocess
    import sys

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mynets.py").write_text(NETS)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    import mynets

    x, y = torch.randn(20, 1, 8, 8), torch.arange(20) % 10
    batches = Batches((x, y), 8, torch.device("cpu"), torch.float32, shuffle=False,
                      drop_last=False, seed=0, preload=True)  # fmt: skip
    snap = export.snapshot(mynets.Net(), batches)
    r = _recorder(store)
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


def test_a_closer_in_the_background_ends_runs_in_order_and_waits_for_them():
    closer = rec.RunCloser(background=True)
    done, started = [], threading.Event()

    def slow():
        started.wait(5)
        time.sleep(0.2)
        done.append("first")

    closer.submit(slow)
    closer.submit(lambda: done.append("second"))
    assert done == []  # submit returned at once
    started.set()
    closer.wait()
    assert done == ["first", "second"]


def test_a_closer_sent_to_another_process_ends_runs_at_once():
    closer = pickle.loads(pickle.dumps(rec.RunCloser(background=True)))
    done = []
    closer.submit(lambda: done.append(1))
    assert done == [1] and not closer.background


@pytest.mark.parametrize("interval", [0, -1, float("nan")])
def test_a_bad_sampling_interval_is_refused(interval):
    from ampsweep.config.schema import Config, validate

    cfg = Config(tracking=TrackingConfig(system_metrics_interval=interval))
    assert any(p.startswith(f"tracking.system_metrics_interval={interval}") for p in validate(cfg))


def test_registering_needs_the_model_logged():
    from ampsweep.config.schema import Config, validate

    cfg = Config(tracking=TrackingConfig(log_model=False, register_model="digits-cnn"))
    [problem] = [p for p in validate(cfg) if p.startswith("tracking.register_model")]
    assert "tracking.log_model=false" in problem


def test_a_model_that_cannot_run_on_the_cpu_is_logged_with_its_inputs_signature(store):
    class GpuOnly(torch.nn.Linear):
        def forward(self, x):
            raise RuntimeError("float8 matmul needs a GPU")

    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    batches = Batches((x, y), 8, torch.device("cpu"), torch.float32, shuffle=False,
                      drop_last=False, seed=0, preload=True)  # fmt: skip
    r = _recorder(store)
    model_id = r.log_model(export.snapshot(GpuOnly(4, 2), batches), 1)
    r.end(mlflow_store.FINISHED)
    location = r.client.get_logged_model(model_id).artifact_location
    from mlflow.models import Model

    signature = Model.load(location.removeprefix("file://")).signature
    assert signature.inputs is not None and signature.outputs is None


def test_a_resumed_run_continues_its_system_metrics_and_keeps_its_params(store):
    r = _recorder(store)
    r.log_params({"trainer.seed": "0"})
    r.start_system_metrics(3600)
    r.end(mlflow_store.KILLED)  # stopped by a signal: one sample, step 0
    again = rec.MlflowRecorder.attach(store, r.run_id, after_step=0)
    assert again._params == {"trainer.seed": "0"} and again.experiment_id == r.experiment_id
    again.start_system_metrics(3600)
    again.end(mlflow_store.FINISHED)
    history = r.client.get_metric_history(r.run_id, "system/cpu_utilization_percentage")
    assert sorted(m.step for m in history) == [0, 1]


def test_jobs_logging_the_same_data_set_at_once_both_record_it(store, monkeypatch):
    # The race of a sweep's concurrent jobs, made to happen every time: another job inserts the
    # data set after this one looked for it and before it inserts it.
    from sqlalchemy.orm import Session

    first, other = _recorder(store), _recorder(store)
    inputs = [_input("train", "aaaa"), _input("val", "bbbb")]
    add_all, raced = Session.add_all, []

    def add_all_after_the_other_job(session, objects):
        if not raced:
            raced.append(True)
            other.log_inputs(inputs)
        return add_all(session, objects)

    monkeypatch.setattr(Session, "add_all", add_all_after_the_other_job)
    first.log_inputs(inputs)
    assert raced
    for r in (first, other):
        got = r.client.get_run(r.run_id).inputs.dataset_inputs
        assert sorted((d.dataset.name, d.dataset.digest) for d in got) == [
            ("toy-train", "aaaa"), ("toy-val", "bbbb")]  # fmt: skip
        r.end(mlflow_store.FINISHED)
