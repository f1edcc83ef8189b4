"""app/cli.py: the ``ampsweep`` command's parser, help and version, and the report command's
one-line errors (in this process: ``cli.main``)."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
from conftest import cli_env

from ampsweep.app import cli


def test_no_arguments_prints_usage(main):
    result = main()
    assert result.code == 2 and "usage: ampsweep" in result.out


def test_help_lists_every_command(main):
    result = main("--help")
    assert result.code == 0
    for command in ("train", "report", "reproduce", "ui"):
        assert command in result.out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("ampsweep ")


def test_train_help_is_hydras_and_writes_nothing(tmp_path, main):
    result = main("train", "--help")
    assert result.code == 0, result.err
    assert "precision" in result.out and "Traceback" not in result.err
    assert not (tmp_path / "outputs").exists()  # help writes nothing


def test_report_says_what_is_missing_in_one_line(tmp_path, store_uri, main):
    missing = f"sqlite:///{tmp_path / 'nowhere.db'}"
    result = main("report", "--tracking-uri", missing)
    assert result.code == 2
    assert "no MLflow store at" in result.err and "Traceback" not in result.err
    assert not (tmp_path / "nowhere.db").exists()  # a report never creates a store
    result = main("report", "--tracking-uri", store_uri)  # a store, but empty
    assert result.code == 2 and "no sweep with runs in this store" in result.err
    result = main("report", "--baseline", "fp8")
    assert result.code == 2 and "--baseline fp8: not a precision mode" in result.err
    result = main("report", "--tracking-uri", store_uri, "--sweep", "0123456789abcdef")
    assert result.code == 2 and "--sweep 0123456789abcdef: no such run" in result.err
    result = main("report", "--tracking-uri", store_uri, "--experiment", "nope")
    assert result.code == 2 and "--experiment nope: no such experiment" in result.err
    assert len(result.err.strip().splitlines()) == 1


def test_reproduce_unknown_run_is_one_line(store_uri, main):
    result = main("reproduce", "0123456789abcdef", f"tracking.uri={store_uri}")
    assert result.code == 2
    assert "no such run in the store" in result.err and "Traceback" not in result.err
    assert len(result.err.strip().splitlines()) == 1


# ---------------------------------------------------------------- the program's way out

# A command that leaves what the interpreter's exit normally settles: a non-daemon thread still
# working, an idle executor worker, an exit handler, a temporary folder, and more output than a
# pipe's buffer holds.
PROGRAM = """
import atexit, concurrent.futures, sys, tempfile, threading, time
from pathlib import Path
from ampsweep.app import cli

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


def test_a_training_command_imports_its_modules_first_and_freezes_them():
    gc.unfreeze()  # what this test process froze after collection
    try:
        for argv in (["report"], ["ui"], ["train", "--help"], ["train", "--cfg", "job"], []):
            cli.preload(argv)
            assert gc.get_freeze_count() == 0, argv
        cli.preload(["train", "precision=bf16"])
        assert gc.isenabled() and set(cli.PRELOAD) <= set(sys.modules)
        assert gc.get_freeze_count() > 100_000  # torch, MLflow, Hydra: no collection scans them
    finally:
        gc.freeze()


def test_the_interpreters_exit_steps_that_run_calls_are_still_there():
    # run() calls what CPython calls at exit (private to threading and atexit, 3.11)
    import atexit
    import threading

    assert callable(threading._shutdown) and callable(atexit._run_exitfuncs)  # noqa: SLF001


def test_every_module_preload_imports_is_still_there():
    import importlib.util

    assert all(importlib.util.find_spec(name) for name in cli.PRELOAD)  # torch._dynamo too
