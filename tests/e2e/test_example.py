"""The example project (examples/shapes), as the README walks through it: from its own folder,
the `ampsweep` command sweeps its own model and data set over precision modes from its own
conf/, the report compares them, and `reproduce` repeats a run's loss history exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from ampsweep.tracking import store as mlflow_store


def ampsweep(args: list[str], cwd: Path, store: str) -> subprocess.CompletedProcess:
    """The installed console script when there is one (it does not put the current folder on
    sys.path, as `python -m` would: the project's package must still import)."""
    script = Path(sys.executable).parent / "ampsweep"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "ampsweep"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MLFLOW_TRACKING_URI": store}
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_the_example_project_sweeps_reports_and_reproduces(tmp_path, store):
    project = tmp_path / "shapes"
    shutil.copytree(REPO / "examples" / "shapes", project)  # it writes outputs/ where it runs
    small = [
        "trainer.epochs=3", "dataset.num_samples=800", "trainer.batch_size=32",
        "trainer.deterministic=true",
    ]  # fmt: skip
    res = ampsweep(["train", "-m", "--config-dir", "conf", "experiment=shapes_sweep", *small],
                   project, store)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "Findings" in res.stdout

    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name("shapes")  # the experiment file's tracking.experiment
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get(mlflow_store.SWEEP) == "true"]
    kids = {r.info.run_name: r for r in runs if mlflow_store.PARENT in r.data.tags}
    assert set(kids) == {"fp32-shape_net-shapes", "fp16-shape_net-shapes", "bf16-shape_net-shapes"}
    assert all(k.info.status == "FINISHED" for k in kids.values())
    fp32 = kids["fp32-shape_net-shapes"]
    assert fp32.data.tags["model.target"] == "shapes_demo.nets.make_net"
    assert fp32.data.tags["data.num_classes"] == "4"  # from the data set's `classes`
    assert fp32.data.metrics["val/acc"] > 0.4  # four classes: chance is 0.25
    assert "report.md" in {f.path for f in client.list_artifacts(parent.info.run_id)}

    report = ampsweep(["report", "--format", "json"], project, store)
    assert report.returncode == 0, report.stderr
    rows = {r["name"]: r for r in json.loads(report.stdout)["rows"]}
    assert rows["bf16-shape_net-shapes"]["model"] == "shape_net"
    assert rows["bf16-shape_net-shapes"]["baseline"] == "fp32-shape_net-shapes"

    rid = fp32.info.run_id
    again = ampsweep(["reproduce", rid], project, store)
    assert again.returncode == 0, again.stderr
    assert "code differs: model.target" not in again.stderr
    (new,) = client.search_runs([exp.experiment_id], f"tags.reproduces = '{rid}'")
    history = [
        sorted((m.step, m.value) for m in client.get_metric_history(r, "train/loss"))
        for r in (rid, new.info.run_id)
    ]
    assert len(history[0]) > 2 and history[0] == history[1]
    assert new.data.metrics["val/acc"] == fp32.data.metrics["val/acc"]
