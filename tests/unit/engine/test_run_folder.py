"""engine/run_folder.py: how a run is recorded, and what watches it, are not part of what
determines its result."""

from __future__ import annotations

from ampsweep.config.compose import load
from ampsweep.engine.run_folder import comparable, config_hash


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


def test_the_hash_follows_a_config_changed_after_it_was_asked():
    """A job asks for its config's hash several times (computed once, by value): a config
    changed in place between two asks gets the new hash, and changing it back the old one;
    what ``comparable`` returns is the caller's own."""
    cfg = load([])
    base = config_hash(cfg)
    cfg.trainer.seed += 1
    assert config_hash(cfg) != base
    cfg.trainer.seed -= 1
    assert config_hash(cfg) == base
    cfg.model.args["width"] = 2 * cfg.model.args["width"]
    assert config_hash(cfg) != base
    mine = comparable(cfg)
    mine["trainer.seed"] = "99"
    assert comparable(cfg)["trainer.seed"] != "99"
