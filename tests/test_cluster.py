"""Sweeps whose jobs run in other processes (Hydra's submitit launcher), and many processes
writing one SQLite store at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from ampsweep.config import compose as config
from tests.conftest import REPO

TINY = [
    "model=mlp",
    "model.width=8",
    "trainer.epochs=1",
    "trainer.progress=false",
    "trainer.timing_warmup_steps=1",
]


def _all_runs(uri):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(exps, max_results=1000)


def test_slurm_launcher_config_composes_with_its_knobs():
    cfg = config.compose(
        [
            "hydra/launcher=ampsweep_slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=240",
            "trainer.nproc=4",
        ],
        return_hydra_config=True,
    )
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (launcher["partition"], launcher["timeout_min"]) == ("gpu", 240)
    # one task (rank) and one GPU per process of trainer.nproc
    assert cfg.hydra.launcher.tasks_per_node == cfg.hydra.launcher.gpus_per_node == 4


def test_local_launcher_config_composes():
    cfg = config.compose(["hydra/launcher=ampsweep_local"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("submitit_launcher.LocalLauncher")
    assert cfg.hydra.launcher.tasks_per_node == 1


@pytest.mark.slow
def test_submitit_local_sweep_is_one_parent_with_two_finished_children(tmp_path, store):
    from tests.conftest import run_cli

    started = time.perf_counter()
    proc = run_cli(
        [
            "train",
            "-m",
            "hydra/launcher=submitit_local",
            *TINY,
            "trainer.max_steps=4",
            "precision=fp32,bf16",
            f"tracking.uri={store}",
        ],
        tmp_path,
    )
    wall = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"submitit_local 2-job sweep: {wall:.1f} s wall")
    _, runs = _all_runs(store)
    parents = [r for r in runs if r.data.tags.get("ampsweep.sweep") == "true"]
    assert len(parents) == 1
    parent = parents[0]
    kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 3 and len(kids) == 2
    assert {k.info.status for k in kids} == {"FINISHED"} and parent.info.status == "FINISHED"
    assert {k.data.tags["precision"] for k in kids} == {"fp32", "bf16"}
    assert parent.data.tags["jobs_finished"] == "2"
    # each job ran in a process of its own: submitit kept one log folder per job
    logs = list(tmp_path.glob("outputs/multirun/*/*/.submitit/*/*_0_log.out"))
    assert len(logs) == 2


def _train_process(tmp_path, store, i):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [
        *TINY,
        "trainer.max_steps=20",
        "trainer.log_every=1",
        "tracking.metrics_flush_every=1",  # a write per step: as much contention as we can make
        f"trainer.seed={i}",
        f"tracking.run_name=writer-{i}",
        f"tracking.uri={store}",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "ampsweep", "train", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_four_processes_writing_one_new_sqlite_store_lose_nothing(tmp_path, store):
    # Started together on a store that does not exist yet: creating it is serialised by a
    # lock, and then four writers log a metric batch every step.
    procs = [_train_process(tmp_path, store, i) for i in range(4)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    for code, err in results:
        assert code == 0, err[-3000:]
    client, runs = _all_runs(store)
    assert sorted(r.info.run_name for r in runs) == [f"writer-{i}" for i in range(4)]
    for run in runs:
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == list(range(1, 21))
        assert {"val/acc", "perf/samples_per_s", "mem/peak_rss_mib"} <= set(run.data.metrics)
        assert len(run.data.params) > 20
        names = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "summary.json", ".hydra"} <= names
