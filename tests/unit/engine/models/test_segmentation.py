"""Segmentation models: the small U-Net of our own gives a class's logits per pixel at the
input's resolution, and trains on the shape masks; segmentation_models_pytorch's networks come
in through model._target_ where that package is installed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ampsweep.config import compose
from ampsweep.engine import build, models


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_unet_gives_logits_per_pixel_at_the_inputs_resolution(depth):
    net = models.MODELS.lookup("unet").fn((3, 16, 16), 5, width=4, depth=depth)
    assert net(torch.randn(2, 3, 16, 16)).shape == (2, 5, 16, 16)


def test_the_unet_learns_the_shape_masks():
    cfg = compose.load(
        ["dataset=shape_masks", "model=unet", "dataset.num_samples=64", "dataset.image_size=16",
         "model.width=8", "model.depth=1", "trainer.device=cpu", "tracking=none",
         "trainer.batch_size=16"]
    )  # fmt: skip
    s = build.build(cfg)
    x, y = s.train_batches.x, s.train_batches.y
    opt = torch.optim.Adam(s.model.parameters(), lr=0.02)
    first = None
    for _ in range(30):
        loss = F.cross_entropy(s.model(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_a_segmentation_models_pytorch_net_through_target():
    pytest.importorskip("segmentation_models_pytorch")
    cfg = compose.load(
        ["dataset=shape_masks", "dataset.num_samples=16", "trainer.device=cpu", "tracking=none",
         "+model._target_=segmentation_models_pytorch.Unet", "+model.encoder_name=resnet18",
         "+model.encoder_weights=null", "+model.classes=3", "+model.encoder_depth=3",
         "trainer.batch_size=4",
         "+model.decoder_channels=[32,16,8]"]
    )  # fmt: skip
    s = build.build(cfg)  # its output checked against the task on two samples
    x, _ = next(iter(s.val_batches.epoch(0)))
    assert s.model(x).shape == (len(x), 3, 32, 32)
