"""``ampsweep reproduce RUN_ID``: a recorded run trained again from MLflow alone, to the same
numbers; the Hydra-native rerun of a run dir's .hydra/ config; and neither runs code that a
stranger's config names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ampsweep.tracking import store


@pytest.mark.slow
def test_reproduce_matches_exactly(store_uri, main, monkeypatch):
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
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)  # the store from the environment
    again = main("reproduce", rid, "trainer.log_every=2")
    assert again.code == 0, again.err
    assert "original" in again.out and "reproduced" in again.out
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


# ---------------------------------------------------------------- a stranger's config

NET = """\
import torch


def make_net(input_shape, num_classes, hidden: int = 8):
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(input_shape[-1] * input_shape[-2], num_classes)
    )
"""
QUICK_MLP = ["trainer.epochs=1", "trainer.max_steps=4", "trainer.log_every=2",
             "trainer.timing_warmup_steps=1", "trainer.progress=false"]  # fmt: skip


def _tamper(client, run_id: str, folder, section: dict) -> None:
    """Overwrite the run's logged config.yaml with one whose model section is ``section``:
    what anyone who can write to a shared store can do."""
    path = client.download_artifacts(run_id, "config.yaml", str(folder))
    cfg = yaml.safe_load(open(path))
    cfg["model"] = section
    out = folder / "upload"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    client.log_artifact(run_id, str(out / "config.yaml"))


@pytest.mark.slow
def test_reproduce_refuses_a_strangers_target(tmp_path, store_uri, main, monkeypatch):
    """A logged config that names ``os.system`` is refused in one line before anything is
    imported (the file it would create is not there, nothing is recorded); ``--trust os``
    runs it as asked; the same check guards a run dir's saved config."""
    first = main("train", *QUICK_MLP, "model=mlp", "model.width=8", f"tracking.uri={store_uri}")
    assert first.code == 0, first.err
    client = store.client_for(store_uri)
    (run,) = client.search_runs(["1"])
    rid, pwned = run.info.run_id, tmp_path / "PWNED"
    _tamper(client, rid, tmp_path, {"_target_": "os.system", "command": f"touch {pwned}"})
    refused = main("reproduce", rid, f"tracking.uri={store_uri}")
    assert refused.code == 2, refused.err
    lines = refused.err.strip().splitlines()
    assert lines == [
        "error: model._target_=os.system: not a model of ampsweep or of a trusted package: "
        "pass --trust os if you mean it"
    ], refused.err
    assert not pwned.exists()
    assert len(client.search_runs(["1"])) == 1  # nothing recorded
    trusted = main("reproduce", rid, "--trust", "os", f"tracking.uri={store_uri}")
    assert pwned.exists(), trusted.err  # the user said they mean it
    assert all(r.info.status != "RUNNING" for r in client.search_runs(["1"]))
    # A run dir's saved config, copied from elsewhere: the same check, through train.
    pwned.unlink()
    saved = tmp_path / "their_run" / ".hydra"
    saved.mkdir(parents=True)
    config = (Path(run.data.tags["run_dir"]) / ".hydra" / "config.yaml").read_text()
    cfg = yaml.safe_load(config)
    cfg["model"] = {"_target_": "os.system", "command": f"touch {pwned}"}
    (saved / "config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    native = main("train", "--config-path", str(saved), "--config-name", "config")
    assert native.code == 2, native.err
    (line,) = native.err.strip().splitlines()
    assert "model._target_=os.system: not a model of ampsweep" in line and "--trust os" in line
    assert not pwned.exists()


@pytest.mark.slow
def test_reproduce_runs_the_projects_own_target(tmp_path, store_uri, main, monkeypatch):
    """A model of the project in the current folder reproduces; from another folder it is a
    stranger's until named with --trust. A path that leaves a trusted package through its
    imports (mypkg.nets.torch.load) is refused too."""
    project = tmp_path / "project"
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "nets.py").write_text(NET)
    (project / "conf" / "model").mkdir(parents=True)
    (project / "conf" / "model" / "my_net.yaml").write_text("_target_: mypkg.nets.make_net\n")
    monkeypatch.chdir(project)
    args = ["--config-dir", "conf", *QUICK_MLP, "model=my_net", f"tracking.uri={store_uri}"]
    first = main("train", *args)
    assert first.code == 0, first.err
    client = store.client_for(store_uri)
    (run,) = client.search_runs(["1"])
    again = main("reproduce", run.info.run_id, f"tracking.uri={store_uri}")
    assert again.code == 0, again.err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.syspath_prepend(str(project))  # importable, e.g. installed, but not this project
    refused = main("reproduce", run.info.run_id, f"tracking.uri={store_uri}")
    assert refused.code == 2
    assert "model._target_=mypkg.nets.make_net: not a model of ampsweep or of a trusted " \
        "package: pass --trust mypkg if you mean it" in refused.err  # fmt: skip
    trusted = main("reproduce", run.info.run_id, "--trust", "mypkg", f"tracking.uri={store_uri}")
    assert trusted.code == 0, trusted.err
    monkeypatch.chdir(project)
    _tamper(client, run.info.run_id, tmp_path, {"_target_": "mypkg.nets.torch.load", "f": "x"})
    escaped = main("reproduce", run.info.run_id, f"tracking.uri={store_uri}")
    assert escaped.code == 2
    assert "model._target_=mypkg.nets.torch.load: leads to torch.serialization.load, outside " \
        "the trusted packages" in escaped.err  # fmt: skip
    assert len(client.search_runs(["1"])) == 3
