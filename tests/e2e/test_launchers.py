"""Jobs in other processes: a sweep through Hydra's submitit launcher joins its parent run, and
four ``ampsweep train`` processes started together on a store that does not exist yet create
it once (under a lock) and lose nothing."""

from __future__ import annotations

import concurrent.futures
import importlib.util

import pytest
from conftest import all_runs, callback_env, require_tool, run_cli

from ampsweep.tracking import store

TINY = [
    "model=mlp",
    "model.width=8",
    "trainer.epochs=1",
    "trainer.progress=false",
    "trainer.timing_warmup_steps=1",
]


@pytest.mark.slow
def test_submitit_local_sweep_is_one_parent_with_two_finished_children(tmp_path, store_uri):
    found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher")
    require_tool("submitit", None if found else "hydra-submitit-launcher is not installed")
    args = ["train", "-m", "hydra/launcher=submitit_local", *TINY, "trainer.max_steps=4"]
    proc = run_cli([*args, "precision=fp32,bf16", f"tracking.uri={store_uri}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = all_runs(store_uri)
    parents = [r for r in runs if r.data.tags.get(store.SWEEP) == "true"]
    assert len(parents) == 1
    parent = parents[0]
    kids = [r for r in runs if r.data.tags.get(store.PARENT) == parent.info.run_id]
    assert len(runs) == 3 and len(kids) == 2
    assert {k.info.run_name: k.info.status for k in kids} == {
        "fp32-mlp-digits": "FINISHED",
        "bf16-mlp-digits": "FINISHED",
    }
    assert parent.info.status == "FINISHED"
    assert {k.data.tags["precision"] for k in kids} == {"fp32", "bf16"}
    assert parent.data.tags["jobs_finished"] == "2"
    # each job ran in a process of its own: submitit kept one log folder per job
    logs = list(tmp_path.glob("outputs/multirun/*/*/.submitit/*/*_0_log.out"))
    assert len(logs) == 2


@pytest.mark.slow
def test_jobs_that_fail_in_processes_of_their_own_are_named_by_the_command(tmp_path):
    # ampsweep_local hands each job's outcome back in its JobReturn: with nothing recorded
    # (tracking=none) the command still knows that both jobs failed, and exits non-zero.
    found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher")
    require_tool("submitit", None if found else "hydra-submitit-launcher is not installed")
    fail = "trainer.callbacks=[{_target_: ddp_callbacks.FailAtStep, step: 2, rank: 0}]"
    args = ["train", "-m", "hydra/launcher=ampsweep_local", *TINY, "trainer.max_steps=4",
            "precision=fp32,bf16", "tracking=none", fail]  # fmt: skip
    proc = run_cli(args, tmp_path, env=callback_env({"OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "error: 2 of 2 jobs failed: #0 fp32-mlp-digits (FAILED, not recorded); "
        "#1 bf16-mlp-digits (FAILED, not recorded)"
    ) in proc.stderr


@pytest.mark.slow
def test_four_processes_writing_one_new_sqlite_store_lose_nothing(tmp_path):
    # Started together on a store that does not exist yet: creating it (MLflow's migrations)
    # is serialised by a lock; then four writers log a metric batch every step.
    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    (tmp_path / "new").mkdir()

    def writer(i: int):
        args = ["train", *TINY, "trainer.max_steps=20", "trainer.log_every=1",
                "tracking.metrics_flush_every=1",  # a write per step: all the contention we can
                f"trainer.seed={i}", f"tracking.run_name=writer-{i}",
                f"tracking.uri={uri}"]  # fmt: skip
        return run_cli(args, tmp_path)

    # Four processes at once: four run_cli calls from four threads, each command forked warm.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(writer, range(4)))
    for proc in done:
        assert proc.returncode == 0, proc.stderr[-3000:]
    client = store.client_for(uri)
    runs = all_runs(uri)
    assert sorted(r.info.run_name for r in runs) == [f"writer-{i}" for i in range(4)]
    for run in runs:
        assert run.info.status == "FINISHED"
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == list(range(1, 21))
        assert {"val/acc", "perf/samples_per_s", "mem/peak_rss_mib"} <= set(run.data.metrics)
        assert len(run.data.params) > 20
        names = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.yaml", "summary.json", ".hydra"} <= names
        # all four logged the same data sets at once (a race MLflow loses without a retry)
        got = {d.dataset.name for d in run.inputs.dataset_inputs}
        assert got == {"digits-train", "digits-val"}
