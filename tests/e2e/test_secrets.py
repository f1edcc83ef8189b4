"""No secret reaches the store: the CLI (in this process), a single run and a sweep, with a
secret in the environment and typed into an override, then every run name, param, tag, metric
name and artifact file in the store is searched for it, and so are the store's own files and
the checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampsweep.tracking import store

SECRET = "s3cr3t-e2e-7b1f0c"
TINY = ["model=mlp", "model.width=8", "trainer.epochs=1", "trainer.max_steps=4"]
TINY += ["trainer.log_every=2", "trainer.progress=false", "trainer.timing_warmup_steps=1"]


def artifact_files(client, run_id: str, folder: str | None = None):
    """(path, bytes) of every artifact file of a run, at any depth."""
    for item in client.list_artifacts(run_id, folder):
        if item.is_dir:
            yield from artifact_files(client, run_id, item.path)
        else:
            local = client.download_artifacts(run_id, item.path)
            yield item.path, Path(local).read_bytes()


def leaks(uri: str) -> tuple[list[str], int, int]:
    """Where the store holds the secret; how many runs and artifact files were searched."""
    client = store.client_for(uri)
    found, n_runs, n_files = [], 0, 0
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id], max_results=1000):
            n_runs += 1
            where = f"run {run.info.run_name} ({run.info.run_id})"
            texts = {"run name": run.info.run_name}
            texts |= {f"param {k}": f"{k}={v}" for k, v in run.data.params.items()}
            texts |= {f"tag {k}": f"{k}={v}" for k, v in run.data.tags.items()}
            texts |= {f"metric {k}": k for k in run.data.metrics}
            found += [f"{where}: {what}" for what, text in texts.items() if SECRET in text]
            for path, data in artifact_files(client, run.info.run_id):
                n_files += 1
                if SECRET.encode() in data or SECRET in path:
                    found.append(f"{where}: artifact {path}")
    return found, n_runs, n_files


def files_holding_the_secret(*roots: Path) -> list[str]:
    """The files under ``roots`` (files or folders) whose name or bytes hold the secret."""
    files = [p for root in roots for p in ([root] if root.is_file() else root.rglob("*"))]
    return [
        str(p)
        for p in files
        if p.is_file() and (SECRET.encode() in p.read_bytes() or SECRET in p.name)
    ]


@pytest.mark.slow
def test_no_secret_reaches_the_store_from_a_run_or_a_sweep(tmp_path, store_uri, main, monkeypatch):
    monkeypatch.setenv("MY_API_TOKEN", SECRET)
    single = main("train", *TINY, f"tracking.run_name=run-{SECRET}", f"tracking.uri={store_uri}",
                  "trainer.checkpoint_every=2")  # fmt: skip
    assert single.code == 0, single.err[-3000:]
    sweep = main("train", "-m", "precision=fp32,bf16", *TINY, f"tracking.uri={store_uri}",
                 "tracking.run_name=job-${oc.env:MY_API_TOKEN}")  # fmt: skip
    assert sweep.code == 0, sweep.err[-3000:]
    assert "Findings" in sweep.out  # the report was made (and logged to the parent)

    found, n_runs, n_files = leaks(store_uri)
    assert found == []
    assert n_runs == 4  # the run, the sweep's parent and its two children were all searched
    assert n_files >= 15  # .hydra/*, config.yaml, summary.json of 3 runs, the report, charts
    # Nowhere in the store's files either (names of experiments, deleted rows, every table),
    # nor in the artifacts on disk or the checkpoints.
    outputs = tmp_path / "outputs"
    assert (outputs / "mlartifacts").is_dir() and (outputs / "checkpoints").is_dir()
    assert files_holding_the_secret(store.sqlite_path(store_uri)) == []
    assert files_holding_the_secret(outputs / "mlartifacts", outputs / "checkpoints") == []
    # ... and the console did not show it.
    for res in (single, sweep):
        assert SECRET not in res.out + res.err
    # The typed override did reach the run (masked), so the search above had something to find.
    client = store.client_for(store_uri)
    names = {r.info.run_name for r in client.search_runs(["1"], max_results=100)}
    assert {"run-***", "job-***"} <= names


@pytest.mark.slow
def test_a_secret_in_an_experiment_name_is_refused_and_never_printed(
    tmp_path, store_uri, main, monkeypatch
):
    """An experiment named after a secret is refused in one line that names the variable,
    not the value (the name keys the experiment and its artifact folders); an error line that
    quotes a path holding a secret prints it masked; neither leaves anything in the store."""
    monkeypatch.setenv("MY_API_TOKEN", SECRET)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    for args in (["train", *TINY], ["train", "-m", "precision=fp32,bf16", *TINY]):
        res = main(*args, f"tracking.experiment=exp-{SECRET}")
        assert res.code == 2, res.err
        assert res.err.strip().splitlines() == [
            "error: tracking.experiment=exp-***: holds the value of the secret environment "
            "variable MY_API_TOKEN: an experiment's name is shown to everyone who reads the "
            "store and names its artifact folders: choose a name without it"
        ]
        assert SECRET not in res.out + res.err
    root = f"dataset.root={tmp_path}/nonexist-{SECRET}"
    missing = main("train", *TINY, "dataset=mnist", root)
    assert missing.code == 2, missing.err
    (line,) = missing.err.strip().splitlines()
    assert line.startswith("error: dataset=mnist: no data under") and "nonexist-***" in line
    assert SECRET not in missing.out + missing.err
    assert not store.sqlite_path(store_uri).exists() or leaks(store_uri)[1] == 0
