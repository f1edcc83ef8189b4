"""models.py: every registered model builds for the shapes our data sets have."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampsweep import models
from ampsweep.schema import ConfigError, ModelConfig, ModelName

# digits (1x8x8, 10 classes) and a CIFAR-like shape (3x32x32, 100 classes)
SHAPES = [((1, 8, 8), 10), ((3, 32, 32), 100)]


def small(name: ModelName) -> ModelConfig:
    # Narrow variants keep the test quick; the builders are the same.
    return ModelConfig(name=name, width=8, hidden_dim=32, mlp_dim=64, num_layers=1, num_heads=2)


def test_registry_covers_every_model_name():
    assert set(models.MODELS) == set(ModelName)


@pytest.mark.parametrize("shape,classes", SHAPES, ids=["1x8x8", "3x32x32"])
@pytest.mark.parametrize("name", list(ModelName), ids=lambda n: n.name)
def test_every_model_gives_logits_of_the_right_shape(name, shape, classes):
    model = models.build_model(small(name), shape, classes)
    model.eval()
    with torch.inference_mode():
        logits = model(torch.randn(2, *shape))
    assert logits.shape == (2, classes)
    assert models.count_parameters(model) > 0


def test_vit_patch_size_must_divide_the_image():
    cfg = ModelConfig(name=ModelName.vit, patch_size=3)
    with pytest.raises(ConfigError) as info:
        models.build_model(cfg, (1, 8, 8), 10)
    message = str(info.value)
    assert "model.patch_size=3" in message and "8x8" in message and "[2, 4, 8]" in message


def test_vit_takes_one_channel_images():
    model = models.build_model(small(ModelName.vit), (1, 8, 8), 10)
    assert model.conv_proj.in_channels == 1


def test_resnet_stem_is_adapted_for_small_images():
    model = models.build_model(ModelConfig(name=ModelName.resnet18), (3, 32, 32), 10)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)


def test_resnet_keeps_its_stem_for_large_images():
    model = models.build_model(ModelConfig(name=ModelName.resnet18), (1, 96, 96), 10)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert model.conv1.in_channels == 1  # but takes the data set's channel count
    assert isinstance(model.maxpool, nn.MaxPool2d)


def test_cnn_pools_with_averages():
    # Max pooling would save int64 indices for backward that do not shrink with precision.
    model = models.build_model(ModelConfig(name=ModelName.cnn), (1, 8, 8), 10)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert models.uses_images(model)
    assert not models.uses_images(models.build_model(small(ModelName.mlp), (1, 8, 8), 10))


def test_mlp_width_and_depth():
    model = models.build_model(ModelConfig(name=ModelName.mlp, width=16, depth=3), (1, 8, 8), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [64, 64, 64, 10]
    assert linears[0].in_features == 64
