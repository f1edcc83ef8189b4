"""A real ``ampsweep train`` process stopped at a known step (a callback from the config,
tests/callbacks.py, sends the signal there), then resumed without the callback: SIGKILL, then
``trainer.resume=auto`` continues the same MLflow run to exactly the uninterrupted result;
SIGTERM writes a checkpoint and ends the run KILLED."""

from __future__ import annotations

import signal

import pytest
from callbacks import signal_at_step
from conftest import all_runs, callback_env, resumable, run_cli

from ampsweep.config import compose as config
from ampsweep.engine import checkpoint
from ampsweep.runner import job
from ampsweep.runner.context import EXIT_KILLED
from ampsweep.tracking import store

FP16_GROWING = [  # a scale that grows every 2 clean steps, so it has changed by the kill
    "precision=fp16",
    "precision.scaler.init_scale=4.0",
    "precision.scaler.growth_interval=2",
]


def final(client, run_id: str) -> dict:
    return client.get_run(run_id).data.metrics


@pytest.mark.slow
@pytest.mark.parametrize("mode", [FP16_GROWING, ["precision=bf16"]], ids=["fp16", "bf16"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, store_uri, main, mode):
    args = [
        *resumable(tmp_path / "ck", "trainer.max_steps=36", "trainer.checkpoint_every=4", *mode),
        f"tracking.uri={store_uri}",
    ]
    kill = signal_at_step(14, "SIGKILL")
    killed_proc = run_cli(["train", *args, kill], tmp_path, env=callback_env())
    assert killed_proc.returncode == -signal.SIGKILL, killed_proc.stderr[-2000:]
    saved = sorted((tmp_path / "ck").glob("*/*/step-*.pt"))
    assert [p.name for p in saved] == ["step-00000008.pt", "step-00000012.pt"]  # keep=2
    client = store.client_for(store_uri)
    (killed,) = all_runs(store_uri)
    assert killed.info.status == store.RUNNING  # SIGKILL: nothing could end it
    resumed_from = checkpoint.load(saved[-1])
    assert resumed_from["state"]["step"] == 12

    resumed = main("train", *args, "trainer.resume=auto")  # the callback is not the run's
    assert resumed.code == 0, resumed.err
    assert f"resuming from {saved[-1]}" in resumed.out.replace("\n", "")
    reference = job.run_job(config.load([*args, "tracking.experiment=reference"]))
    runs = client.search_runs([killed.info.experiment_id])
    assert [r.info.run_id for r in runs] == [killed.info.run_id]  # the same run, continued
    assert runs[0].info.status == store.FINISHED
    a, b = final(client, killed.info.run_id), final(client, reference.run_id)
    for key in ("train/loss", "val/acc", "val/loss", "amp/skipped_steps"):
        assert a[key] == b[key], key
    assert a.get("amp/loss_scale") == b.get("amp/loss_scale")
    hist = [(m.step, m.value) for m in client.get_metric_history(killed.info.run_id, "train/loss")]
    ref = [(m.step, m.value) for m in client.get_metric_history(reference.run_id, "train/loss")]
    assert sorted(hist) == sorted(ref)  # every step once, with the uninterrupted values
    assert runs[0].data.tags["resumed_at_step"] == "12"
    if mode is FP16_GROWING:
        assert resumed_from["scaler"]["scale"] > 4.0  # the scale had grown before the kill


@pytest.mark.slow
def test_sigterm_checkpoints_and_ends_killed(tmp_path, store_uri):
    args = resumable(tmp_path / "ck", "trainer.epochs=20", "trainer.checkpoint_every=3")
    proc = run_cli(
        ["train", *args, f"tracking.uri={store_uri}", signal_at_step(4, "SIGTERM")],
        tmp_path,
        env=callback_env(),
    )
    assert proc.returncode == EXIT_KILLED, proc.stderr
    assert "SIGTERM: stopping after this step, with a checkpoint" in proc.stderr
    (run,) = all_runs(store_uri)
    assert run.info.status == store.KILLED
    folder = tmp_path / "ck" / run.data.tags["config_hash"] / run.info.run_id
    written = folder / "step-00000004.pt"
    assert run.data.tags["error"] == f"interrupted (stopped at step 4, checkpoint {written})"
    assert str(folder) == run.data.tags[store.CHECKPOINT_DIR]
    assert [p.name for p in checkpoint.checkpoints_in(folder)] == [
        "step-00000003.pt",
        "step-00000004.pt",
    ]
    assert checkpoint.load(written)["state"]["step"] == 4
    history = store.client_for(store_uri).get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [3]  # logged up to the stop, and nothing after it
