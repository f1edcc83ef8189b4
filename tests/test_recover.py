"""Divergence stops a run FAILED with diverged=true; secrets never reach params or tags;
reproduce reruns a run from MLflow alone."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli

from ampsweep.app import job as runner
from ampsweep.config import compose as config
from ampsweep.measure.divergence import NonfiniteWatch
from ampsweep.precision.policy import StaticGradScaler
from ampsweep.tracking import secrets


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs/ (checkpoints, run dirs) of in-process jobs


def test_watch_ignores_a_scaler_still_lowering_its_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    watch = NonfiniteWatch(3, 1.0, scaler)
    nan, skipped = torch.tensor(float("nan")), torch.tensor(1.0)
    for scale in (4.0, 2.0, 1.0, 0.5, 0.25):  # backing off: only scales below 1.0 count
        scaler._scale.fill_(scale)
        watch.observe(nan, skipped, scaler)
    assert watch.count() == 2
    watch.check(5)  # 2 < 3: not yet
    scaler._scale.fill_(0.125)
    watch.observe(nan, skipped, scaler)
    with pytest.raises(Exception, match="non-finite for 3 consecutive steps"):
        watch.check(6)
    static = NonfiniteWatch(2, 1.0, StaticGradScaler("cpu", init_scale=8.0))
    static.observe(torch.tensor(1.0), skipped, None)  # a static scale never recovers: counts
    static.observe(torch.tensor(1.0), torch.tensor(0.0), None)  # a clean step resets
    assert static.count() == 0


def test_diverging_lr_stops_failed_and_the_sweep_goes_on(store, quick):
    from mlflow import MlflowClient

    base = [*quick, "trainer.max_steps=60", f"tracking.uri={store}"]
    bad = runner.run_job(
        config.load([*base, "optimizer=sgd", "optimizer.lr=1e6", "trainer.max_nonfinite_steps=4"])
    )
    assert bad.status == "FAILED" and bad.exit_code == runner.EXIT_FAILED
    run = MlflowClient(store).get_run(bad.run_id)
    assert run.data.tags["diverged"] == "true"
    assert run.data.tags["error"].startswith("Diverged: loss non-finite for 4 consecutive")
    steps = [m.step for m in MlflowClient(store).get_metric_history(bad.run_id, "train/loss")]
    assert steps and max(steps) < 60  # stopped early, with the metrics up to then kept
    good = runner.run_job(config.load(base))  # the next job of a sweep runs as usual
    assert good.status == "FINISHED"


def test_secrets_from_the_environment_are_masked(store, quick, monkeypatch, capsys):
    from mlflow import MlflowClient

    secret = "s3cr3t-value-42"
    monkeypatch.setenv("MY_API_TOKEN", secret)
    monkeypatch.setenv("DB_PASSWORD", "hunter22")
    monkeypatch.setenv("SHORT_KEY", "1")  # too short to mask: it would hit every "1"
    masked = secrets.mask_values({"a": f"https://u:{secret}@host", "b": "hunter22", "c": 1})
    assert masked == {"a": "https://u:***@host", "b": "***", "c": "1"}
    cfg = config.load(
        [*quick, f"tracking.uri={store}", "tracking.run_name=run-${oc.env:MY_API_TOKEN}"]
    )
    assert secret in cfg.tracking.run_name  # the config itself holds the value
    out = runner.run_job(cfg)
    run = MlflowClient(store).get_run(out.run_id)
    everything = {**run.data.params, **run.data.tags}
    assert not [k for k, v in everything.items() if secret in v]
    assert run.data.params["tracking.run_name"] == "run-***"
    shown = capsys.readouterr()
    assert secret not in shown.out + shown.err and "run-***" in shown.out  # the console too


@pytest.mark.slow
def test_reproduce_matches_exactly(tmp_path, store):
    from mlflow import MlflowClient

    args = [
        "trainer.epochs=1", "trainer.max_steps=12", "trainer.log_every=2",
        "trainer.progress=false", "trainer.deterministic=true", "model.width=8",
        "model.dropout=0.1", "precision=bf16", f"tracking.uri={store}",
    ]  # fmt: skip
    first = run_cli(["train", *args], tmp_path)
    assert first.returncode == 0, first.stderr
    client = MlflowClient(store)
    (orig,) = client.search_runs(["1"])
    rid = orig.info.run_id
    again = run_cli(["reproduce", rid, "trainer.log_every=2"], tmp_path,
                    env={"MLFLOW_TRACKING_URI": store})  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "original" in again.stdout and "reproduced" in again.stdout
    (new,) = client.search_runs(["1"], filter_string=f"tags.reproduces = '{rid}'")
    assert new.data.tags["overrides"] == "trainer.log_every=2"
    hist = {r: [(m.step, m.value) for m in client.get_metric_history(r, "train/loss")]
            for r in (rid, new.info.run_id)}  # fmt: skip
    a, b = hist[rid], hist[new.info.run_id]
    assert len(a) == 6 and sorted(a) == sorted(b)
    diff = max(abs(x[1] - y[1]) for x, y in zip(sorted(a), sorted(b), strict=True))
    print(f"\nreproduce: max |train/loss difference| over {len(a)} steps = {diff}")
    assert orig.data.metrics["val/acc"] == new.data.metrics["val/acc"]
    # The Hydra-native way: the original run dir's .hydra as the primary config.
    run_dir = orig.data.tags["run_dir"]
    native = run_cli(["train", "--config-path", f"{run_dir}/.hydra", "--config-name", "config"],
                     tmp_path)  # fmt: skip
    assert native.returncode == 0, native.stderr
    runs = client.search_runs(["1"], order_by=["attributes.start_time DESC"])
    assert len(runs) == 3 and runs[0].data.metrics["val/acc"] == orig.data.metrics["val/acc"]
    third = [
        (m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "train/loss")
    ]
    assert sorted(third) == sorted(a)


def test_reproduce_unknown_run_is_one_line(tmp_path, store):
    res = run_cli(["reproduce", "0123456789abcdef", f"tracking.uri={store}"], tmp_path)
    assert res.returncode == 2
    assert "no such run in the store" in res.stderr and "Traceback" not in res.stderr
