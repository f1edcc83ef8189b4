"""engine/models/vision: the cnn's depth follows the input unless model.depth is set; timm
architectures train in every CPU precision mode; a missing timm, an unknown architecture or
unreachable pretrained weights are refused in one line before anything is recorded. The small
U-Net of our own gives a class's logits per pixel at the input's resolution, and trains on the
shape masks; segmentation_models_pytorch's networks come in through model._target_ where that
package is installed."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from ampsweep.cli.doctor import ROUNDS
from ampsweep.cli.train import cmd_train
from ampsweep.config import compose
from ampsweep.config.schema import ConfigError
from ampsweep.engine import components, models
from ampsweep.engine.build import build
from ampsweep.engine.loop import fit
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


QUICK = [
    "trainer.epochs=1", "trainer.max_steps=8", "trainer.batch_size=16", "trainer.log_every=2",
    "trainer.timing_warmup_steps=1", "trainer.progress=false", "tracking=none",
    "optimizer.lr=2e-3",
]  # fmt: skip
TIMM = {
    # timm's own small ResNet (resnet18d and the rest build the same way; fp16 convolutions
    # are slow on a CPU without native fp16, so the suite keeps the network small)
    "resnet": ["model.arch=test_resnet"],
    # a tiny ViT: 2x2 patches of the 8x8 digits (the image size is passed from the data),
    # average-pooled tokens; it learns more slowly than a convnet, so it takes more steps
    "vit": [
        "model.arch=vit_tiny_patch16_224",
        "model.args.patch_size=2",
        "model.args.depth=2",
        "model.args.embed_dim=32",
        "model.args.num_heads=2",
        "model.args.mlp_ratio=2",
        "model.args.class_token=false",
        "model.args.global_pool=avg",
        "trainer.max_steps=40",
        "trainer.log_every=10",
    ],
}


def train_located(*overrides: str):
    """The summary, the train/loss of each log window, and the run's non-finite locator."""
    setup = build(compose.load([*QUICK, *overrides]))
    losses: list[float] = []
    summary = fit(setup, lambda m, s: losses.append(m["train/loss"]) if "train/loss" in m else 0)
    return summary, losses, setup.locator


@pytest.mark.parametrize(
    "arch,precision",
    [("resnet", "fp32"), ("resnet", "fp16"), ("resnet", "bf16"), ("vit", "fp16"), ("vit", "bf16")],
)
def test_timm_models_train_on_digits(arch, precision):
    """On every CPU: where this device's half-precision kernels produce a broken gradient (on
    an Intel Xeon with AMX, and on an AMD EPYC with avx512_bf16, a few convolutions' bf16
    backward does, not every time), the run names the module, and keeping the modules it
    names in fp32 (precision.keep_fp32, as the doctor prescribes: at most ROUNDS) trains."""
    pytest.importorskip("timm", reason="pip install 'ampsweep[timm]'")
    args = ["model=timm", f"precision={precision}", *TIMM[arch]]
    summary, losses, locator = train_located(*args)
    keep: list[str] = []
    for _ in range(ROUNDS):
        origin = locator.origin
        if origin is None or origin.scaled_overflow:  # finite, or a scaler settling its scale
            break
        assert origin.module and origin.kind in ("forward", "weight_grad", "input_grad"), (
            origin.sentence()
        )
        keep.append(origin.module)
        summary, losses, locator = train_located(*args, f"precision.keep_fp32=[{','.join(keep)}]")
    assert locator.origin is None or locator.origin.scaled_overflow, locator.advice()
    assert len(losses) == 4 and summary["train/steps"] in (8, 40)
    assert losses[-1] < losses[0], losses  # it learns
    assert summary["val/loss"] == summary["val/loss"]  # evaluated: a number, not NaN


def test_a_timm_vit_gets_the_datas_image_size_and_channels():
    pytest.importorskip("timm")
    setup = build(compose.load([*QUICK, "model=timm", *TIMM["vit"]]))
    assert setup.model.num_prefix_tokens == 0  # model.args reached timm
    assert setup.model.patch_embed.img_size == (8, 8)
    assert setup.model.patch_embed.proj.in_channels == 1 and setup.model.head.out_features == 10


def check(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        components.resolve(compose.load(list(overrides)))
    return str(err.value)


def test_an_unknown_timm_architecture_is_refused_with_suggestions():
    pytest.importorskip("timm")
    text = check("model=timm", "model.arch=resnet18x")
    assert text.startswith("model.arch=resnet18x: not a timm architecture: did you mean resnet18")


def test_timm_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm now raises ImportError
    assert check("model=timm") == (
        "model.arch=resnet18d: model=timm needs the timm package, which is not installed: "
        "pip install 'ampsweep[timm]'"
    )


def test_pretrained_weights_offline_fail_before_anything_is_recorded(
    store, tmp_path, monkeypatch, capsys
):
    pytest.importorskip("timm")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without network
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.chdir(tmp_path)
    code = cmd_train(["-m", "model=timm", "model.pretrained=true", "precision=fp32,bf16",
                      f"tracking.uri={store}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err
    assert (
        "model.pretrained=true: the weights of resnet18d are not in the local cache and "
        "huggingface.co cannot be reached (no network): use model.pretrained=false"
    ) in " ".join(err.split())
    client = __import__("ampsweep.tracking.store", fromlist=["x"]).client_for(store)
    assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []


# ---------------------------------------------------------------- segmentation


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
    s = build(cfg)
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
    s = build(cfg)  # its output checked against the task on two samples
    x, _ = next(iter(s.val_batches.epoch(0)))
    assert s.model(x).shape == (len(x), 3, 32, 32)
