"""Checking a config's components against their registries, before anything is built.

``resolve`` looks up the model, data set and optimizer a config names and checks each one's
settings against its builder's signature and checks: every problem of all three in one
message. The config it returns has every setting typed and every default filled in, so the
logged params and the config hash say exactly what ran.
"""

from __future__ import annotations

from dataclasses import replace

from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine.data import DATASETS
from ampsweep.engine.models import MODELS
from ampsweep.engine.optim import OPTIMIZERS

REGISTRIES = {"model": MODELS, "dataset": DATASETS, "optimizer": OPTIMIZERS}


def resolve(cfg: Config) -> Config:
    """``cfg`` with each component's settings checked, typed and completed. Idempotent."""
    problems: list[str] = []
    resolved = {}
    for section, registry in REGISTRIES.items():
        component = getattr(cfg, section)
        try:
            builder = registry.lookup(component.name)
        except ConfigError as err:
            problems.append(str(err))
            continue
        args, found = builder.resolve(component.args)
        problems.extend(found)
        resolved[section] = replace(component, args=args)
    if problems:
        raise ConfigError("; ".join(problems))
    return replace(cfg, **resolved)
