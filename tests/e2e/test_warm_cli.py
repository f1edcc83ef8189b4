"""The suite's warm forks (``tests/warm_cli.py``) run a command as a fresh ``python -m
ampsweep`` does: the same exit code, output, folder, argv, ``sys.path``, environment and
standard input, and a signal that ends it reads as it does from ``subprocess``."""

from __future__ import annotations

import json
import re

import pytest
from callbacks import signal_at_step
from conftest import callback_env, run_cli

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
