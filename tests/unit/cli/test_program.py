"""The ``ampsweep`` program as a process of its own (``python -m ampsweep``, ``cli.main.run``):
what it imports for each command, its exit code, and a reader that goes away."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import cli_env, run_cli

ONE_STEP = ["trainer.max_steps=1", "trainer.progress=false"]


def imported(stderr: str) -> set[str]:
    """The modules a process imported, from what ``PYTHONPROFILEIMPORTTIME`` prints (one
    ``import time: self | cumulative | name`` line per module)."""
    lines = [line for line in stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip() for line in lines[1:]}  # the first is the header


def run_traced(args: list[str], cwd) -> tuple[subprocess.CompletedProcess, set[str]]:
    res = run_cli(args, cwd, env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=300)
    return res, imported(res.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("off", ["tracking=none", "tracking.backend=none"])
def test_a_run_with_tracking_off_imports_no_mlflow(off, tmp_path):
    res, modules = run_traced(["train", off, *ONE_STEP], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "torch" in modules and "ampsweep.engine.loop" in modules  # it did train
    assert not [m for m in modules if m.split(".")[0] == "mlflow"]
    assert not (tmp_path / "outputs" / "mlflow.db").exists()


@pytest.mark.slow
def test_a_tracked_run_records_everything_and_ends_with_exit_code_0(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = run_cli(["train", f"tracking.uri={uri}", *ONE_STEP], tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    # everything a run records: params, metrics, system metrics, data sets, the model, its end
    import mlflow.pytorch
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("ampsweep").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["precision.name"] == "fp32"
    assert "val/acc" in run.data.metrics and "system/cpu_utilization_percentage" in run.data.metrics
    assert {d.dataset.name for d in run.inputs.dataset_inputs} == {"digits-train", "digits-val"}
    [model] = client.search_logged_models([run.info.experiment_id])
    assert model.status.to_proto() == 2 and model.source_run_id == run.info.run_id  # READY
    assert {m.key for m in model.metrics} >= {"val/acc"}
    net = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    assert sum(p.numel() for p in net.parameters()) == 19_562


@pytest.mark.parametrize("command", ["report", "repair"])
def test_the_commands_that_read_the_store_import_no_torch(command, tmp_path, store_uri):
    """``ampsweep report`` and ``repair`` read MLflow's store only: importing torch (through
    the train command's modules) would double their time."""
    res, modules = run_traced([command, "--tracking-uri", store_uri], tmp_path)
    assert "ampsweep.tracking.store" in modules, res.stderr[-2000:]
    assert "torch" not in modules, res.stderr[-2000:]


def test_help_imports_neither_mlflow_nor_torch(tmp_path):
    res, modules = run_traced(["--help"], tmp_path)
    assert res.returncode == 0 and "usage: ampsweep" in res.stdout
    assert not {m.split(".")[0] for m in modules} & {"mlflow", "torch"}, res.stderr[-2000:]


# A command whose output outlives its reader (`ampsweep report | head`)
MUCH_OUTPUT = """
import sys
from ampsweep.cli import main
main.main = lambda: sys.stdout.write("x" * 200_000) and 0
main.run()
"""


def test_a_reader_gone_ends_the_program_with_exit_code_1_and_no_traceback(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", MUCH_OUTPUT],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # before the program writes: it takes a while to import
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
