"""Shell completion of ``ampsweep train``: the bash script ``ampsweep train -sc install=bash``
prints completes a command that exists (``ampsweep``), and asking it, as bash does, completes
the overrides that follow ``ampsweep train`` from ampsweep's config groups."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_env

pytestmark = pytest.mark.slow

# The console script of the venv running the tests (what a user's shell finds)
AMPSWEEP = Path(sys.executable).parent / "ampsweep"


@pytest.mark.skipif(shutil.which("bash") is None or not AMPSWEEP.exists(), reason="needs bash")
def test_the_installed_bash_completion_completes_ampsweep_train(tmp_path):
    env = cli_env({"PATH": f"{AMPSWEEP.parent}:{cli_env()['PATH']}"})
    install = subprocess.run([AMPSWEEP, "train", "-sc", "install=bash"], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert install.returncode == 0, install.stderr
    assert install.stdout.rstrip().endswith("-F hydra_bash_completion ampsweep")
    # bash: install the completion, then complete "ampsweep train precision=" as on a Tab
    line = "ampsweep train precision="
    script = (
        f"{install.stdout}\ncomplete -p ampsweep\n"
        f"COMP_LINE='{line}' COMP_POINT={len(line)} COMP_CWORD=2 hydra_bash_completion\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("complete ") and lines[0].endswith(" ampsweep")
    assert {"precision=fp32", "precision=bf16", "precision=fp16"} <= set(lines[1:]), done.stdout
