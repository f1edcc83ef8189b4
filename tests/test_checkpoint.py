"""Checkpoints and resume: contents, atomic files, config checks, exact continuation."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, run_cli

from ampsweep.app import job as runner
from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError
from ampsweep.engine import build as train
from ampsweep.engine import checkpoint, loop

FP16_GROWING = [  # a scale that grows every 2 clean steps, so it has changed by any kill
    "precision=fp16",
    "precision.scaler.init_scale=4.0",
    "precision.scaler.growth_interval=2",
]


def small(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "trainer.epochs=2",
        "trainer.batch_size=32",
        "trainer.log_every=3",
        "trainer.timing_warmup_steps=1",
        "trainer.progress=false",
        "trainer.deterministic=true",
        "model.width=4",
        "model.dropout=0.2",  # draws from the torch RNG every step: the RNG must be restored
        "tracking=none",
        f"trainer.checkpoint_dir={tmp_path / 'ck'}",
        *extra,
    ]


class StopAt:
    """Acts like runner.StopRequest with a signal arriving during optimizer step ``n``."""

    def __init__(self, n: int):
        self.n, self.seen = n, 0

    @property
    def requested(self) -> bool:
        self.seen += 1  # fit reads this once per optimizer step
        return self.seen >= self.n


def train_logged(cfg, state=None, stop=None, run_id="r"):
    setup = train.build(cfg)
    logged: list[tuple[int, dict]] = []
    ckpts = checkpoint.Checkpointer(checkpoint.folder_for(cfg, run_id), cfg, run_id)
    if state is not None:
        state = checkpoint.restore(setup, checkpoint.load(state))
    summary = loop.fit(
        setup,
        lambda m, s: logged.append((s, m)),
        state=state,
        checkpoints=ckpts,
        stop=stop or loop.NoStop(),
    )
    return summary, logged, ckpts, setup


@pytest.mark.parametrize(
    "mode",
    [FP16_GROWING, ["precision=bf16", "trainer.grad_accum_steps=2"]],
    ids=["fp16", "bf16-accum"],
)
def test_resume_continues_exactly(tmp_path, mode):
    cfg = config.load(small(tmp_path, "trainer.max_steps=16", "trainer.checkpoint_every=4", *mode))
    whole, whole_log, _, setup = train_logged(cfg, run_id="whole")
    with pytest.raises(loop.Interrupted):
        train_logged(cfg, stop=StopAt(7), run_id="cut")  # step 7: mid log window
    saved = checkpoint.checkpoints_in(checkpoint.folder_for(cfg, "cut"))
    assert [p.name for p in saved] == ["step-00000004.pt", "step-00000007.pt"]  # keep=2
    cut = checkpoint.load(saved[-1])
    rest, rest_log, ckpts, resumed = train_logged(cfg, state=saved[-1], run_id="cut")
    for key in ("val/loss", "val/acc", "amp/skipped_steps", "train/steps", "mem/activation_mib"):
        assert rest[key] == whole[key], key
    assert resumed.scaler.get_scale() == setup.scaler.get_scale()
    assert rest.get("amp/loss_scale") == whole.get("amp/loss_scale")
    # The resumed segment logs exactly the steps after 7, with the same values.
    assert rest_log == [(s, m) for s, m in whole_log if s > 7]
    assert ckpts.last.name == "step-00000016-end.pt"
    for a, b in zip(resumed.model.parameters(), setup.model.parameters(), strict=True):
        assert torch.equal(a, b)
    if mode is FP16_GROWING:  # the scale had grown before the interruption
        assert cut["scaler"]["scale"] > 4.0 and cut["state"]["loss_terms"] == 1


def test_checkpoint_is_data_and_restores_every_rng(tmp_path):
    cfg = config.load(small(tmp_path, "trainer.max_steps=2"))
    setup = train.build(cfg)
    ckpts = checkpoint.Checkpointer(tmp_path / "f", cfg, "abc")
    random.random(), np.random.rand(), torch.rand(1)
    path = ckpts.save(setup, loop.TrainState(step=3, epoch=0, batch=3, loss_sum=1.5))
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.random(), np.random.rand(), torch.rand(1)  # move every generator on
    ckpt = torch.load(path, weights_only=True)  # plain data: no pickled code
    assert ckpt["run_id"] == "abc" and ckpt["config_hash"] == checkpoint.config_hash(cfg)
    assert ckpt["state"]["loss_sum"] == 1.5
    state = checkpoint.restore(train.build(cfg), ckpt)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
    assert state == loop.TrainState(step=3, epoch=0, batch=3, loss_sum=1.5)
    assert not list(path.parent.glob("*.tmp"))  # written under a temporary name, then renamed


def test_resume_refuses_other_config_with_one_line(tmp_path):
    cfg = config.load(small(tmp_path, "trainer.max_steps=2"))
    path = checkpoint.Checkpointer(tmp_path / "f", cfg, None).save(
        train.build(cfg), loop.TrainState(step=1)
    )
    other = config.load(small(tmp_path, "trainer.max_steps=2", "optimizer.lr=0.01"))
    with pytest.raises(ConfigError) as err:
        checkpoint.check(checkpoint.load(path), other, path, str(path))
    msg = str(err.value)
    assert "optimizer.lr=0.001 in the checkpoint, 0.01 now" in msg and "\n" not in msg
    # Output locations may differ: the same config under another checkpoint_dir is accepted.
    moved = config.load(small(tmp_path / "x", "trainer.max_steps=2", "trainer.checkpoint_every=5"))
    checkpoint.check(checkpoint.load(path), moved, path, str(path))


def test_resume_choices(tmp_path, store):
    cfg = config.load(small(tmp_path, "trainer.max_steps=2"))
    assert checkpoint.locate(cfg, "auto")[0] is None  # nothing yet: start afresh
    assert not checkpoint.is_path("0123abcd")  # a run id: the job looks it up in the store
    with pytest.raises(ConfigError, match="run 0123abcd has no checkpoint"):
        checkpoint.newest_of_run("0123abcd", None)
    with pytest.raises(ConfigError, match="no such file"):
        checkpoint.locate(cfg, str(tmp_path / "nope.pt"))
    folder = checkpoint.folder_for(cfg, "run1")
    ckpts = checkpoint.Checkpointer(folder, cfg, "run1")
    first = ckpts.save(train.build(cfg), loop.TrainState(step=1))
    assert checkpoint.locate(cfg, "auto")[0] == first
    assert checkpoint.locate(cfg, str(folder))[0] == first  # a folder: its newest
    time.sleep(0.01)
    ckpts.save(train.build(cfg), loop.TrainState(step=2), complete=True)
    assert checkpoint.locate(cfg, "auto")[0] is None  # newest ended its run


def test_resume_by_run_id_continues_the_same_run(tmp_path, store):
    from mlflow import MlflowClient

    args = small(tmp_path, "trainer.max_steps=9", "trainer.checkpoint_every=3")
    args = [a for a in args if a != "tracking=none"] + [f"tracking.uri={store}"]
    cfg = config.load(args)
    first = runner.run_job(cfg)
    client = MlflowClient(store)
    # Pretend it was killed after step 6: drop the end checkpoint, mark it KILLED.
    folder = Path(client.get_run(first.run_id).data.tags["checkpoint_dir"])
    (folder / "step-00000009-end.pt").unlink()
    client.set_terminated(first.run_id, "KILLED")
    again = runner.run_job(config.load([*args, f"trainer.resume={first.run_id}"]))
    assert again.status == "FINISHED" and again.run_id == first.run_id
    history = client.get_metric_history(first.run_id, "train/loss")
    steps = [m.step for m in history]
    assert sorted(steps) == [3, 6, 9]  # step 9 was already logged: not logged twice
    run = client.get_run(first.run_id)
    assert run.data.tags["resumed_at_step"] == "6" and len(client.search_runs(["1"])) <= 1


def wait_for(pattern_root: Path, min_step: int, proc, timeout: float = 300) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [
            p
            for p in pattern_root.glob("*/*/step-*.pt")
            if int(p.name[5:13]) >= min_step and not p.name.endswith("-end.pt")
        ]
        if found:
            return found[0]
        if proc.poll() is not None:
            raise AssertionError(f"training ended before step {min_step}: {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


def start_train(args: list[str], cwd: Path) -> subprocess.Popen:
    import os

    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen(
        [sys.executable, "-m", "ampsweep", "train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def final(client, run_id: str) -> dict:
    return client.get_run(run_id).data.metrics


@pytest.mark.slow
@pytest.mark.parametrize("mode", [FP16_GROWING, ["precision=bf16"]], ids=["fp16", "bf16"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, store, mode):
    """A real process killed with SIGKILL mid-training, resumed with trainer.resume=auto."""
    from mlflow import MlflowClient

    args = [
        *small(tmp_path, "trainer.max_steps=36", "trainer.checkpoint_every=4", *mode),
        f"tracking.uri={store}",
    ]
    args.remove("tracking=none")
    proc = start_train(args, tmp_path)
    cut = wait_for(tmp_path / "ck", 12, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    client = MlflowClient(store)
    (killed,) = client.search_runs(["1"])
    assert killed.info.status == "RUNNING"  # SIGKILL: nothing could end it
    resumed_from = checkpoint.load(checkpoint.newest(list(cut.parent.glob("step-*.pt"))))
    resumed = run_cli(["train", *args, "trainer.resume=auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {cut.parent}" in resumed.stdout.replace("\n", "")
    reference = runner.run_job(config.load([*args, "tracking.experiment=reference"]))
    runs = client.search_runs(["1"])
    assert [r.info.run_id for r in runs] == [killed.info.run_id]  # the same run, continued
    assert runs[0].info.status == "FINISHED"
    a, b = final(client, killed.info.run_id), final(client, reference.run_id)
    for key in ("train/loss", "val/acc", "val/loss", "amp/skipped_steps"):
        assert a[key] == b[key], key
    assert a.get("amp/loss_scale") == b.get("amp/loss_scale")
    hist = [(m.step, m.value) for m in client.get_metric_history(killed.info.run_id, "train/loss")]
    ref = [(m.step, m.value) for m in client.get_metric_history(reference.run_id, "train/loss")]
    assert sorted(hist) == sorted(ref)  # every step once, with the uninterrupted values
    assert runs[0].data.tags["resumed_at_step"] == str(resumed_from["state"]["step"])
    if mode is FP16_GROWING:
        assert resumed_from["scaler"]["scale"] > 4.0  # the scale had grown before the kill
    print(
        f"\n{mode[0]}: resumed at step {resumed_from['state']['step']}: final loss "
        f"{a['train/loss']!r} vs {b['train/loss']!r}, scale {a.get('amp/loss_scale')} vs "
        f"{b.get('amp/loss_scale')}, val/acc {a['val/acc']} vs {b['val/acc']}"
    )


@pytest.mark.slow
def test_sigterm_checkpoints_and_ends_killed(tmp_path, store):
    from mlflow import MlflowClient

    args = small(tmp_path, "trainer.epochs=20", "trainer.checkpoint_every=3")
    args = [a for a in args if a != "tracking=none"] + [f"tracking.uri={store}"]
    proc = start_train(args, tmp_path)
    wait_for(tmp_path / "ck", 3, proc)  # training is under way
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == runner.EXIT_KILLED, err
    (run,) = MlflowClient(store).search_runs(["1"])
    assert run.info.status == "KILLED"
    reason = run.data.tags["error"]
    assert reason.startswith("interrupted (stopped at step") and "SIGTERM: stopping" in err
    written = Path(reason.split("checkpoint ")[1].rstrip(")"))
    assert written.is_file() and written.parent == Path(run.data.tags["checkpoint_dir"])
    assert checkpoint.load(written)["state"]["step"] >= 3
