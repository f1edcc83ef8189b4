"""engine/models: every registered model builds for the shapes our data sets have; a model's
settings are checked against its builder's signature."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampsweep.config.compose import config_dir, group_options
from ampsweep.config.schema import ConfigError, ModelConfig
from ampsweep.engine import models

# digits (1x8x8, 10 classes) and a CIFAR-like shape (3x32x32, 100 classes)
SHAPES = [((1, 8, 8), 10), ((3, 32, 32), 100)]
# Narrow variants keep the test quick; the builders are the same.
SMALL = {
    "mlp": {"width": 8},
    "cnn": {"width": 8},
    "vit": {"hidden_dim": 32, "mlp_dim": 64, "num_layers": 1, "num_heads": 2},
}


def cfg(name: str, **args) -> ModelConfig:
    resolved, problems = models.MODELS.lookup(name).resolve({**SMALL.get(name, {}), **args})
    assert not problems
    return ModelConfig(name=name, args=resolved)


def test_every_model_file_has_a_builder_and_every_builder_a_file():
    assert set(models.MODELS) == set(group_options("model"))


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_every_model_file_lists_exactly_its_builders_settings(name):
    # The YAML file is where users read a model's keys (and what Hydra lets them override).
    from omegaconf import OmegaConf

    keys = set(OmegaConf.load(config_dir() / "model" / f"{name}.yaml")) - {"name"}
    assert keys == set(models.MODELS[name].settings())


# Image classifiers that need no optional library (the others have their own test files).
IMAGE_MODELS = [n for n, b in models.MODELS.items() if not {"task", "extra"} & set(b.info)]


@pytest.mark.parametrize("shape,classes", SHAPES, ids=["1x8x8", "3x32x32"])
@pytest.mark.parametrize("name", sorted(IMAGE_MODELS))
def test_every_model_gives_logits_of_the_right_shape(name, shape, classes):
    model = models.build_model(cfg(name), shape, classes)
    model.eval()
    with torch.inference_mode():
        logits = model(torch.randn(2, *shape))
    assert logits.shape == (2, classes)
    assert models.count_parameters(model) > 0


def test_settings_are_checked_against_the_builders_signature_all_at_once():
    _, problems = models.MODELS.lookup("cnn").resolve({"widht": 8, "depth": "two"})
    assert len(problems) == 2
    assert (
        "model.widht=8: unknown key 'widht' for model=cnn: did you mean model.width?"
        in (problems[0])
    )
    assert problems[1] == (
        "model.depth=two: expected an integer, or null for the default (model.depth=null)"
    )


def test_settings_are_typed_and_completed_with_the_defaults():
    resolved, problems = models.MODELS.lookup("cnn").resolve({"width": "16"})
    assert not problems
    assert resolved == {"width": 16, "depth": None, "dropout": 0.0}


def test_a_builders_own_checks_run_after_typing():
    _, problems = models.MODELS.lookup("vit").resolve({"hidden_dim": 30, "num_heads": 4})
    assert problems == ["model.hidden_dim=30 must be divisible by model.num_heads=4"]
    _, problems = models.MODELS.lookup("mlp").resolve({"width": 0, "dropout": 1.0})
    assert problems == ["model.width=0 must be > 0", "model.dropout=1.0 must be in [0, 1)"]


def test_an_unknown_model_lists_the_choices():
    with pytest.raises(ConfigError, match="model.name=convnext: invalid value: choose one of"):
        models.MODELS.lookup("convnext")


def test_vit_patch_size_must_divide_the_image():
    with pytest.raises(ConfigError) as info:
        models.build_model(cfg("vit", patch_size=3), (1, 8, 8), 10)
    message = str(info.value)
    assert "model.patch_size=3" in message and "8x8" in message and "[2, 4, 8]" in message


def test_vit_takes_one_channel_images():
    model = models.build_model(cfg("vit"), (1, 8, 8), 10)
    assert model.conv_proj.in_channels == 1


def test_resnet_stem_is_adapted_for_small_images():
    model = models.build_model(cfg("resnet18"), (3, 32, 32), 10)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)


def test_resnet_keeps_its_stem_for_large_images():
    model = models.build_model(cfg("resnet18"), (1, 96, 96), 10)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert model.conv1.in_channels == 1  # but takes the data set's channel count
    assert isinstance(model.maxpool, nn.MaxPool2d)


def test_cnn_pools_with_averages():
    # Max pooling would save int64 indices for backward that do not shrink with precision.
    model = models.build_model(cfg("cnn"), (1, 8, 8), 10)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert models.uses_images(model)
    assert not models.uses_images(models.build_model(cfg("mlp"), (1, 8, 8), 10))


def test_mlp_width_and_depth():
    model = models.build_model(cfg("mlp", width=16, depth=3), (1, 8, 8), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [64, 64, 64, 10]
    assert linears[0].in_features == 64


def test_a_builder_that_returns_no_module_is_refused():
    models.MODELS.register("not_a_module")(lambda input_shape, num_classes: "oops")
    try:
        with pytest.raises(ConfigError, match="returned a str, not a torch.nn.Module"):
            models.build_model(ModelConfig(name="not_a_module"), (1, 8, 8), 10)
    finally:
        del models.MODELS["not_a_module"]
