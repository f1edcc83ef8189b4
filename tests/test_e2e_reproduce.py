"""``ampsweep reproduce RUN_ID``: a recorded run trained again from MLflow alone, to the same
numbers; and the Hydra-native rerun of a run dir's .hydra/ config."""

from __future__ import annotations

import pytest
from conftest import run_cli

from ampsweep.tracking import store


@pytest.mark.slow
def test_reproduce_matches_exactly(tmp_path, store_uri, main):
    args = [
        "trainer.epochs=1", "trainer.max_steps=12", "trainer.log_every=2",
        "trainer.progress=false", "trainer.deterministic=true", "model.width=8",
        "model.dropout=0.1", "precision=bf16", f"tracking.uri={store_uri}",
    ]  # fmt: skip
    first = main("train", *args)
    assert first.code == 0, first.err
    client = store.client_for(store_uri)
    (orig,) = client.search_runs(["1"])
    rid = orig.info.run_id
    again = run_cli(["reproduce", rid, "trainer.log_every=2"], tmp_path,
                    env={"MLFLOW_TRACKING_URI": store_uri})  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "original" in again.stdout and "reproduced" in again.stdout
    (new,) = client.search_runs(["1"], filter_string=f"tags.reproduces = '{rid}'")
    assert new.data.tags["overrides"] == "trainer.log_every=2"
    hist = {r: [(m.step, m.value) for m in client.get_metric_history(r, "train/loss")]
            for r in (rid, new.info.run_id)}  # fmt: skip
    a, b = hist[rid], hist[new.info.run_id]
    assert len(a) == 6 and sorted(a) == sorted(b)
    assert orig.data.metrics["val/acc"] == new.data.metrics["val/acc"]
    # The Hydra-native way: the original run dir's .hydra as the primary config.
    run_dir = orig.data.tags["run_dir"]
    native = main("train", "--config-path", f"{run_dir}/.hydra", "--config-name", "config")
    assert native.code == 0, native.err
    runs = client.search_runs(["1"], order_by=["attributes.start_time DESC"])
    assert len(runs) == 3 and runs[0].data.metrics["val/acc"] == orig.data.metrics["val/acc"]
    third = [
        (m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "train/loss")
    ]
    assert sorted(third) == sorted(a)
