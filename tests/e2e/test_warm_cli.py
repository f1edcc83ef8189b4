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
import sys
import time
from pathlib import Path

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


LONG = ["train", "trainer.epochs=10000", "trainer.progress=false", "tracking=none"]


def _in_background(tmp_path, python: str, signal: str) -> subprocess.CompletedProcess:
    """A script that starts a long ``$PYTHON -m ampsweep train``, sends SIGNAL to the process
    it started once a step is taken, and prints how that process ended."""
    pid = tmp_path / "pid"
    pid.unlink(missing_ok=True)
    args = [*LONG, f"trainer.callbacks=[{{_target_: callbacks.RecordPid, path: '{pid}'}}]"]
    script = (f'"$PYTHON" -m ampsweep {shlex.join(args)} &\nstarted=$!\n'
              f'until [ -s {pid} ]; do sleep 0.05; done\n'
              f'kill -{signal} $started\nwait $started\necho "ended: $?"\n')  # fmt: skip
    env = cli_env(callback_env({"PYTHON": python}))
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_a_scripts_python_relays_a_signal_to_its_command_and_ends_as_it_does(tmp_path):
    """An elastic agent ends a DDP run's other ranks with SIGTERM (to their shims, when the
    ranks are forked warm: conftest.warm_subprocesses): the command gets it, and the shim
    ends as the command does, as a fresh interpreter would."""
    fresh = _in_background(tmp_path, sys.executable, "TERM")
    with WarmPython(WARM) as python:
        warm = _in_background(tmp_path, str(python.path), "TERM")
    assert python.served == 1
    # ended as ampsweep ends on SIGTERM: a checkpoint, then exit code 130
    assert fresh.stdout.splitlines()[-1] == warm.stdout.splitlines()[-1] == "ended: 130"
    assert fresh.stderr == warm.stderr and "SIGTERM: stopping after this step" in warm.stderr


def test_a_killed_shim_takes_its_command_with_it(tmp_path):
    """SIGKILL cannot be relayed (an agent's last resort): the shim's connection ends, and
    the forked command is killed then, not left training."""
    with WarmPython(WARM) as python:
        killed = _in_background(tmp_path, str(python.path), "KILL")
        assert "ended: 137" in killed.stdout, killed
        command = Path(f"/proc/{(tmp_path / 'pid').read_text()}")
        deadline = time.monotonic() + 30
        while command.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not command.exists()
