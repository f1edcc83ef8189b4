"""Models: the MODELS registry, and building a model (registered or ``_target_``) for a data
set's shape.

A model is one function registered with ``@MODELS.register(name)`` in a module of this
package (every module here is imported, so a new file registers itself) plus one YAML file
``conf/model/<name>.yaml``; or any class or factory returning an ``nn.Module``, named by
``model._target_``. The callable receives what ampsweep knows about the data when its
signature asks for it by name: ``input_shape`` and ``num_classes`` always; ``in_channels`` and
``image_size`` for images (C, H, W); ``vocab_size`` and ``seq_len`` for token sequences. Its
other keyword parameters are the user's settings (``model.<key>``).
"""

from __future__ import annotations

import importlib
import pkgutil

import torch
from torch import nn

from ampsweep.config.schema import ConfigError, ModelConfig
from ampsweep.engine.registry import Registry

Shape = tuple[int, ...]  # C, H, W for images; (T,) for token sequences

MODELS = Registry(
    "model",
    provided=("input_shape", "num_classes", "in_channels", "image_size", "vocab_size", "seq_len"),
)


def provided_values(shape: Shape, num_classes: int) -> dict:
    """What ampsweep can tell a model about the data of this shape."""
    values = {"input_shape": tuple(shape), "num_classes": num_classes}
    if len(shape) == 3:  # an image
        values.update(in_channels=shape[0], image_size=shape[-1])
    if len(shape) == 1:  # a token sequence; the classes are the vocabulary
        values.update(vocab_size=num_classes, seq_len=shape[0])
    return values


def build_model(cfg: ModelConfig, shape: Shape, num_classes: int) -> nn.Module:
    builder = MODELS.builder(cfg)
    known = provided_values(shape, num_classes)
    missing = sorted(builder.wants() - set(known))
    if missing:
        kind = "images" if len(shape) == 3 else f"data of shape {tuple(shape)}"
        raise ConfigError(
            f"{builder.label} asks for {', '.join(missing)}, which {kind} do not provide: "
            f"use it with data that has them (this data provides {', '.join(known)})"
        )
    try:
        model = builder.fn(**{k: known[k] for k in builder.wants()}, **cfg.args)
    except ConfigError:
        raise
    except Exception as err:
        if not builder.target:
            raise
        raise ConfigError(
            f"{builder.label}: building the model failed ({type(err).__name__}: "
            f"{' '.join(str(err).split())}): check the model's arguments"
        ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{builder.label}: the builder returned a {type(model).__name__}, not a "
            "torch.nn.Module: return the model itself"
        )
    return model


@torch.no_grad()
def dry_run(model: nn.Module, x: torch.Tensor, label: str):
    """One forward pass on a couple of samples, in eval mode (no running statistics move):
    it gives lazy layers (``nn.LazyLinear``) their shapes before parameters are counted and
    the optimizer, DDP and compile see them, and its output is checked against the task."""
    was_training = model.training
    model.eval()
    try:
        out = model(x)
    except Exception as err:
        raise ConfigError(
            f"{label}: a forward pass on a batch of shape {tuple(x.shape)} failed "
            f"({type(err).__name__}: {' '.join(str(err).split())[:300]}): make the model "
            "accept the data's input shape"
        ) from None
    finally:
        model.train(was_training)
    return out  # a tensor, dict, tuple or ModelOutput: the task judges it


def has_lazy_parameters(model: nn.Module) -> bool:
    return any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters())


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def uses_images(model: nn.Module) -> bool:
    """Whether channels_last can matter (the model has 2-D convolutions)."""
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


# Every module of this package registers its models on import.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
