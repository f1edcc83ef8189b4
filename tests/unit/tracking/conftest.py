"""Fixtures of the tracking tests: a recorder of a new run in the test's store, and the
records of two data sets as the engine describes them."""

from __future__ import annotations

import pytest

from ampsweep.config.schema import TrackingConfig
from ampsweep.engine.fingerprint import DataInput
from ampsweep.tracking import store as mlflow_store
from ampsweep.tracking.recorder import MlflowRecorder


@pytest.fixture
def new_recorder(store_uri):
    """``new_recorder()``: a recorder of a new run in the test's store."""
    folder = mlflow_store.sqlite_path(store_uri).parent  # the test's temporary folder
    cfg = TrackingConfig(uri=store_uri, artifact_root=str(folder / "mlartifacts"))
    return lambda: MlflowRecorder.start(cfg, "unit", uri=store_uri)


def data_input(split: str, digest: str) -> DataInput:
    return DataInput(f"toy-{split}", digest, split, "code", {"tags": {"loader": "x.y"}}, 12,
                     ("float32", (1, 8, 8)), ("int64", ()))  # fmt: skip


@pytest.fixture
def data_inputs() -> list[DataInput]:
    """A training and a validation set."""
    return [data_input("train", "aaaa"), data_input("val", "bbbb")]
