"""Packaging: the wheel carries conf/, so a non-editable install can compose and run, and
Hydra finds ampsweep's launchers the same way in a wheel and in an editable install."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, require_tool

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
    assert "ampsweep = ampsweep.cli.main:run" in text


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


# Where Hydra looks for launchers: the folders of the hydra_plugins namespace, listed by
# pkgutil. Only the install under test is on the path (with its .pth files: an editable
# install's), then this venv's packages for the dependencies, without its own ampsweep.
DISCOVER = """
import site, sys
site.addsitedir(sys.argv[1])
sys.path.append(sys.argv[2])
import hydra_plugins.ampsweep_launcher as plugin
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
print(list(plugin.__path__)[0])
print(*sorted(f"{c.__module__}.{c.__name__}" for c in Plugins.instance().discover(Launcher)))
"""


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_hydra_finds_the_launchers_by_its_own_scan_in_a_wheel_and_an_editable_install(
    wheel, tmp_path, editable
):
    found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher")
    require_tool("submitit", None if found else "hydra-submitit-launcher is not installed")
    target = tmp_path / "site"
    what = ["-e", str(wheel.parents[1] / "source")] if editable else [str(wheel)]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
         "--target", str(target), *what],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # -I -S: no PYTHONPATH, and none of this venv's site-packages (nor its .pth files)
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", DISCOVER, str(target), sysconfig.get_paths()["purelib"]],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    folder, launchers = proc.stdout.splitlines()
    home = wheel.parents[1] / "source" / "src" if editable else target
    assert Path(folder) == home / "hydra_plugins" / "ampsweep_launcher"
    for name in ("LocalLauncher", "SlurmLauncher"):
        assert f"hydra_plugins.ampsweep_launcher.submitit_launcher.{name}" in launchers.split()
