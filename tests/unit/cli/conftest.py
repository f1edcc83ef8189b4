"""Fixtures of the commands' tests."""

from __future__ import annotations

import shutil

import pytest
from conftest import REPO


@pytest.fixture
def project(tmp_path, monkeypatch, store_uri):
    """The example project with the defect models, in this test's folder (its store)."""
    shutil.copytree(REPO / "examples" / "doctor", tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path
