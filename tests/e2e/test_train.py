"""``ampsweep train`` in a real process: a run end to end, help through ``python -m``, and a
representative bad input of each kind (compose, validation, hardware, data, store), where a
traceback printed at exit would show."""

from __future__ import annotations

import pytest
from conftest import all_runs, run_cli
from unit.cli.test_train import BAD, BAD_STORE, check_one_line_error, fill

from ampsweep.tracking import store


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,names",
    [BAD[2], BAD[8], BAD[9], BAD[12], BAD_STORE],
    ids=["compose", "validate", "hardware", "data", "store"],
)
def test_bad_input_in_a_subprocess(args, names, tmp_path, store_uri, quick):
    names = names.replace("{tmp}", str(tmp_path))
    uri = [] if args is BAD_STORE[0] else [f"tracking.uri={store_uri}"]
    proc = run_cli(["train", *quick, *uri, *fill(args, tmp_path)], cwd=tmp_path)
    check_one_line_error(proc.returncode, proc.stdout, proc.stderr, names)
    if uri:
        assert all_runs(store_uri) == []


@pytest.mark.slow
def test_train_end_to_end(tmp_path, store_uri, quick):
    proc = run_cli(["train", *quick, "model=mlp", f"tracking.uri={store_uri}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "fp32-mlp-digits finished" in proc.stdout
    (run,) = all_runs(store_uri)
    assert run.info.status == "FINISHED"
    client = store.client_for(store_uri)
    hydra = {a.path for a in client.list_artifacts(run.info.run_id, ".hydra")}
    assert {".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml"} <= hydra
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {
        "config.yaml",
        "summary.json",
    }
    tags = run.data.tags
    assert tags["overrides"].split() == [*quick, "model=mlp", f"tracking.uri={store_uri}"]
    # Hydra's run dir is under outputs/ of the folder the command ran in.
    assert tags["run_dir"].startswith(str(tmp_path / "outputs" / "runs"))
    assert run.info.run_id in proc.stdout  # the summary says where the run is recorded


@pytest.mark.slow
def test_python_m_ampsweep_answers_help_and_version(tmp_path):
    top = run_cli(["--help"], cwd=tmp_path)
    assert top.returncode == 0 and "train" in top.stdout and "usage: ampsweep" in top.stdout
    version = run_cli(["--version"], cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("ampsweep ")
    assert not (tmp_path / "outputs").exists()  # help writes nothing
