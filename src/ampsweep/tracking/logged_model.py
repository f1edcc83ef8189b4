"""The trained model as an MLflow model of its run (``runs:/<id>/model``, a LoggedModel that
``mlflow.pytorch.load_model`` loads), its final metrics linked to it, and its registration.

What ``mlflow.pytorch.log_model`` does, through the run's client and id rather than MLflow's
global tracking URI, experiment and active run (the jobs of a sweep share a process, and a
model is logged on a background thread there), and in two processes: this one pickles the
module (it has torch), and the one where MLflow is imported, the recorder host of a tracked
run, writes the rest (``model_files``). What the model carries besides its weights (signature,
pinned requirements, classes pickled by value) is ``modellog``'s.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, Protocol

from ampsweep.tracking import modellog, store


class ModelSnapshot(Protocol):
    """The trained model as ``engine.export.ModelSnapshot`` hands it over."""

    module: Any  # a torch.nn.Module (this layer imports no torch)
    example: Any  # numpy array: one batch of inputs

    def predict(self, x) -> Any: ...

    def save(self, file: str) -> None: ...

    @property
    def packages(self) -> set[str]: ...

    @property
    def torch_version(self) -> str: ...


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
    the run's experiment; the module is pickled into its ``data/model.pth`` here (the pickle
    format, the one every precision mode loads back), and ``model_files`` writes the rest
    where MLflow is (the input example of one batch and the signature; the pip requirements
    pinned from what is installed, never inferred: ``modellog`` says why); its files are
    uploaded, ``link(model_id)`` links the run's metrics of ``step`` to it, and only then is
    it READY (FAILED if any of that fails)."""
    output = modellog.signature_output(snapshot)  # what it cannot compute, it leaves out
    model = client.create_logged_model(
        experiment_id, name=name, source_run_id=run_id, params=params or None, tags=tags or None
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            os.makedirs(os.path.join(path, modellog.DATA))
            by_value = modellog.pickled_by_value(snapshot.packages)
            with modellog.classes_pickled_by_value(by_value):
                snapshot.save(os.path.join(path, modellog.DATA, modellog.WEIGHTS))
            store.run_with(client, "write_model_files", path, model_id=model.model_id,
                           artifact_location=model.artifact_location, run_id=run_id,
                           example=snapshot.example, output=output,
                           packages=sorted(snapshot.packages),
                           torch_version=snapshot.torch_version)  # fmt: skip
            client.log_model_artifacts(model.model_id, path)
        store.run_with(client, "model_output", run_id, model.model_id, step)
        link(model.model_id)
    except BaseException:
        store.run_with(client, "finalize_model", model.model_id, ready=False)
        raise
    store.run_with(client, "finalize_model", model.model_id, ready=True)
    return model.model_id
