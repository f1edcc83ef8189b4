"""Models: the MODELS registry, and building a registered model for a data set's shape.

A model is one function registered with ``@MODELS.register(name)`` in a module of this
package (every module here is imported, so a new file registers itself) plus one YAML file
``conf/model/<name>.yaml``. The function receives what ampsweep knows about the data when its
signature asks for it (``input_shape`` (C, H, W), ``num_classes``, ``in_channels``,
``image_size``) and its own settings as keyword arguments (``model.<key>``).
"""

from __future__ import annotations

import importlib
import pkgutil

import torch
from torch import nn

from ampsweep.config.schema import ConfigError, ModelConfig
from ampsweep.engine.registry import Registry

Shape = tuple[int, ...]  # C, H, W for images

MODELS = Registry("model", provided=("input_shape", "num_classes", "in_channels", "image_size"))


def provided_values(shape: Shape, num_classes: int) -> dict:
    return {
        "input_shape": tuple(shape),
        "num_classes": num_classes,
        "in_channels": shape[0],
        "image_size": shape[-1],
    }


def build_model(cfg: ModelConfig, shape: Shape, num_classes: int) -> nn.Module:
    builder = MODELS.lookup(cfg.name)
    known = provided_values(shape, num_classes)
    import inspect

    wanted = inspect.signature(builder.fn).parameters
    model = builder.fn(**{k: v for k, v in known.items() if k in wanted}, **cfg.args)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model={cfg.name}: the builder returned a {type(model).__name__}, not a "
            "torch.nn.Module: return the model itself"
        )
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def uses_images(model: nn.Module) -> bool:
    """Whether channels_last can matter (the model has 2-D convolutions)."""
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


# Every module of this package registers its models on import.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
