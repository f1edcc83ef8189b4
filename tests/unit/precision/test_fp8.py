"""fp8 modes through torchao: the table's rows, where they are refused, which layers they
convert, and training the mlp and the ViT in torchao's emulation on a CPU (checkpoints, resume
and a pickled model included)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from ampsweep.config.compose import load
from ampsweep.config.schema import ConfigError
from ampsweep.engine import build as train
from ampsweep.engine import checkpoint, loop, run_folder
from ampsweep.engine.fp8 import check_fp8, plan
from ampsweep.engine.models.vision import mlp
from ampsweep.measure.cost import lookup_peak
from ampsweep.precision import modes, policy
from ampsweep.precision.modes import Fp8Config

pytest.importorskip("torchao", reason="fp8 needs the fp8 extra: pip install -e '.[fp8]'")

FP8 = ("fp8_tensorwise", "fp8_rowwise")
CPU = torch.device("cpu")
TINY_VIT = ["model=vit", "model.patch_size=2", "model.hidden_dim=32", "model.num_layers=1",
            "model.num_heads=2", "model.mlp_dim=64"]  # fmt: skip


def test_fp8_modes_are_rows_of_the_mode_table():
    for name in FP8:
        mode = modes.MODES[name]
        assert mode.fp8 == name.split("_")[1] and mode.flop_kind == "fp8"
        assert mode.dtype == "bf16" and mode.autocast and not mode.scaler and not mode.pure
        assert mode.min_capability == (8, 9) and mode.extra == "fp8"
        assert name in modes.NAMES
    assert modes.MODES["bf16"].flop_kind == "bf16" and not modes.MODES["bf16"].fp8


def test_fp8_peaks_are_half_the_datasheets_sparse_figures():
    assert lookup_peak("NVIDIA H100 80GB HBM3")[1].fp8 == 1979.0
    assert lookup_peak("NVIDIA H200")[1].fp8 == 1979.0
    assert lookup_peak("NVIDIA H100 PCIe")[1].fp8 == 1513.0
    assert lookup_peak("NVIDIA L4")[1].fp8 == 242.5
    assert lookup_peak("NVIDIA A100-SXM4-80GB")[1].fp8 is None  # Ampere has no fp8


@pytest.mark.parametrize("name", FP8)
def test_on_a_cpu_only_the_emulation_runs(name):
    with pytest.raises(ConfigError) as err:
        policy.resolve_mode(name, CPU)
    text = str(err.value)
    assert text.startswith(f"precision={name} on cpu runs only in torchao's emulation")
    assert "precision.fp8.emulate=true" in text and "\n" not in text
    assert policy.resolve_mode(name, CPU, emulate=True).name == name


def test_without_torchao_the_extra_is_named(monkeypatch):
    real = policy.importlib.util.find_spec
    monkeypatch.setattr(
        policy.importlib.util, "find_spec", lambda n: None if n == "torchao" else real(n)
    )
    with pytest.raises(ConfigError, match=r"needs torchao, which is not installed: pip install "
                       r"'ampsweep\[fp8\]'"):  # fmt: skip
        policy.resolve_mode("fp8_rowwise", CPU, emulate=True)


def fake_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return torch.device("cuda", 0)


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    gpu = fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    with pytest.raises(ConfigError) as err:
        policy.resolve_mode("fp8_tensorwise", gpu)
    text = str(err.value)
    assert "needs fp8 tensor cores (compute capability 8.9+" in text
    assert "NVIDIA A100-SXM4-80GB has 8.0: use precision=bf16" in text and "\n" not in text
    assert policy.resolve_mode("fp8_tensorwise", gpu, emulate=True).name == "fp8_tensorwise"


def test_hopper_and_ada_run_fp8(monkeypatch):
    assert policy.resolve_mode("fp8_rowwise", fake_gpu(monkeypatch, "NVIDIA H200", (9, 0)))
    assert policy.resolve_mode("fp8_rowwise", fake_gpu(monkeypatch, "NVIDIA L4", (8, 9)))


def test_emulation_does_not_compile():
    with pytest.raises(ConfigError, match="precision.fp8.emulate=true cannot run with "
                       "trainer.compile=true"):  # fmt: skip
        load(["precision=fp8_rowwise", "precision.fp8.emulate=true", "trainer.compile=true"])


def test_the_mlp_plan_keeps_its_first_and_last_layers():
    model = mlp((1, 8, 8), 10)  # Linear 64->256, 256->256, 256->10
    planned = plan(model, torch.zeros(2, 1, 8, 8), Fp8Config(), "rowwise")
    assert planned.converted == ["4"]
    reasons = {la.name: la.reason for la in planned.layers}
    assert reasons["1"] == "the model's first layer (precision.fp8.keep_first_last=true)"
    assert reasons["7"] == "256x10: both dimensions must be divisible by 16"
    # FLOPs of a forward pass, per sample: 2*64*256, 2*256*256, 2*256*10: the middle layer's
    # share is 65536 / (16384 + 65536 + 2560)
    assert planned.flop_share == pytest.approx(65536 / 84480)
    everything = plan(model, torch.zeros(2, 1, 8, 8), Fp8Config(keep_first_last=False))
    assert everything.converted == ["1", "4"]


def test_the_vit_plan_leaves_attention_projections_alone():
    from ampsweep.engine.models.vision import vit

    model = vit((1, 8, 8), 10, patch_size=2, hidden_dim=32, num_layers=2, num_heads=2, mlp_dim=64)
    planned = plan(model, torch.zeros(2, 1, 8, 8), Fp8Config())
    blocks = [f"encoder.layers.encoder_layer_{i}.mlp.{j}" for i in range(2) for j in (0, 3)]
    assert planned.converted == blocks
    reasons = {la.name: la.reason for la in planned.layers}
    out_proj = reasons["encoder.layers.encoder_layer_0.self_attention.out_proj"]
    assert "not a plain nn.Linear" in out_proj  # MultiheadAttention reads its weight directly
    # Linear FLOPs are 4 x 2 * 17 tokens * 32 * 64 per sample; attention and the patch
    # projection carry the rest of the forward pass
    assert 0.3 < planned.flop_share < 0.6


def test_a_model_fp8_would_not_change_is_refused():
    cfg = load(["precision=fp8_rowwise", "precision.fp8.emulate=true", "model=cnn"])
    with torch.device("meta"):
        cnn = train.models.build_model(cfg.model, (1, 8, 8), 10)
    with pytest.raises(ConfigError) as err:
        check_fp8(cnn, torch.zeros(2, 1, 8, 8), modes.MODES["fp8_rowwise"], cfg)
    text = str(err.value)
    assert text.startswith("precision=fp8_rowwise: model=cnn has no nn.Linear layer fp8 can take")
    assert "fp8 would change nothing: use precision=bf16" in text and "\n" not in text


def emulated(*extra: str, tmp_path=None) -> list[str]:
    out = ["precision.fp8.emulate=true", "trainer.epochs=1", "trainer.max_steps=6",
           "trainer.timing_warmup_steps=1", "trainer.progress=false", "trainer.log_every=2",
           "tracking=none", *extra]  # fmt: skip
    if tmp_path is not None:
        out.append(f"trainer.checkpoint_dir={tmp_path / 'ck'}")
    return out


@pytest.mark.parametrize("mode", FP8)
def test_the_mlp_trains_in_emulation_with_its_conversion_recorded(mode):
    setup = train.build(load(emulated(f"precision={mode}", "model=mlp", "model.width=8")))
    converted = [n for n, m in setup.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted == ["4"] == setup.fp8.converted
    assert setup.scaler.is_enabled() is False and setup.policy.emulated
    summary = loop.fit(setup, lambda m, s: None)
    assert 0.0 <= summary["val/acc"] <= 1.0 and summary["train/steps"] == 6
    assert summary["fp8/converted_layers"] == 1 and summary["fp8/kept_layers"] == 2
    # hidden width 32: 2*64*32, 2*32*32, 2*32*10 FLOPs per sample
    assert summary["fp8/flop_share"] == pytest.approx(2048 / (4096 + 2048 + 640))
    assert "perf/mfu" not in summary


def test_the_vit_trains_in_emulation():
    setup = train.build(load(emulated("precision=fp8_tensorwise", *TINY_VIT)))
    assert setup.fp8.converted == ["encoder.layers.encoder_layer_0.mlp.0",
                                   "encoder.layers.encoder_layer_0.mlp.3"]  # fmt: skip
    summary = loop.fit(setup, lambda m, s: None)
    assert summary["train/steps"] == 6 and summary["fp8/converted_layers"] == 2
    assert summary["mem/activation_bytes_per_sample"] > 0


def test_an_fp8_run_checkpoints_resumes_and_pickles(tmp_path):
    cfg = load(emulated("precision=fp8_rowwise", "model=mlp", "model.width=8",
                        "trainer.checkpoint_every=3", tmp_path=tmp_path))  # fmt: skip
    setup = train.build(cfg)
    folder = run_folder.folder_for(cfg, "run")
    loop.fit(setup, lambda m, s: None, checkpoints=checkpoint.Checkpointer(folder, cfg, "run"))
    saved = checkpoint.checkpoints_in(folder)
    mid = next(p for p in saved if p.name == "step-00000003.pt")
    ckpt = checkpoint.load(mid)  # weights_only=True: an fp8 model's state is plain tensors
    fresh = train.build(cfg)
    state = checkpoint.restore(fresh, ckpt)
    assert state.step == 3
    rest = loop.fit(fresh, lambda m, s: None, state=state)
    assert rest["train/steps"] == 6
    for a, b in zip(fresh.model.parameters(), setup.model.parameters(), strict=True):
        assert torch.equal(a, b)  # resumed to the same weights as the run that went through
    # A logged model is pickled (MLflow's pickle format): a float8 model survives the trip.
    copy = pickle.loads(pickle.dumps(setup.model))
    x, _ = next(iter(setup.train_batches.epoch(0)))
    with torch.no_grad(), setup.policy.autocast():
        assert torch.equal(copy(x), setup.model(x))
    assert type(copy[4]).__name__ == "Float8Linear" and isinstance(copy[1], nn.Linear)


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", FP8)
def test_real_fp8_trains_the_vit_on_a_gpu_with_compile(mode):
    if not _fp8_gpu():
        pytest.skip("needs fp8 tensor cores (compute capability 8.9+)")
    cfg = load([f"precision={mode}", "trainer.device=cuda", "trainer.compile=true",
                "trainer.batch_size=64", "trainer.epochs=1", "trainer.max_steps=12",
                "trainer.timing_warmup_steps=4", "trainer.progress=false", "tracking=none",
                "model=vit", "model.patch_size=2", "model.hidden_dim=64", "model.num_layers=2",
                "model.num_heads=2", "model.mlp_dim=128"])  # fmt: skip
    setup = train.build(cfg)
    assert not setup.policy.emulated and len(setup.fp8.converted) == 4
    summary = loop.fit(setup, lambda m, s: None)
    assert summary["train/steps"] == 12 and summary["val/acc"] > 0.1
    assert summary["fp8/flop_share"] > 0
    name = torch.cuda.get_device_name()
    if lookup_peak(name) and lookup_peak(name)[1].fp8:
        assert 0 < summary["perf/mfu"] < 1  # against the fp8 peak


def test_a_model_with_lazy_layers_is_checked_for_fp8_before_anything_runs(
    main, store_uri, monkeypatch
):
    """The up-front fp8 check builds the model on the meta device: its lazy layers learn
    their shapes there first (an uninitialised parameter was a traceback)."""
    pytest.importorskip("torchao")
    from conftest import REPO, all_runs

    example = REPO / "examples" / "doctor"
    monkeypatch.syspath_prepend(str(example))
    res = main("train", "--config-dir", str(example / "conf"), "model=overflow_net",
               "precision=fp8_tensorwise", "precision.fp8.emulate=true", "trainer.max_steps=2",
               f"tracking.uri={store_uri}")  # fmt: skip
    assert res.code == 2 and "Traceback" not in res.err
    (line,) = [ln for ln in res.err.splitlines() if ln.startswith("error:")]
    assert "model=overflow_net has no nn.Linear layer fp8 can take (layer fc1" in line
    assert all_runs(store_uri) == []
