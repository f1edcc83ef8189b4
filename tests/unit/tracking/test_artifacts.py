"""tracking/artifacts.py: a run's small artifact read back, with MLflow's download bar off
while it downloads and the user's setting of it as it was afterwards."""

from __future__ import annotations

import os

import pytest
from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR
from mlflow.exceptions import MlflowException
from mlflow.utils import file_utils

from ampsweep.tracking import artifacts, store


@pytest.fixture
def bars(monkeypatch) -> list[bool]:
    """Whether MLflow would draw its bar, at each transfer it starts (it reads the variable
    then, and draws with tqdm where installed)."""
    drawn: list[bool] = []
    original = file_utils.ArtifactProgressBar.__init__

    def spy(self, *args, **kwargs):
        drawn.append(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get())
        original(self, *args, **kwargs)

    monkeypatch.setattr(file_utils.ArtifactProgressBar, "__init__", spy)
    return drawn


@pytest.mark.parametrize("users", [None, "true"])
def test_an_artifact_is_read_without_the_bar_and_the_setting_is_restored(
    users, new_recorder, store_uri, bars, monkeypatch
):
    if users is None:
        monkeypatch.delenv(artifacts.PROGRESS_BAR, raising=False)
    else:
        monkeypatch.setenv(artifacts.PROGRESS_BAR, users)
    recorder = new_recorder()
    recorder.log_text("model: mlp\n", "config.yaml")
    recorder.end(store.FINISHED)
    client = store.client_for(store_uri)

    assert artifacts.read_text(client, recorder.run_id, "config.yaml") == "model: mlp\n"
    assert bars == [False]  # downloaded, and without a bar
    with pytest.raises((MlflowException, OSError)):
        artifacts.read_text(client, recorder.run_id, "missing.json")
    assert os.environ.get(artifacts.PROGRESS_BAR) == users  # as it was, after a failure too
