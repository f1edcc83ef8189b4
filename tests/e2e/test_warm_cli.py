"""The suite's warm forks (``tests/warm_cli.py``) run a command as a fresh ``python -m
ampsweep`` does: the same exit code, output, folder, argv, ``sys.path``, environment and
standard input, and a signal that ends it reads as it does from ``subprocess``; a script given
``tests/warm_python.py``'s interpreter forks its ``-m ampsweep`` commands so, and runs the rest
as written."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest
from callbacks import signal_at_step
from conftest import WARM, callback_env, cli_env, run_cli
from warm_python import WarmPython

pytestmark = pytest.mark.slow


def digitless(text: str) -> str:
    return " ".join(re.sub(r"[0-9.,]+", "#", text).split())  # a table's padding follows them


def both(args: list[str], cwd, env: dict | None = None):
    """The command run warm, then in a fresh interpreter."""
    return run_cli(args, cwd, env), run_cli(args, cwd, env, real=True)


def test_a_warm_command_sees_what_a_fresh_one_sees(tmp_path):
    seen = tmp_path / "seen.json"
    args = ["train", "trainer.max_steps=1", "trainer.progress=false", "tracking=none",
            f"trainer.callbacks=[{{_target_: callbacks.RecordProcess, path: '{seen}', "
            "variable: WARM_CLI_PROBE}]"]  # fmt: skip
    results = []
    for ran in both(args, tmp_path, callback_env({"WARM_CLI_PROBE": "given"})):
        assert ran.returncode == 0, ran.stderr[-2000:]
        results.append((json.loads(seen.read_text()), ran.stdout, ran.stderr))
    (warm, warm_out, warm_err), (real, real_out, real_err) = results
    assert warm == real
    assert real["cwd"] == str(tmp_path) and real["variable"] == "given" and real["stdin"] == ""
    assert real["path"][0] == str(tmp_path)  # python -m: the folder first, then PYTHONPATH
    # the same lines, but for the times and speeds in them
    assert digitless(warm_out) == digitless(real_out) and digitless(warm_err) == digitless(real_err)


def test_a_refused_command_exits_alike(tmp_path):
    warm, real = both(["train", "trainer.epoch=3"], tmp_path)
    assert warm.returncode == real.returncode == 2
    assert (warm.stdout, warm.stderr) == (real.stdout, real.stderr)
    assert "trainer.epoch" in real.stderr


def test_a_command_killed_by_a_signal_reads_as_from_subprocess(tmp_path):
    args = ["train", "trainer.max_steps=5", "trainer.progress=false", "tracking=none",
            signal_at_step(2, "SIGKILL")]  # fmt: skip
    warm, real = both(args, tmp_path, callback_env())
    assert warm.returncode == real.returncode == -9


def test_a_scripts_python_forks_its_ampsweep_commands_warm_and_runs_the_rest_as_written(
    tmp_path,
):
    killed = ["train", "trainer.max_steps=5", "trainer.progress=false", "tracking=none",
              signal_at_step(2, "SIGKILL")]  # fmt: skip
    script = tmp_path / "script.sh"
    script.write_text(
        '"$PYTHON" -m ampsweep train trainer.epoch=3\necho "refused: $?"\n'
        f'"$PYTHON" -m ampsweep {shlex.join(killed)}\necho "killed: $?"\n'
        '"$PYTHON" -c "import sys; print(\'isolated:\', sys.flags.isolated)"\n'
        '"$PYTHON" - <<< "print(\'a script on standard input\')"\n'
    )
    fresh = run_cli(["train", "trainer.epoch=3"], tmp_path, real=True)
    with WarmPython(WARM) as python:
        env = cli_env(callback_env({"PYTHON": str(python.path)}))
        proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert python.served == 2  # the two ampsweep commands, forked; the others as written
    assert "refused: 2" in proc.stdout and fresh.returncode == 2
    assert fresh.stderr in proc.stderr  # the refused command's own error line
    assert "killed: 137" in proc.stdout  # the shim died of the command's SIGKILL (128 + 9)
    assert "isolated: 0" in proc.stdout and "a script on standard input" in proc.stdout
