"""engine/confighash.py: how a run is recorded, and what watches it, are not part of what
determines its result."""

from __future__ import annotations

from ampsweep.config.compose import load
from ampsweep.engine.confighash import config_hash


def test_recording_settings_leave_the_config_hash_alone():
    """A sweep relaunched without model logging still finds its finished runs, and a run
    resumed with another sampling interval is the same run."""
    base = config_hash(load([]))
    assert base == config_hash(load(["tracking.log_model=false", "tracking.system_metrics=false"]))
    assert base == config_hash(
        load(["tracking.system_metrics_interval=0.5", "tracking.register_model=digits-cnn"])
    )
    assert base != config_hash(load(["trainer.seed=1"]))


def test_callbacks_leave_the_config_hash_alone():
    """A run a callback stopped resumes without it, and a sweep relaunched without it finds
    its finished runs."""
    hook = "trainer.callbacks=[{_target_: callbacks.RecordSteps, path: steps.jsonl}]"
    assert config_hash(load([hook])) == config_hash(load([]))
