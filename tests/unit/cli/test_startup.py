"""app/startup.py: what a training command imports up front (collector off, then frozen), and
the program's way out once the command has returned."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
from conftest import cli_env

from ampsweep.cli import startup
from ampsweep.cli.startup import (
    PRELOAD,
    PRELOAD_DATABASE,
    PRELOAD_MLFLOW,
    PRELOAD_TRACKING,
    Startup,
)

TRACKED = PRELOAD + PRELOAD_TRACKING + PRELOAD_MLFLOW + PRELOAD_DATABASE  # into a database store


def test_only_training_commands_import_up_front_and_untracked_ones_leave_mlflow_out():
    for argv in (["report"], ["ui"], ["train", "--help"], ["train", "--cfg", "job"], []):
        assert startup.modules(argv) == (), argv
    assert startup.modules(["train", "precision=bf16"]) == TRACKED
    for off in ("tracking=none", "tracking.backend=none"):
        untracked = startup.modules(["train", off, "trainer.max_steps=1"])
        assert untracked == PRELOAD and not any(name.startswith("mlflow") for name in untracked)


def test_a_rank_other_than_0_imports_no_mlflow_up_front():
    argv = ["train", "trainer.nproc=2"]
    for rank, tracked in (("0", True), ("1", False), ("3", False)):
        env = {"WORLD_SIZE": "4", "RANK": rank, "LOCAL_RANK": rank}
        assert (startup.modules(argv, env) == TRACKED) is tracked, rank
    # the parent of the ranks, and a RANK left in a shell without torchrun's WORLD_SIZE
    assert startup.modules(argv, {}) == startup.modules(argv, {"RANK": "1"}) == TRACKED


def test_a_run_into_a_tracking_server_leaves_mlflows_database_store_out():
    server = PRELOAD + PRELOAD_TRACKING + PRELOAD_MLFLOW
    argv = ["train", "trainer.max_steps=1"]
    assert startup.modules([*argv, "tracking.uri=http://127.0.0.1:5000"], {}) == server
    assert startup.modules(argv, {"MLFLOW_TRACKING_URI": "https://mlflow.example"}) == server
    # the command line's store wins over the variable, as in tracking.store.resolve_uri
    sqlite = "tracking.uri=sqlite:////tmp/m.db"
    assert startup.modules([*argv, sqlite], {"MLFLOW_TRACKING_URI": "http://h:5000"}) == TRACKED
    assert startup.modules([*argv, sqlite, "tracking.uri=http://h:5000"], {}) == server
    for env in ({}, {"MLFLOW_TRACKING_URI": "postgresql://u@h/db"}):
        assert startup.modules(argv, env) == TRACKED


def test_a_single_tracked_run_has_mlflow_imported_by_its_recorder_host_and_no_other():
    argv = ["train", "trainer.max_steps=1"]
    assert startup.recorder_modules(argv, {}) == PRELOAD_MLFLOW + PRELOAD_DATABASE
    server = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}
    assert startup.recorder_modules(argv, server) == PRELOAD_MLFLOW  # no database store there
    for other in (
        ["train", "-m", "precision=fp32,bf16"],  # a sweep imports MLflow once, for its report
        ["train", "--multirun", "precision=fp32,bf16"],
        ["train", "tracking=none"],
        ["train", "--cfg", "job"],
        ["reproduce", "abc", "tracking=none"],
        ["capacity", "--help"],
        ["report"],
    ):
        assert startup.recorder_modules(other, {}) == (), other
    reproduce = ["reproduce", "0123abcd", "trainer.max_steps=1"]  # one run again
    assert startup.recorder_modules(reproduce, {}) == PRELOAD_MLFLOW + PRELOAD_DATABASE
    assert startup.recorder_modules(argv, {"WORLD_SIZE": "2", "RANK": "1"}) == ()


def test_a_training_command_imports_its_modules_first_and_freezes_them():
    gc.unfreeze()  # what this test process froze after collection
    try:
        for argv in (["report"], ["train", "--cfg", "job"]):
            Startup().preload(argv)
            assert gc.get_freeze_count() == 0, argv
        # no recorder host here: it would serve this test process's store clients
        Startup(freeze=False, recorder_host=False).preload(["train", "precision=bf16"])
        assert gc.isenabled() and gc.get_freeze_count() == 0
        Startup(recorder_host=False).preload(["train", "precision=bf16"])
        assert gc.isenabled() and set(TRACKED) <= set(sys.modules)
        assert gc.get_freeze_count() > 100_000  # torch, MLflow, Hydra: no collection scans them
    finally:
        gc.freeze()


def test_without_the_fast_exit_the_program_takes_pythons_way_out():
    with pytest.raises(SystemExit) as exit_:
        startup.run(lambda: 3, ["report"], Startup(fast_exit=False))
    assert exit_.value.code == 3


# A command that leaves what the interpreter's exit normally settles: a non-daemon thread still
# working, an idle executor worker, an exit handler, a temporary folder, and more output than a
# pipe's buffer holds.
PROGRAM = """
import atexit, concurrent.futures, sys, tempfile, threading, time
from pathlib import Path
from ampsweep.cli import main as cli

out = Path(sys.argv[1])

def main():
    def late():
        time.sleep(0.3)
        (out / "thread").write_text("done")
    threading.Thread(target=late).start()
    concurrent.futures.ThreadPoolExecutor(1).submit(lambda: None).result()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    cli.kept = tempfile.TemporaryDirectory(dir=out)  # removed by its finalizer at exit
    (Path(cli.kept.name) / "f").write_text("x")
    sys.stdout.write("x" * 200_000 + "end")
    return 3

cli.main = main
cli.run()
"""


def test_the_program_settles_threads_exit_handlers_and_output_before_it_ends(tmp_path):
    res = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 3, res.stderr
    assert res.stdout == "x" * 200_000 + "end"
    assert (tmp_path / "thread").read_text() == "done"  # joined, not cut off
    assert (tmp_path / "atexit").read_text() == "ran"
    assert {p.name for p in tmp_path.iterdir()} == {"thread", "atexit"}  # the temp folder is gone
    assert "Traceback" not in res.stderr


UNTRACKED_RUN = """
import sys
from ampsweep.cli import main as cli, startup
argv = ["train", *sys.argv[1:], "trainer.max_steps=1", "trainer.progress=false"]
startup.Startup().preload(argv)
code = cli.main(argv)
mlflow = sorted(m for m in sys.modules if m.startswith("mlflow"))
print("exit", code, "mlflow imported:", mlflow[:3])
"""


@pytest.mark.slow
@pytest.mark.parametrize("off", ["tracking=none", "tracking.backend=none"])
def test_a_run_with_tracking_off_imports_no_mlflow(off, tmp_path):
    res = subprocess.run([sys.executable, "-c", UNTRACKED_RUN, off], cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines()[-1] == "exit 0 mlflow imported: []"


@pytest.mark.slow
def test_a_tracked_run_records_everything_through_its_recorder_host_and_imports_no_mlflow(
    tmp_path,
):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = subprocess.run([sys.executable, "-c", UNTRACKED_RUN, f"tracking.uri={uri}"],
                         cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines()[-1] == "exit 0 mlflow imported: []"
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


STORE_COMMAND = """
import sys
from ampsweep.cli import main as cli
code = cli.main(sys.argv[1:])
print("exit", code, "torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("command", ["report", "repair"])
def test_the_commands_that_read_the_store_import_no_torch(command, tmp_path, store_uri):
    """``ampsweep report`` and ``repair`` read MLflow's store only: importing torch (2.5 s,
    through the train command's modules) would double their time."""
    argv = [command, "--tracking-uri", store_uri]
    res = subprocess.run([sys.executable, "-c", STORE_COMMAND, *argv], cwd=tmp_path,
                         env=cli_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.stdout.splitlines()[-1].endswith("torch imported: False"), res.stderr[-2000:]


def test_the_interpreters_exit_steps_the_fast_exit_calls_are_still_there():
    # Startup.exit calls what CPython calls at exit (private to threading and atexit, 3.11)
    import atexit
    import threading

    assert callable(threading._shutdown) and callable(atexit._run_exitfuncs)  # noqa: SLF001


def test_every_module_the_start_up_imports_is_still_there():
    import importlib.util

    names = TRACKED  # torch._dynamo (private) too
    assert all(importlib.util.find_spec(name) for name in names)


def test_a_line_hydras_parser_refuses_or_a_help_imports_nothing_up_front():
    assert startup.modules(["train", "--bogus"]) == ()
    assert startup.modules(["train", "--cfg", "job"]) == ()
    assert startup.modules(["doctor", "--help"]) == ()
    assert startup.modules(["train", "--trust", "mypkg", "model=mine"])[0] == "torch"
