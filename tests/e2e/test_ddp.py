"""DDP for real: two Gloo processes on CPU train like one process with the global batch,
``trainer.nproc=2`` is one MLflow run, a DDP run resumes from its checkpoint, and a rank that
crashes ends the command non-zero instead of hanging."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from callbacks import signal_at_step
from conftest import EXACT, REPO, all_runs, callback_env, run_cli

from ampsweep.tracking import store

# Each rank builds and trains the same config through train.build/fit, then saves its
# parameters; the test compares the ranks and a single process with the same global batch.
WORKER = textwrap.dedent(
    """
    import json, sys, torch
    from ampsweep.config import compose as config
    from ampsweep.engine import build as train
    from ampsweep.engine import distributed, loop
    overrides, out = json.loads(sys.argv[1]), sys.argv[2]
    rank = distributed.from_env()
    distributed.init(rank, "cpu")
    cfg = config.load(overrides)
    setup = train.build(cfg)
    summary = loop.fit(setup, lambda m, s: None)
    state = distributed.unwrap(setup.model).state_dict()
    torch.save({"state": state, "summary": summary}, f"{out}/rank{rank.rank}.pt")
    distributed.shutdown(wait_for_all=True)
    """
)


def _env():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("WORLD_SIZE", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.slow
def test_two_ranks_equal_each_other_and_one_process_with_the_global_batch(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    overrides = [*EXACT, "tracking=none", "trainer.batch_size=16"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, str(script), json.dumps(overrides), str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for key, value in r0["state"].items():
        assert torch.equal(value, r1["state"][key]), key  # DDP keeps replicas bit-identical

    # One process, batch 32 = 2 ranks x 16: the same samples per step, the same updates.
    from ampsweep.config import compose as config
    from ampsweep.engine import build as train
    from ampsweep.engine import loop

    setup = train.build(config.load([*EXACT, "tracking=none", "trainer.batch_size=32"]))
    single = loop.fit(setup, lambda m, s: None)
    # Tolerance: only the order of float additions differs (two means averaged by all_reduce
    # against one mean over 32), about 1e-7 relative per step, over 12 SGD steps.
    for key, value in setup.model.state_dict().items():
        torch.testing.assert_close(r0["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert r0["summary"]["train/steps"] == single["train/steps"] == 12
    # validation over the whole split: both ranks report the same, equal to one process's
    assert r0["summary"]["val/acc"] == r1["summary"]["val/acc"] == pytest.approx(single["val/acc"])
    assert r0["summary"]["val/loss"] == pytest.approx(single["val/loss"], rel=1e-5)


@pytest.mark.slow
def test_a_ddp_run_is_one_mlflow_run_and_resumes_to_the_same_weights(tmp_path, store_uri):
    """trainer.nproc=2 is one MLflow run (rank 0 records, rank 1 is quiet). Rank 0 writes the
    checkpoints (the plain module's weights), every rank restores the same one, and the resumed
    run ends where the uninterrupted one did."""
    base = ["train", *EXACT, "trainer.batch_size=16", "trainer.nproc=2"]
    base += ["trainer.checkpoint_every=4", "trainer.keep_checkpoints=10"]
    env = {"OMP_NUM_THREADS": "1"}
    full = run_cli(
        [*base, f"trainer.checkpoint_dir={tmp_path / 'a'}", f"tracking.uri={store_uri}"],
        tmp_path,
        env=env,
    )
    assert full.returncode == 0, full.stderr[-3000:]
    runs = all_runs(store_uri)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["world_size"] == "2"
    assert run.data.params["trainer.nproc"] == "2"
    assert {"val/acc", "perf/samples_per_s", "mem/peak_rss_mib"} <= set(run.data.metrics)
    # only rank 0 wrote Hydra's output folder
    assert len(list((tmp_path / "outputs" / "runs").glob("*/*"))) == 1
    assert full.stdout.count("finished") == 1  # rank 1 is quiet

    saved = sorted((tmp_path / "a").glob("*/*/step-*.pt"))
    assert [p.name for p in saved] == [
        "step-00000004.pt", "step-00000008.pt", "step-00000012-end.pt"
    ]  # fmt: skip
    # As if the run had been killed after step 4: resume it from that checkpoint.
    store.client_for(store_uri).set_terminated(run.info.run_id, store.KILLED)
    resumed = run_cli(
        [*base, f"trainer.checkpoint_dir={tmp_path / 'b'}", f"tracking.uri={store_uri}",
         f"trainer.resume={saved[0]}"],
        tmp_path,
        env=env,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (again,) = all_runs(store_uri)  # the same run, continued by both ranks
    assert again.info.run_id == run.info.run_id and again.info.status == store.FINISHED
    assert again.data.tags["resumed_at_step"] == "4"
    assert f"resuming from {saved[0]}" in resumed.stdout.replace("\n", "")
    (end,) = (tmp_path / "b").glob("*/*/step-*-end.pt")
    a = torch.load(saved[-1], weights_only=True)
    b = torch.load(end, weights_only=True)
    assert a["state"]["step"] == b["state"]["step"] == 12
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert not any(k.startswith("module.") for k in a["model"])  # DDP's wrapper is not saved


@pytest.mark.slow
def test_every_rank_of_a_ddp_run_keeps_the_named_modules_in_fp32(tmp_path, store_uri):
    """precision.keep_fp32 under DDP: each rank runs the kept layer in fp32 and the others in
    bf16 (a callback records what the layers output on every rank). Only rank 0 records the
    run: no other rank imports MLflow (another callback records what each rank imported)."""
    seen, imported = tmp_path / "dtypes.jsonl", tmp_path / "imports.jsonl"
    record = (f"trainer.callbacks=[{{_target_: callbacks.RecordDtypes, path: '{seen}', "
              f"modules: ['1', '4']}}, {{_target_: callbacks.RecordImports, path: '{imported}', "
              "modules: [mlflow]}]")  # fmt: skip
    args = ["train", *EXACT, "precision=bf16", "precision.keep_fp32=[1]", "trainer.nproc=2",
            "trainer.batch_size=16", record, f"tracking.uri={store_uri}"]  # fmt: skip
    args.remove("precision=fp32")
    proc = run_cli(args, tmp_path, env=callback_env({"OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in seen.read_text().splitlines()]
    assert {r["rank"] for r in records} == {0, 1}
    assert all(r["1"] == "torch.float32" and r["4"] == "torch.bfloat16" for r in records)
    ranks = [json.loads(line) for line in imported.read_text().splitlines()]
    assert sorted((r["rank"], r["mlflow"]) for r in ranks) == [(0, True), (1, False)]
    (run,) = all_runs(store_uri)
    assert run.info.status == "FINISHED" and run.data.params["precision.keep_fp32"] == "['1']"


@pytest.mark.slow
def test_a_crashing_rank_ends_the_command_non_zero_without_hanging(tmp_path, store_uri):
    """Rank 1 dies (SIGKILL) at step 3 while rank 0 waits for it in a collective: the elastic
    agent ends rank 0 and the command exits non-zero in seconds, not at some timeout."""
    args = ["train", *EXACT, "trainer.batch_size=16", "trainer.nproc=2"]
    args += ["trainer.max_steps=400", "trainer.epochs=100", f"tracking.uri={store_uri}"]
    args += [signal_at_step(3, "SIGKILL", rank=1)]
    started = time.monotonic()
    proc = run_cli(
        args,
        tmp_path,
        env=callback_env({"OMP_NUM_THREADS": "1"}),
        timeout=240,
    )
    took = time.monotonic() - started
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert took < 180, f"the command took {took:.0f} s to notice the dead rank"
    (run,) = all_runs(store_uri)  # rank 0's run: ended, not left RUNNING
    assert run.info.status in (store.FAILED, store.KILLED), run.data.tags.get(store.ERROR)
    history = store.client_for(store_uri).get_metric_history(run.info.run_id, "train/loss")
    assert max((m.step for m in history), default=0) < 400  # it did not train on alone


@pytest.mark.slow
def test_a_ddp_config_error_is_found_before_any_rank_starts(tmp_path):
    """A missing data set with trainer.nproc=2 is the parent's one line and exit 2: no rank
    starts, so no rank the launcher stops can make it 'interrupted' (130). (That no rank
    looks, which once made this a race, test_the_data_set_is_checked_in_the_parent_only
    proves every time; one command is enough here.)"""
    args = ["train", "trainer.nproc=2", "dataset=mnist", f"dataset.root={tmp_path / 'none'}",
            "tracking=none", "trainer.max_steps=2"]  # fmt: skip
    res = run_cli(args, tmp_path, timeout=300)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: dataset=mnist: no data under"), lines
    assert "rank" not in res.stderr and "interrupted" not in res.stderr
    assert "Traceback" not in res.stdout


@pytest.mark.slow
def test_a_failing_rank_is_reported_with_its_own_exit_code(tmp_path, store_uri):
    """Rank 1 fails on its own at step 2 (and rank 0's collective with it, or the launcher
    stops rank 0). The command says a rank failed and exits with its code (1), not a stopped
    rank's 'interrupted' (130)."""
    hook = "trainer.callbacks=[{_target_: ddp_callbacks.FailAtStep, step: 2, rank: 1}]"
    args = ["train", *EXACT, "trainer.batch_size=16", "trainer.nproc=2", "trainer.max_steps=400",
            "trainer.epochs=100", f"tracking.uri={store_uri}", hook]  # fmt: skip
    proc = run_cli(args, tmp_path, env=callback_env({"OMP_NUM_THREADS": "1"}), timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = [x for x in proc.stderr.splitlines() if x.strip()][-1]
    assert re.match(r"error: trainer.nproc=2: rank [01] failed with exit code 1 ", last), last
    (run,) = all_runs(store_uri)
    assert run.info.status in (store.FAILED, store.KILLED)


GONE = """\
import os

from ampsweep.errors import ConfigError


def gone(record: str):
    with open(record, "a") as out:  # who looked for the data: the parent, or a rank
        out.write(os.environ.get("RANK", "parent") + "\\n")
    raise ConfigError("dataset=gone: no data under /nowhere: point dataset.root at it")
"""


@pytest.mark.slow
def test_the_data_set_is_checked_in_the_parent_only(tmp_path):
    """The data set is looked for once, in the parent, before any rank starts: a missing one
    is one line and exit 2 from the parent, and no rank ever looks for it."""
    (tmp_path / "gonedata.py").write_text(GONE)
    (tmp_path / "conf" / "dataset").mkdir(parents=True)
    record = tmp_path / "looked.txt"
    (tmp_path / "conf" / "dataset" / "gone.yaml").write_text(
        f"_target_: gonedata.gone\nrecord: {record}\n"
    )
    args = ["train", "--config-dir", "conf", "trainer.nproc=2", "dataset=gone", "model=mlp",
            "tracking=none", "trainer.max_steps=2"]  # fmt: skip
    res = run_cli(args, tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines == ["error: dataset=gone: no data under /nowhere: point dataset.root at it"]
    assert record.read_text().splitlines() == ["parent"]
