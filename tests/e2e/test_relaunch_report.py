"""The main job run twice: a relaunch that skips every finished job still prints the whole
sweep's report, and `ampsweep report` afterwards reports that sweep."""

from __future__ import annotations

import json

import pytest

from ampsweep.cli import main as cli
from ampsweep.tracking import store as mlflow_store

pytestmark = pytest.mark.slow

# The demo's sweep (experiment=precision_sweep: six modes), at a small size.
DEMO = ["train", "-m", "experiment=precision_sweep", "trainer.max_steps=4", "trainer.epochs=1"]
DEMO += ["trainer.log_every=2", "trainer.timing_warmup_steps=1", "model.width=8"]
DEMO += ["diagnostics.every=2"]
MODES = ["fp32", "fp16", "fp16_static", "fp16_noscale", "bf16", "bf16_pure"]


def test_running_the_demo_twice_prints_the_whole_report_and_report_works(
    tmp_path, store, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*DEMO, f"tracking.uri={store}"]) == 0
    first = capsys.readouterr().out
    assert ": skipped, the identical config" not in first
    assert "6 runs of cnn on digits vs fp32" in first

    assert cli.main([*DEMO, f"tracking.uri={store}"]) == 0
    second = capsys.readouterr().out
    # Every job is skipped, and each skip names the run standing in for it...
    for mode in MODES:
        assert f"{mode}-cnn-digits: skipped, the identical config FINISHED as run {mode}-cnn" in (
            second
        )
    # ...yet the report is printed, with every mode against the fp32 baseline.
    assert "6 runs of cnn on digits vs fp32" in second and "Findings" in second
    assert "no fp32 run in this sweep" not in second
    table = second[second.index("6 runs of cnn") :]
    assert all(f" {mode} " in table for mode in MODES)
    # (at 4 steps the baseline may not have learned yet: then no verdict on quality, said so)
    verdicts = ("Accuracy held", "Accuracy dropped", "No verdict on quality")
    assert any(v in second for v in verdicts)

    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name("ampsweep")
    parents = mlflow_store.sweeps(client, [exp.experiment_id])
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    relaunch = parents[0]  # newest first
    assert relaunch.data.tags["jobs_skipped"] == "6"
    assert not mlflow_store.children(client, relaunch)  # no run was trained again

    # `ampsweep report` reports the relaunch (its rows: the earlier runs) and succeeds.
    assert cli.main(["report", "--tracking-uri", store, "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["sweep"]["run_id"] == relaunch.info.run_id
    assert [r["precision"] for r in rep["rows"]] == MODES
    assert all(r["reused"] for r in rep["rows"])
    assert all(r["baseline"] == "fp32-cnn-digits" for r in rep["rows"][1:])

    # A newer sweep parent without runs (a launch interrupted before any job) is passed over,
    # and the report says so.
    client.create_run(exp.experiment_id, run_name="empty", tags={mlflow_store.SWEEP: "true"})
    assert cli.main(["report", "--tracking-uri", store]) == 0
    out, err = capsys.readouterr()
    assert f"({relaunch.info.run_id}): 6 runs of cnn on digits vs fp32" in out
    assert "note: skipped the newer sweep empty" in err and "it has no runs" in err
