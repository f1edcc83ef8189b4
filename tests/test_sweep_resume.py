"""A sweep interrupted in its second job and launched again: nothing finished is redone."""

from __future__ import annotations

import signal
import time

import pytest
from conftest import run_cli
from test_checkpoint import small, start_train


def wait_for_second_job(root, proc, timeout: float = 300) -> None:
    """Until one config has ended (an -end checkpoint) and another has a checkpoint."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ended = {p.parent.parent for p in root.glob("*/*/step-*-end.pt")}
        going = {
            p.parent.parent for p in root.glob("*/*/step-*.pt") if not p.name.endswith("-end.pt")
        }
        if ended and going - ended:
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    raise AssertionError("the second job never wrote a checkpoint")


@pytest.mark.slow
def test_relaunched_sweep_skips_finished_and_resumes_interrupted(tmp_path, store):
    from mlflow import MlflowClient

    args = [
        "-m",
        "precision=fp32,bf16",
        "optimizer.lr=0.001,0.002",
        *small(tmp_path, "trainer.max_steps=12", "trainer.checkpoint_every=3"),
        f"tracking.uri={store}",
    ]
    args.remove("tracking=none")
    proc = start_train(args, tmp_path)
    wait_for_second_job(tmp_path / "ck", proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    client = MlflowClient(store)
    first = client.search_runs(["1"], order_by=["attributes.start_time ASC"])
    parents = [r for r in first if r.data.tags.get("ampsweep.sweep")]
    children = [r for r in first if not r.data.tags.get("ampsweep.sweep")]
    assert [p.info.status for p in parents] == ["KILLED"]
    assert [c.info.status for c in children] == ["FINISHED", "KILLED"]
    killed_id = children[1].info.run_id

    again = run_cli(["train", *args], tmp_path)
    assert again.returncode == 0, again.stderr
    out = again.stdout.replace("\n", "")
    assert out.count("skipped, the identical config FINISHED") == 1
    runs = client.search_runs(["1"])
    jobs = [r for r in runs if not r.data.tags.get("ampsweep.sweep")]
    by_config = {}
    for r in jobs:
        assert r.info.status == "FINISHED"
        by_config.setdefault(r.data.tags["config_hash"], []).append(r.info.run_id)
    assert len(by_config) == 4 and all(len(v) == 1 for v in by_config.values())
    resumed = client.get_run(killed_id)  # continued, not redone: the same run id
    assert resumed.info.status == "FINISHED" and int(resumed.data.tags["resumed_at_step"]) >= 3
    new_parent = [
        r for r in runs if r.data.tags.get("ampsweep.sweep") and r.info.status != "KILLED"
    ]
    (parent,) = new_parent
    assert parent.info.status == "FINISHED" and parent.data.tags["jobs_skipped"] == "1"
    assert parent.data.tags["skipped.0"] == children[0].info.run_id
    assert resumed.data.tags["mlflow.parentRunId"] == parent.info.run_id

    # tracking.skip_finished=false reruns a finished config.
    forced = run_cli(["train", *args[:1], "precision=fp32", "optimizer.lr=0.001", *args[3:],
                      "tracking.skip_finished=false"], tmp_path)  # fmt: skip
    assert forced.returncode == 0, forced.stderr
    assert "skipped, the identical" not in forced.stdout
    hashes = [r.data.tags.get("config_hash") for r in client.search_runs(["1"])]
    assert hashes.count(client.get_run(children[0].info.run_id).data.tags["config_hash"]) == 2
