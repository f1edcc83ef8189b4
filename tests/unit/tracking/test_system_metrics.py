"""tracking/system_metrics.py: the machine's load sampled while a run trains, a last sample
when it stops, and a resumed run's samples continuing its steps."""

from __future__ import annotations

import threading
import time

import pytest

from ampsweep.config.schema import Config, TrackingConfig, validate
from ampsweep.tracking import store as mlflow_store
from ampsweep.tracking.recorder import MlflowRecorder


def test_system_metrics_are_sampled_until_training_stops(new_recorder):
    r = new_recorder()
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


def test_a_run_shorter_than_the_interval_still_has_its_sample(new_recorder):
    r = new_recorder()
    r.start_system_metrics(3600)
    r.end(mlflow_store.FINISHED)  # ending stops the sampler: one last sample
    history = r.client.get_metric_history(r.run_id, "system/cpu_utilization_percentage")
    assert [m.step for m in history] == [0]


def test_a_resumed_run_continues_its_system_metrics_and_keeps_its_params(new_recorder):
    r = new_recorder()
    r.log_params({"trainer.seed": "0"})
    r.start_system_metrics(3600)
    r.end(mlflow_store.KILLED)  # stopped by a signal: one sample, step 0
    again = MlflowRecorder.attach(r.uri, r.run_id, after_step=0)
    assert again._params == {"trainer.seed": "0"} and again.experiment_id == r.experiment_id
    again.start_system_metrics(3600)
    again.end(mlflow_store.FINISHED)
    history = r.client.get_metric_history(r.run_id, "system/cpu_utilization_percentage")
    assert sorted(m.step for m in history) == [0, 1]


@pytest.mark.parametrize("interval", [0, -1, float("nan")])
def test_a_bad_sampling_interval_is_refused(interval):
    cfg = Config(tracking=TrackingConfig(system_metrics_interval=interval))
    assert any(p.startswith(f"tracking.system_metrics_interval={interval}") for p in validate(cfg))
