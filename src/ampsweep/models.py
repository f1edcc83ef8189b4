"""Models: a plain dict from config name to builder. Shapes come from the data set."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ampsweep.schema import ConfigError, ModelConfig, ModelName

Shape = tuple[int, int, int]  # C, H, W


def build_mlp(cfg: ModelConfig, shape: Shape, num_classes: int) -> nn.Module:
    c, h, w = shape
    hidden = 4 * cfg.width
    layers: list[nn.Module] = [nn.Flatten()]
    width_in = c * h * w
    for _ in range(cfg.depth):
        layers += [nn.Linear(width_in, hidden), nn.ReLU(inplace=True), nn.Dropout(cfg.dropout)]
        width_in = hidden
    layers.append(nn.Linear(width_in, num_classes))
    return nn.Sequential(*layers)


def build_cnn(cfg: ModelConfig, shape: Shape, num_classes: int) -> nn.Module:
    """conv-BN-ReLU blocks, doubling width and halving resolution while the image is >= 4 px.

    Average pooling rather than max pooling: max pooling saves int64 argmax indices for
    backward, which do not shrink with the precision and would blur what AMP saves.
    """
    c, h, _ = shape
    layers: list[nn.Module] = []
    width_in, size = c, h
    for i in range(cfg.depth):
        width_out = cfg.width * 2**i
        layers += [
            nn.Conv2d(width_in, width_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(width_out),
            nn.ReLU(inplace=True),
        ]
        if size >= 4:
            layers.append(nn.AvgPool2d(2))
            size //= 2
        width_in = width_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(cfg.dropout)]
    layers.append(nn.Linear(width_in, num_classes))
    return nn.Sequential(*layers)


def _build_resnet(factory: Callable) -> Callable:
    def build(cfg: ModelConfig, shape: Shape, num_classes: int) -> nn.Module:
        c, h, w = shape
        model = factory(weights=None, num_classes=num_classes)
        if max(h, w) <= cfg.small_input_max_px:
            # CIFAR-style stem: a 7x7/2 conv plus max-pool would shrink 32 px to 8 px at once.
            model.conv1 = nn.Conv2d(c, 64, 3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        elif c != 3:
            model.conv1 = nn.Conv2d(c, 64, 7, stride=2, padding=3, bias=False)
        return model

    return build


def build_vit(cfg: ModelConfig, shape: Shape, num_classes: int) -> nn.Module:
    from torchvision.models import VisionTransformer

    c, h, w = shape
    if h != w or h % cfg.patch_size:
        divisors = [d for d in range(1, h + 1) if h % d == 0 and d > 1]
        raise ConfigError(
            f"model.patch_size={cfg.patch_size} must divide the {h}x{w} images of this data set: "
            f"use one of {divisors}" + ("" if h == w else " (and square images)")
        )
    model = VisionTransformer(
        image_size=h,
        patch_size=cfg.patch_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        hidden_dim=cfg.hidden_dim,
        mlp_dim=cfg.mlp_dim,
        dropout=cfg.dropout,
        num_classes=num_classes,
    )
    if c != 3:
        model.conv_proj = nn.Conv2d(c, cfg.hidden_dim, cfg.patch_size, stride=cfg.patch_size)
    return model


def _torchvision_resnet(name: str) -> Callable:
    def factory(**kwargs) -> nn.Module:
        import torchvision.models

        return getattr(torchvision.models, name)(**kwargs)

    return factory


MODELS: dict[ModelName, Callable[[ModelConfig, Shape, int], nn.Module]] = {
    ModelName.mlp: build_mlp,
    ModelName.cnn: build_cnn,
    ModelName.resnet18: _build_resnet(_torchvision_resnet("resnet18")),
    ModelName.resnet50: _build_resnet(_torchvision_resnet("resnet50")),
    ModelName.vit: build_vit,
}


def build_model(cfg: ModelConfig, shape: Shape, num_classes: int) -> nn.Module:
    return MODELS[cfg.name](cfg, shape, num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def uses_images(model: nn.Module) -> bool:
    """Whether channels_last can matter (the model has 2-D convolutions)."""
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
