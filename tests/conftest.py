"""Shared fixtures: a temporary MLflow store, small configs, markers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An empty SQLite store with MLflow's tables, made once per session: MLflow runs its
    schema migrations on every new store, which costs seconds each."""
    from ampsweep.tracking.store import client_for

    path = tmp_path_factory.mktemp("empty_store") / "mlflow.db"
    client_for(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(tmp_path: Path, empty_store: Path) -> str:
    """A fresh, empty SQLite MLflow store (a copy of ``empty_store``), as an absolute URI."""
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def quick() -> list[str]:
    """Overrides for a run that takes about a second on CPU."""
    return [
        "trainer.epochs=1",
        "trainer.max_steps=6",
        "trainer.log_every=2",
        "trainer.timing_warmup_steps=1",
        "trainer.progress=false",
        "model.width=8",
    ]


def run_cli(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 600):
    """Run ``python -m ampsweep ARGS`` in a subprocess; return the CompletedProcess."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
    full_env.pop("MLFLOW_TRACKING_URI", None) if "MLFLOW_TRACKING_URI" not in (env or {}) else None
    return subprocess.run(
        [sys.executable, "-m", "ampsweep", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
