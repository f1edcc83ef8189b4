"""Every command the report suggests runs as printed and does what it says: here, the
suggestion to train longer after a sweep whose baseline has not learned."""

from __future__ import annotations

import shlex

from conftest import all_runs

from ampsweep.report import sweeps
from ampsweep.tracking import store

# Three steps at a learning rate that cannot move the weights: the baseline stays at chance.
SHORT = ["model=mlp", "model.width=8", "optimizer=sgd", "optimizer.lr=1e-9"]
SHORT += ["trainer.epochs=1", "trainer.max_steps=3", "trainer.progress=false"]
SHORT += ["trainer.log_every=1", "trainer.timing_warmup_steps=0"]


def test_the_suggestion_to_train_longer_trains_longer(store_uri, main):
    result = main("train", "-m", "precision=fp32,bf16", *SHORT, f"tracking.uri={store_uri}")
    assert result.code == 0, result.err
    client = store.client_for(store_uri)
    parent, _ = sweeps.find_sweep(client)
    advice = sweeps.build_report(client, parent.info.run_id).recommendation
    assert "has not learned" in advice.reason
    assert "trainer.max_steps=12" in advice.command and "trainer.epochs=4" in advice.command
    assert "trainer.max_steps=3" not in advice.command  # no old limit left to cap it

    again = main(*shlex.split(advice.command)[1:])  # as printed, without "ampsweep"
    assert again.code == 0, again.err
    newest, _ = sweeps.find_sweep(client)
    assert newest.info.run_id != parent.info.run_id
    kids = store.children(client, newest)
    assert len(kids) == 2
    last = {
        max(m.step for m in client.get_metric_history(k.info.run_id, "train/loss")) for k in kids
    }
    assert last == {12}  # four times the 3 steps the first sweep trained
    assert len(all_runs(store_uri)) == 6
