"""tracking.installed: the environment's key, and the distributions of a top-level package read
once per process and environment."""

from __future__ import annotations

import importlib.metadata
import os

from ampsweep.tracking import installed


def test_installing_a_distribution_changes_the_environment_key(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    before = installed.environment_key()
    (tmp_path / "pkg-1.0.dist-info").mkdir()
    os.utime(tmp_path, ns=(0, os.stat(tmp_path).st_mtime_ns + 1))  # coarse clocks
    assert installed.environment_key() != before


def test_a_packages_distributions_are_those_importlib_names():
    assert installed.distributions_of("torch") == ["torch"]
    assert installed.distributions_of("yaml") == ["PyYAML"]  # not the package's own name
    assert installed.distributions_of("no_such_package_here") == []
    assert installed.version("torch") == importlib.metadata.version("torch")
    assert installed.version("no-such-distribution-here") is None


def test_the_distributions_of_a_package_are_those_importlibs_whole_map_names():
    whole = importlib.metadata.packages_distributions()
    # a package named as its distribution, one that is not, one declared in top_level.txt,
    # one inferred from RECORD, and a few more
    for package in ("torch", "yaml", "sklearn", "mlflow", "hydra", "numpy", "_pytest"):
        assert sorted(installed.distributions_of(package)) == sorted(set(whole[package]))


def test_distributions_are_read_once_per_package_and_environment(monkeypatch):
    reads = []
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions",
                        lambda: reads.append(1) or real())  # fmt: skip
    installed._providers.cache_clear()
    for _ in range(2):  # a sweep job's model and data set, then the next job's
        assert installed.distributions_of("torch") == ["torch"]
        assert installed.distributions_of("a_local_module") == []
    assert len(reads) == 2
    # a distribution installed or removed changes its folder's mtime: read again
    key = installed.environment_key()
    monkeypatch.setattr(installed, "environment_key", lambda: (*key[:2], ()))
    assert installed.distributions_of("torch") == ["torch"]
    assert len(reads) == 3
