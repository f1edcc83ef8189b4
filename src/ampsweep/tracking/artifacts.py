"""Reading a run's small artifacts back (its config, what a measurement recorded), without
MLflow's download progress bar.

MLflow draws a bar for every download while ``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR`` says so
(its default): for a file of a few KiB, read once per run by ``ampsweep report`` or
``reproduce``, it is only noise between the command's own lines.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


@contextlib.contextmanager
def no_progress_bar() -> Iterator[None]:
    """MLflow draws no download bar inside the block; the variable is as it was after it."""
    saved = os.environ.get(PROGRESS_BAR)
    os.environ[PROGRESS_BAR] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(PROGRESS_BAR, None)
        else:
            os.environ[PROGRESS_BAR] = saved


def read_text(client, run_id: str, path: str) -> str:
    """The text of the run's artifact ``path``. Raises what MLflow raises where the run has
    none or its artifacts cannot be read (``MlflowException``, ``OSError``)."""
    with tempfile.TemporaryDirectory() as tmp, no_progress_bar():
        return Path(client.download_artifacts(run_id, path, tmp)).read_text()
