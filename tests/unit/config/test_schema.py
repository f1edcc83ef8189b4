"""config/schema.py: what Hydra composes onto the schema: the defaults, the typed sections,
dataset.preload as typed on the command line (Hydra parses true/false as bools)."""

from __future__ import annotations

import pytest

from ampsweep.config import compose as config
from ampsweep.config.schema import Config, ConfigError, Schema, shared_defaults, validate


@pytest.mark.parametrize("value", ["true", "false", "auto", "True", "FALSE"])
def test_unquoted_preload_values_compose(value, quick):
    cfg = config.load([*quick, "tracking=none", f"dataset.preload={value}"])
    assert cfg.dataset.preload == value.lower()


def test_a_bad_preload_value_names_the_choices():
    with pytest.raises(ConfigError, match="dataset.preload=maybe must be one of auto, true, false"):
        config.load(["dataset.preload=maybe"])


def test_the_default_config_is_valid():
    assert validate(Config()) == []


def test_validate_reports_every_problem_with_its_fix():
    cfg = Config()
    cfg.trainer.epochs, cfg.trainer.max_steps, cfg.optimizer.min_lr_ratio = 0, 0, 2.0
    assert validate(cfg) == [
        "trainer.epochs=0 must be > 0: set trainer.epochs=10",
        "trainer.max_steps=0 must be > 0, or -1 for no limit",
        "optimizer.min_lr_ratio=2.0 must be in [0, 1]",
    ]


def test_every_component_section_carries_its_shared_keys():
    # dataset.preload=true needs no "+" whatever data set is picked: the key is always there.
    from omegaconf import OmegaConf

    composed = OmegaConf.structured(Schema)
    for section in ("model", "dataset", "optimizer"):
        keys = set(composed[section])
        assert keys == set(shared_defaults(type(getattr(Config(), section))))
    assert {"preload", "val_fraction", "mean"} <= set(composed.dataset)
    assert "name" not in composed.dataset and "args" not in composed.optimizer
