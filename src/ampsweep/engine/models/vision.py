"""The image models: the small built-in ones (an MLP and a convnet, sized for CPU runs on small
images), torchvision's ResNets and VisionTransformer, adapted to small images and any channel
count, and any timm architecture (``model=timm``, extra ``ampsweep[timm]``), built with random
weights unless ``model.pretrained=true``; and a small U-Net of our own for segmentation
(``model=unet``): logits of a class per pixel, at the input's resolution. Dense prediction
keeps activations of the input's full size, so memory, more than speed, decides the precision
mode there. Larger segmentation nets come from ``segmentation_models_pytorch`` through
``model._target_`` (extra ``ampsweep[segmentation]``; docs/your-task.md).

Everything that can refuse a library's model (the library missing, an unknown architecture,
pretrained weights that are not here and cannot be fetched) is a check of the builder's
settings, so it fails with one line before any run is recorded.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import socket
from typing import Any

import torch
from torch import nn

from ampsweep.config.schema import ConfigError
from ampsweep.engine.models import MODELS
from ampsweep.engine.registry import all_of, fraction, positive


@MODELS.register("mlp", check=all_of(positive("width", "depth"), fraction("dropout")))
def mlp(
    input_shape: tuple, num_classes: int, *, width: int = 64, depth: int = 2, dropout: float = 0.0
) -> nn.Module:
    """Flatten, then ``depth`` hidden layers of ``4 * width`` units."""
    width_in = 1
    for d in input_shape:
        width_in *= d
    hidden = 4 * width
    layers: list[nn.Module] = [nn.Flatten()]
    for _ in range(depth):
        layers += [nn.Linear(width_in, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout)]
        width_in = hidden
    layers.append(nn.Linear(width_in, num_classes))
    return nn.Sequential(*layers)


# The cnn stops doubling its width here: deep stacks on large images would otherwise reach
# thousands of channels (and tens of millions of weights) in their last blocks.
MAX_WIDTH_FACTOR = 8


def auto_depth(image_size: int) -> int:
    """Blocks until the feature map is about 4 px (each block halves it), at least two: so
    global pooling sees features whose receptive field covers the image (8 px: 2 blocks,
    16 px: 2, 32 px: 3, 64 px: 4)."""
    depth, size = 0, image_size
    while size > 4:
        size //= 2
        depth += 1
    return max(2, depth)


@MODELS.register("cnn", check=all_of(positive("width", "depth"), fraction("dropout")))
def cnn(
    input_shape: tuple,
    num_classes: int,
    *,
    width: int = 32,
    depth: int | None = None,
    dropout: float = 0.0,
) -> nn.Module:
    """conv-BN-ReLU blocks, doubling width (up to 8x) and halving resolution while the image is
    >= 4 px. ``depth``: the number of blocks; None follows the input (``auto_depth``).

    Average pooling rather than max pooling: max pooling saves int64 argmax indices for
    backward, which do not shrink with the precision and would blur what AMP saves.
    """
    c, h = input_shape[0], input_shape[1]
    depth = depth if depth is not None else auto_depth(min(input_shape[1:]))
    layers: list[nn.Module] = []
    width_in, size = c, h
    for i in range(depth):
        width_out = width * 2 ** min(i, MAX_WIDTH_FACTOR.bit_length() - 1)
        layers += [
            nn.Conv2d(width_in, width_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(width_out),
            nn.ReLU(inplace=True),
        ]
        if size >= 4:
            layers.append(nn.AvgPool2d(2))
            size //= 2
        width_in = width_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout)]
    layers.append(nn.Linear(width_in, num_classes))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- torchvision's


def _resnet(factory: str, input_shape: tuple, num_classes: int, small_input_max_px: int):
    # torchvision here and below, not at the top: only its models import it (a large import
    # that a run of any other model, e.g. the default cnn, would pay for nothing).
    import torchvision.models

    c, h, w = input_shape
    model = getattr(torchvision.models, factory)(weights=None, num_classes=num_classes)
    if max(h, w) <= small_input_max_px:
        # CIFAR-style stem: a 7x7/2 conv plus max-pool would shrink 32 px to 8 px at once.
        model.conv1 = nn.Conv2d(c, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif c != 3:
        model.conv1 = nn.Conv2d(c, 64, 7, stride=2, padding=3, bias=False)
    return model


@MODELS.register("resnet18", check=positive("small_input_max_px"))
def resnet18(input_shape: tuple, num_classes: int, *, small_input_max_px: int = 64) -> nn.Module:
    """torchvision ResNet-18; images of at most ``small_input_max_px`` a side get a 3x3/1 stem
    without max-pool, so small images are not pooled away."""
    return _resnet("resnet18", input_shape, num_classes, small_input_max_px)


@MODELS.register("resnet50", check=positive("small_input_max_px"))
def resnet50(input_shape: tuple, num_classes: int, *, small_input_max_px: int = 64) -> nn.Module:
    """torchvision ResNet-50, its stem adapted for small images as for resnet18."""
    return _resnet("resnet50", input_shape, num_classes, small_input_max_px)


def _check_vit(s: dict) -> list[str]:
    problems = all_of(
        positive("patch_size", "hidden_dim", "num_layers", "num_heads", "mlp_dim"),
        fraction("dropout"),
    )(s)
    if not problems and s["hidden_dim"] % s["num_heads"]:
        problems.append(
            f"hidden_dim={s['hidden_dim']} must be divisible by model.num_heads={s['num_heads']}"
        )
    return problems


@MODELS.register("vit", check=_check_vit)
def vit(
    input_shape: tuple,
    num_classes: int,
    *,
    patch_size: int = 2,
    hidden_dim: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    mlp_dim: int = 256,
    dropout: float = 0.0,
) -> nn.Module:
    """A torchvision VisionTransformer; the image size must be divisible by ``patch_size``."""
    from torchvision.models import VisionTransformer

    c, h, w = input_shape
    if h != w or h % patch_size:
        divisors = [d for d in range(1, h + 1) if h % d == 0 and d > 1]
        raise ConfigError(
            f"model.patch_size={patch_size} must divide the {h}x{w} images of this data set: "
            f"use one of {divisors}" + ("" if h == w else " (and square images)")
        )
    model = VisionTransformer(
        image_size=h,
        patch_size=patch_size,
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        mlp_dim=mlp_dim,
        dropout=dropout,
        num_classes=num_classes,
    )
    if c != 3:
        model.conv_proj = nn.Conv2d(c, hidden_dim, patch_size, stride=patch_size)
    return model


# ---------------------------------------------------------------- timm


def _check_timm(s: dict) -> list[str]:
    arch = s["arch"]
    try:
        import timm
    except ImportError:
        return [
            f"arch={arch}: model=timm needs the timm package, which is not installed: "
            "pip install 'ampsweep[timm]'"
        ]
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=3)
        hint = f"did you mean {', '.join(close)}?; " if close else ""
        return [
            f"arch={arch}: not a timm architecture: {hint}list them with "
            "python -c 'import timm; print(timm.list_models())'"
        ]
    problem = _pretrained_problem(arch) if s["pretrained"] else None
    return [problem] if problem else []


@functools.cache
def _pretrained_problem(arch: str) -> str | None:
    """Why the pretrained weights of ``arch`` cannot be had, or None once they are in the local
    cache (fetched now, before any run, when they are missing and the hub is reachable)."""
    import timm
    from timm.models import get_pretrained_cfg

    pc = get_pretrained_cfg(arch)
    if pc is None or not (pc.hf_hub_id or pc.url):
        return f"pretrained=true: timm has no pretrained weights for {arch}: use pretrained=false"
    if _cached(pc):
        return None
    if pc.hf_hub_id:
        host = "huggingface.co"
    else:
        assert isinstance(pc.url, str)  # the weights' address, where timm has no hub id
        host = pc.url.split("/")[2]
    if not _reachable(host):
        return (
            f"pretrained=true: the weights of {arch} are not in the local cache and {host} "
            "cannot be reached (no network): use model.pretrained=false, or fetch them once on "
            f"a machine with network (python -c \"import timm; timm.create_model('{arch}', "
            'pretrained=True)") and copy the Hugging Face cache here'
        )
    try:
        timm.create_model(arch, pretrained=True)  # fetches into the cache, once
    except Exception as err:
        return f"pretrained=true: fetching the weights of {arch} failed: {str(err).splitlines()[0]}"
    return None


def _cached(pc) -> bool:
    if pc.hf_hub_id:
        from huggingface_hub import try_to_load_from_cache

        repo = pc.hf_hub_id.split("@")[0]
        names = [pc.hf_hub_filename] if getattr(pc, "hf_hub_filename", None) else []
        names += ["model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"]
        return any(isinstance(try_to_load_from_cache(repo, n), str) for n in names)
    folder = os.path.join(torch.hub.get_dir(), "checkpoints")
    return os.path.isfile(os.path.join(folder, os.path.basename(pc.url)))


def _reachable(host: str) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return False
    try:
        with socket.create_connection((host, 443), timeout=3):
            return True
    except OSError:
        return False


@MODELS.register("timm", check=_check_timm, extra="timm")
def timm_model(
    num_classes: int,
    in_channels: int,
    image_size: int,
    *,
    arch: str = "resnet18d",
    pretrained: bool = False,
    args: dict[str, Any] | None = None,
) -> nn.Module:
    """``timm.create_model(arch)`` for the data's classes and channels; ``args`` are the
    architecture's own keyword arguments (``model.args.drop_rate=0.1``). Architectures that
    take an image size (ViTs) get the data's unless ``model.args.img_size`` is given."""
    import timm
    from timm.models import model_entrypoint

    kwargs = dict(args or {})
    cls = inspect.signature(model_entrypoint(arch)).return_annotation
    if "img_size" not in kwargs and inspect.isclass(cls):
        if "img_size" in inspect.signature(cls).parameters:
            kwargs["img_size"] = image_size
    return timm.create_model(
        arch, pretrained=pretrained, num_classes=num_classes, in_chans=in_channels, **kwargs
    )


# ---------------------------------------------------------------- segmentation


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A U-Net of ``depth`` levels: each halves the resolution and doubles the width on the way
    down; the way up joins each level's features again (the skip connections)."""

    def __init__(self, in_channels: int, num_classes: int, width: int, depth: int) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([_block(in_channels, widths[0])])
        self.down.extend(_block(a, b) for a, b in zip(widths, widths[1:], strict=False))
        self.up = nn.ModuleList(
            nn.ConvTranspose2d(b, a, 2, stride=2) for a, b in zip(widths, widths[1:], strict=False)
        )
        self.merge = nn.ModuleList(_block(2 * a, a) for a in widths[:-1])
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else nn.functional.max_pool2d(x, 2))
            skips.append(x)
        for up, merge, skip in reversed(list(zip(self.up, self.merge, skips, strict=False))):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.head(x)


@MODELS.register("unet", task="segmentation", check=positive("width", "depth"))
def unet(input_shape: tuple, num_classes: int, *, width: int = 16, depth: int = 2) -> nn.Module:
    """A small U-Net: ``depth`` halvings of the resolution (the image's height and width must
    divide by 2**depth), ``width`` channels at full resolution."""
    return UNet(input_shape[0], num_classes, width, depth)
