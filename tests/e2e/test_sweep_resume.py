"""A sweep stopped by SIGTERM in its second job (a real process; a callback from the config
sends the signal) and launched again without the callback: nothing finished is redone, the
interrupted job continues its own run, and skip_finished=false reruns a config."""

from __future__ import annotations

import pytest
from callbacks import signal_at_step
from conftest import callback_env, resumable, run_cli

from ampsweep.runner.context import EXIT_KILLED
from ampsweep.tracking import store


@pytest.mark.slow
def test_relaunched_sweep_skips_finished_and_resumes_interrupted(tmp_path, store_uri, main):
    args = [
        "-m",
        "precision=fp32,bf16",
        "optimizer.lr=0.001,0.002",
        *resumable(tmp_path / "ck", "trainer.max_steps=12", "trainer.checkpoint_every=3"),
        f"tracking.uri={store_uri}",
    ]
    stop = signal_at_step(6, "SIGTERM", job=1)
    stopped = run_cli(["train", *args, stop], tmp_path, env=callback_env())
    assert stopped.returncode == EXIT_KILLED, stopped.stderr
    client = store.client_for(store_uri)
    first = client.search_runs(["1"], order_by=["attributes.start_time ASC"])
    parents = [r for r in first if r.data.tags.get(store.SWEEP)]
    children = [r for r in first if not r.data.tags.get(store.SWEEP)]
    assert [p.info.status for p in parents] == [store.KILLED]
    assert [c.info.status for c in children] == [store.FINISHED, store.KILLED]
    killed_id = children[1].info.run_id
    assert "stopped at step 6" in children[1].data.tags[store.ERROR]

    again = main("train", *args)  # the relaunch, in this process
    assert again.code == 0, again.err
    out = again.out.replace("\n", "")
    assert out.count("skipped, the identical config FINISHED") == 1
    runs = client.search_runs(["1"])
    jobs = [r for r in runs if not r.data.tags.get(store.SWEEP)]
    by_config = {}
    for r in jobs:
        assert r.info.status == store.FINISHED
        by_config.setdefault(r.data.tags[store.CONFIG_HASH], []).append(r.info.run_id)
    assert len(by_config) == 4 and all(len(v) == 1 for v in by_config.values())
    resumed = client.get_run(killed_id)  # continued, not redone: the same run id
    assert resumed.info.status == store.FINISHED
    assert resumed.data.tags["resumed_at_step"] == "6"
    new_parent = [r for r in runs if r.data.tags.get(store.SWEEP) and r.info.status != store.KILLED]
    (parent,) = new_parent
    assert parent.info.status == store.FINISHED and parent.data.tags["jobs_skipped"] == "1"
    assert parent.data.tags["skipped.0"] == children[0].info.run_id
    assert resumed.data.tags[store.PARENT] == parent.info.run_id

    # tracking.skip_finished=false reruns a finished config.
    forced = main("train", *args[:1], "precision=fp32", "optimizer.lr=0.001", *args[3:],
                  "tracking.skip_finished=false")  # fmt: skip
    assert forced.code == 0, forced.err
    assert "skipped, the identical" not in forced.out
    hashes = [r.data.tags.get(store.CONFIG_HASH) for r in client.search_runs(["1"])]
    assert hashes.count(client.get_run(children[0].info.run_id).data.tags[store.CONFIG_HASH]) == 2
