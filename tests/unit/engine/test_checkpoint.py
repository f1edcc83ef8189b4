"""engine/checkpoint.py: what a checkpoint holds, atomic files, a file that is not a good
checkpoint refused in one line, and a resumed run continuing exactly where the uninterrupted
one went; the trained model's snapshot as it is handed to MLflow. (Finding the checkpoint to
resume and checking it: test_resume_from.py.)"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import resumable

from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError
from ampsweep.engine import build as train
from ampsweep.engine import checkpoint, loop, resume_from, run_folder
from ampsweep.engine.data.batches import Batches

FP16_GROWING = [  # a scale that grows every 2 clean steps, so it has changed by any stop
    "precision=fp16",
    "precision.scaler.init_scale=4.0",
    "precision.scaler.growth_interval=2",
]
COSINE = ["precision=fp32", "optimizer.schedule=cosine", "optimizer.warmup_steps=5"]
# Not preloaded: batches come from a DataLoader with worker processes, resumed mid-epoch.
LOADER = ["precision=bf16", "dataset.preload=false", "trainer.num_workers=2"]
# fp32 master weights: the copies carry what their bf16 weights round away, so a resume that
# took its copies from the weights would diverge; the schedule reaches the copies' optimizer
MASTERS = [
    "precision=bf16_pure", "precision.master_weights=true", "trainer.grad_clip=1.0",
    "optimizer.schedule=cosine", "optimizer.warmup_steps=5",
]  # fmt: skip


def small(tmp_path: Path, *extra: str) -> list[str]:
    return [*resumable(tmp_path / "ck", *extra), "tracking=none"]


class StopAt(loop.Callback):
    """A stop request (SIGTERM) arriving during optimizer step ``n``: the stop request and
    the callback that sets it, as the job's StopRequest is set by its signal handler."""

    def __init__(self, n: int):
        self.n, self.requested = n, False

    def after_step(self, state: loop.TrainState) -> None:
        self.requested = state.step >= self.n


def train_logged(cfg, state=None, stop=None, run_id="r"):
    setup = train.build(cfg)
    logged: list[tuple[int, dict]] = []
    ckpts = checkpoint.Checkpointer(run_folder.folder_for(cfg, run_id), cfg, run_id)
    if state is not None:
        state = checkpoint.restore(setup, checkpoint.load(state))
    summary = loop.fit(
        setup,
        lambda m, s: logged.append((s, m)),
        state=state,
        checkpoints=ckpts,
        stop=stop or loop.NoStop(),
        callbacks=[stop] if stop else [],
    )
    return summary, logged, ckpts, setup


@pytest.mark.parametrize(
    "mode",
    [FP16_GROWING, ["precision=bf16", "trainer.grad_accum_steps=2"], COSINE, LOADER, MASTERS],
    ids=["fp16", "bf16-accum", "cosine-warmup", "dataloader-workers", "bf16-master-weights"],
)
def test_resume_continues_exactly(tmp_path, mode):
    cfg = config.load(small(tmp_path, "trainer.max_steps=16", "trainer.checkpoint_every=4", *mode))
    whole, whole_log, _, setup = train_logged(cfg, run_id="whole")
    with pytest.raises(loop.Interrupted, match="stopped at step 7"):
        train_logged(cfg, stop=StopAt(7), run_id="cut")  # step 7: mid log window
    saved = checkpoint.checkpoints_in(run_folder.folder_for(cfg, "cut"))
    assert [p.name for p in saved] == ["step-00000004.pt", "step-00000007.pt"]  # keep=2
    cut = checkpoint.load(saved[-1])
    rest, rest_log, ckpts, resumed = train_logged(cfg, state=saved[-1], run_id="cut")
    for key in ("val/loss", "val/acc", "amp/skipped_steps", "train/steps", "mem/activation_mib"):
        assert rest[key] == whole[key], key
    assert resumed.scaler.get_scale() == setup.scaler.get_scale()
    assert rest.get("amp/loss_scale") == whole.get("amp/loss_scale")
    # The resumed segment logs exactly the steps after 7, with the same values (train/lr:
    # the schedule continued from the checkpoint's step, not from its start).
    assert rest_log == [(s, m) for s, m in whole_log if s > 7]
    assert ckpts.last.name == "step-00000016-end.pt"
    for a, b in zip(resumed.model.parameters(), setup.model.parameters(), strict=True):
        assert torch.equal(a, b)
    if mode is FP16_GROWING:  # the scale had grown before the interruption
        assert cut["scaler"]["scale"] > 4.0 and cut["state"]["loss_terms"] == 1
    if mode is LOADER:
        assert not setup.train_batches.preload and setup.train_batches.num_workers == 2
    if mode is COSINE:  # warm-up, then decay: a schedule restarted at step 0 would show
        lrs = [m["train/lr"] for _, m in whole_log if "train/lr" in m]
        assert lrs[0] < lrs[1] and lrs[-1] < max(lrs)
        assert cut["schedule"]["last_epoch"] == 7
    if mode is MASTERS:
        saved_masters = cut["optimizer"]["master_weights"]
        assert any(not torch.equal(m, m.bfloat16().float()) for m in saved_masters)
        for a, b in zip(resumed.optimizer.masters, setup.optimizer.masters, strict=True):
            assert torch.equal(a, b)


def test_checkpoint_is_data_and_restores_every_rng(tmp_path):
    cfg = config.load(small(tmp_path, "trainer.max_steps=2"))
    setup = train.build(cfg)
    ckpts = checkpoint.Checkpointer(tmp_path / "f", cfg, "abc")
    random.random(), np.random.rand(), torch.rand(1)
    path = ckpts.save(setup, loop.TrainState(step=3, epoch=0, batch=3, loss_sum=1.5))
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.random(), np.random.rand(), torch.rand(1)  # move every generator on
    ckpt = torch.load(path, weights_only=True)  # plain data: no pickled code
    assert ckpt["run_id"] == "abc" and ckpt["config_hash"] == run_folder.config_hash(cfg)
    assert ckpt["state"]["loss_sum"] == 1.5
    state = checkpoint.restore(train.build(cfg), ckpt)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert state == loop.TrainState(step=3, epoch=0, batch=3, loss_sum=1.5)
    assert not list(path.parent.glob("*.tmp"))  # written under a temporary name, then renamed


def test_a_secret_in_the_config_is_masked_in_the_checkpoint(tmp_path):
    secret = "s3cr3t-in-a-checkpoint"
    cfg = config.load(small(tmp_path, "trainer.max_steps=2", f"tracking.run_name=run-{secret}"))
    ckpts = checkpoint.Checkpointer(
        tmp_path / "f", cfg, "abc", mask=lambda text: text.replace(secret, "***")
    )
    path = ckpts.save(train.build(cfg), loop.TrainState(step=1))
    assert secret.encode() not in path.read_bytes()
    ckpt = checkpoint.load(path)
    assert ckpt["config"]["tracking.run_name"] == "run-***"
    # The hash is of the real config, so the same config still resumes from it ...
    resume_from.check(ckpt, cfg, path, str(path), mask=ckpts.mask)
    # ... and a refusal names the real difference, not the masked value.
    other = config.load(
        small(tmp_path, "trainer.max_steps=2", f"tracking.run_name=run-{secret}", "trainer.seed=1")
    )
    with pytest.raises(ConfigError) as err:
        resume_from.check(ckpt, other, path, str(path), mask=ckpts.mask)
    assert "trainer.seed=0 in the checkpoint, 1 now" in str(err.value)
    assert "(and" not in str(err.value) and secret not in str(err.value)


# ---------------------------------------------------------------- every refusal, one line


def refusal(call) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("content", [b"not a zip file at all", b""], ids=["garbage", "empty"])
def test_a_corrupt_file_is_refused(tmp_path, content):
    bad = tmp_path / "step-00000003.pt"
    bad.write_bytes(content)
    message = refusal(lambda: checkpoint.load(bad))
    assert f"{bad} is not a readable ampsweep checkpoint" in message
    assert "resume from an earlier checkpoint" in message


@pytest.mark.parametrize(
    "payload", [{"weights": torch.zeros(2)}, [1, 2], {"format": 99}], ids=["dict", "list", "newer"]
)
def test_a_foreign_file_is_refused(tmp_path, payload):
    foreign = tmp_path / "model.pt"
    torch.save(payload, foreign)
    message = refusal(lambda: checkpoint.load(foreign))
    assert f"{foreign} is not an ampsweep checkpoint of format {checkpoint.FORMAT}" in message


def test_a_checkpoint_holding_code_is_refused(tmp_path):
    # weights_only=True: loading never runs pickled code; such a file is refused, not run.
    pickled = tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "hook": Path("x")}, pickled)
    assert "not a readable ampsweep checkpoint" in refusal(lambda: checkpoint.load(pickled))


def _batches(x, y, dtype=torch.float32) -> Batches:
    return Batches((x, y), 16, torch.device("cpu"), dtype, shuffle=False, drop_last=False,
                   seed=0, preload=True)  # fmt: skip


def test_a_pure_bf16_model_is_copied_to_fp32_and_gives_its_weights_back_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 10), torch.nn.BatchNorm1d(10)
    )
    model = model.to(torch.bfloat16)
    x, y = torch.randn(40, 1, 8, 8), torch.arange(40) % 10
    snap = checkpoint.snapshot(model, _batches(x, y, torch.bfloat16))
    copied = dict(snap.module.state_dict())
    for name, t in model.state_dict().items():
        assert copied[name].device.type == "cpu"
        if t.is_floating_point():
            assert copied[name].dtype == torch.float32
            assert torch.equal(copied[name].to(torch.bfloat16), t)
        else:
            assert copied[name].dtype == t.dtype  # e.g. BatchNorm's step count stays int64
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the original untouched
    assert isinstance(next(snap.module.parameters()), torch.nn.Parameter)
    assert not snap.module.training
    # one batch of inputs, in fp32 (numpy has no bf16), and the fp32 model's output on it
    assert snap.example.shape == (16, 1, 8, 8) and snap.example.dtype.name == "float32"
    out = snap.predict(snap.example)
    assert out.shape == (16, 10) and out.dtype.name == "float32"
    assert "torch" in snap.packages


def test_the_compiled_wrapper_is_not_logged_but_its_module():
    model = torch.nn.Linear(4, 2)
    compiled = torch.compile(model)  # wrapping alone compiles nothing
    batches = _batches(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    snap = checkpoint.snapshot(compiled, batches)
    assert type(snap.module) is torch.nn.Linear
    assert torch.equal(snap.module.weight, model.weight)
    assert snap.module.weight.data_ptr() != model.weight.data_ptr()  # a copy


def test_the_input_example_of_large_inputs_is_cut_to_whole_rows():
    x = torch.randn(16, 3, 100, 100)  # 30,000 values a row
    snap = checkpoint.snapshot(torch.nn.Flatten(), _batches(x, torch.zeros(16, dtype=torch.long)))
    assert snap.example.shape == (checkpoint.EXAMPLE_VALUES // 30_000, 3, 100, 100)
