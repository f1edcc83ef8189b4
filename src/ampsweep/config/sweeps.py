"""The jobs of a sweep written on a command line, for the commands that examine each one
(``ampsweep capacity``, ``ampsweep doctor``) without running a Hydra sweep: the product of
the comma, ``range()`` and ``choice()`` sweeps, as Hydra's basic sweeper makes it. (``ampsweep
train -m`` is expanded by Hydra's sweeper itself: ``app.sweeper``.)"""

from __future__ import annotations

import itertools

from hydra.core.override_parser.overrides_parser import OverridesParser

from ampsweep.config import messages
from ampsweep.config.schema import ConfigError


def is_hydra_override(override: str) -> bool:
    key = override.lstrip("~+").split("=", 1)[0]
    return key.startswith(("hydra.", "hydra/")) or key == "hydra"


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Every job of the overrides, as plain override lists. Raises ConfigError."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        axes = [
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [f"{o.get_key_element()}={o.get_value_element_as_str()}"]
            for o in parsed
        ]
    except Exception as err:
        raise ConfigError(messages.explain(err, overrides, None)) from None
    return [list(job) for job in itertools.product(*axes)]
