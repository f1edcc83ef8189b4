"""The trained model as an MLflow model of its run (``runs:/<id>/model``, a LoggedModel that
``mlflow.pytorch.load_model`` loads), its final metrics linked to it, and its registration.

What ``mlflow.pytorch.log_model`` does, through the run's client and id rather than MLflow's
global tracking URI, experiment and active run (the jobs of a sweep share a process, and a
model is logged on a background thread there). What the model carries besides its weights
(signature, pinned requirements, classes pickled by value) is ``modellog``'s.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import mlflow.pytorch
from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

from ampsweep.tracking import modellog, store

Point = tuple[str, float, int, int]  # a metric's key, value, timestamp (ms) and step


class ModelSnapshot(Protocol):
    """The trained model as ``engine.export.ModelSnapshot`` hands it over."""

    module: Any  # a torch.nn.Module (torch is imported by mlflow.pytorch, not here)
    example: Any  # numpy array: one batch of inputs

    def predict(self, x) -> Any: ...

    @property
    def packages(self) -> set[str]: ...


def log(
    client,
    run_id: str,
    experiment_id: str,
    snapshot: ModelSnapshot,
    step: int,
    *,
    name: str,
    params: dict[str, str],
    tags: dict[str, str],
    link: Callable[[str], None],
) -> str:
    """Log ``snapshot`` as a model of the run; its id (``m-...``). A LoggedModel is created in
    the run's experiment, ``mlflow.pytorch.save_model`` writes it (pickle format, the one every
    precision mode loads back; the input example of one batch and the signature; the pip
    requirements pinned from what is installed, never inferred: ``modellog`` says why), its
    files are uploaded, ``link(model_id)`` links the run's metrics of ``step`` to it, and only
    then is it READY (FAILED if any of that fails)."""
    signature = modellog.signature(snapshot)  # what it cannot compute, it leaves out
    model = client.create_logged_model(
        experiment_id, name=name, source_run_id=run_id, params=params or None, tags=tags or None
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            info = Model(
                artifact_path=model.artifact_location,
                model_uuid=model.model_id,
                run_id=run_id,
                model_id=model.model_id,
            )
            by_value = modellog.pickled_by_value(snapshot.packages)
            with modellog.classes_pickled_by_value(by_value), modellog.no_env_scan():
                mlflow.pytorch.save_model(
                    snapshot.module,
                    path,
                    mlflow_model=info,
                    signature=signature,
                    input_example=snapshot.example,
                    serialization_format="pickle",
                    pip_requirements=modellog.pinned_requirements(snapshot.packages),
                )
            client.log_model_artifacts(model.model_id, path)
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
        link(model.model_id)
    except BaseException:
        client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return model.model_id


def link_metrics(
    client,
    run_id: str,
    model_id: str,
    points: Iterable[Point],
    inputs: dict[str, tuple[str, str]],
) -> None:
    """The run's final ``points`` linked to the model: the same points again with its id,
    which MLflow adds to the model's metrics and does not store twice in the run's history.
    ``inputs``: each split's data set (name, digest), so that val/acc names the validation set."""
    linked = []
    for key, value, timestamp, step in points:
        if key.startswith(store.SYSTEM_PREFIX):
            continue
        name, digest = inputs.get(key.split("/")[0], (None, None))
        linked.append(Metric(key, value, timestamp, step, model_id, name, digest))
    for i in range(0, len(linked), 1000):
        client.log_batch(run_id, metrics=linked[i : i + 1000], synchronous=True)


def register(client, run_id: str, model_id: str, name: str) -> int:
    """A new version of the registered model ``name`` (created if new); its number."""
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    # The model's own location rather than models:/<id>: MLflow's registry resolves that
    # through the global tracking URI, not this client's store.
    location = client.get_logged_model(model_id).artifact_location
    version = client.create_model_version(name, source=location, run_id=run_id, model_id=model_id)
    return int(version.version)


class _PickleNotice(logging.Filter):
    """mlflow.pytorch warns on every pickle-format save; ampsweep chose the format on
    purpose (the README says why), so the warning is noise on every run's console."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Saving pytorch model by Pickle")


logging.getLogger("mlflow.pytorch").addFilter(_PickleNotice())
