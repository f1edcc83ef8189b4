"""engine/models/vision: the cnn's depth follows the input unless model.depth is set."""

from __future__ import annotations

import pytest
import torch

from ampsweep.engine.models.vision import auto_depth


@pytest.mark.parametrize("size,depth", [(8, 2), (16, 2), (28, 3), (32, 3), (64, 4), (224, 6)])
def test_the_cnns_depth_follows_the_input_until_the_map_is_about_4_px(size, depth):
    assert auto_depth(size) == depth
    model = build_cnn(size)
    convs = [m for m in model if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == depth
    assert max(c.out_channels for c in convs) <= 8 * 32  # width stops doubling at 8x


def test_a_set_depth_wins():
    model = build_cnn(32, depth=2)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in model) == 2


def build_cnn(size: int, **args):
    from ampsweep.config.schema import ModelConfig
    from ampsweep.engine.models import MODELS, build_model

    resolved, problems = MODELS.lookup("cnn").resolve(args)
    assert not problems
    return build_model(ModelConfig("cnn", resolved), (3, size, size), 10)
