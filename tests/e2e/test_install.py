"""Packaging: the wheel carries conf/, so a non-editable install can compose and run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

# One worker runs the whole module, so that its module-scoped fixture is built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_e2e_install")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a clean copy: an in-tree build leaves build/ behind, and a stale build/lib
    # could hide a config file that is missing from the package data.
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for part in ("src", "conf"):
        shutil.copytree(REPO / part, source / part, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "dist"), str(source)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (built,) = (tmp / "dist").glob("ampsweep-*.whl")
    return built


def test_wheel_contains_every_config_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted((REPO / "conf").rglob("*.yaml"))
    assert shipped, "no config files found in conf/"
    for path in shipped:
        assert f"ampsweep/conf/{path.relative_to(REPO / 'conf').as_posix()}" in names
    assert "ampsweep/conf/config.yaml" in names
    # Every module of every sub-package is in the wheel (a package left out of
    # pyproject.toml's list would be missing only from non-editable installs).
    modules = sorted((REPO / "src").rglob("*.py"))
    for path in modules:
        assert path.relative_to(REPO / "src").as_posix() in names
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "ampsweep = ampsweep.app.cli:run" in text


def test_installed_wheel_composes_from_its_own_conf(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # Only the installed copy on the path (dependencies still come from this venv).
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = (
        "import ampsweep.config.compose as c; print(c.config_dir()); "
        "print(c.load(['precision=bf16', 'model=mlp']).precision.name)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    conf_dir, mode = proc.stdout.split()
    assert Path(conf_dir) == target / "ampsweep" / "conf"
    assert mode == "bf16"
    # Hydra's own entry point finds the packaged configs too (prints the job config only).
    cfg = subprocess.run(
        [sys.executable, "-m", "ampsweep", "train", "--cfg", "job", "model=mlp"], cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cfg.returncode == 0, cfg.stderr
    assert "name: mlp" in cfg.stdout
