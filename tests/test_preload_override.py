"""dataset.preload=auto|true|false as typed on the command line (Hydra parses true/false as
bools), and what each choice does to the batches."""

from __future__ import annotations

import pytest

from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError
from ampsweep.engine import build as train


@pytest.mark.parametrize("value, preloaded", [("true", True), ("false", False), ("auto", True)])
def test_unquoted_preload_values_compose_and_choose_the_batches(value, preloaded, quick):
    cfg = config.load([*quick, "tracking=none", f"dataset.preload={value}"])
    assert cfg.dataset.preload == value
    setup = train.build(cfg)
    assert setup.train_batches.preload is preloaded and setup.dataset_info["preload"] is preloaded


def test_a_bad_preload_value_names_the_choices():
    with pytest.raises(ConfigError, match="dataset.preload=maybe must be one of auto, true, false"):
        config.load(["dataset.preload=maybe"])
