"""The trained model as an MLflow model of its run (``runs:/<id>/model``, a LoggedModel that
``mlflow.pytorch.load_model`` loads), its final metrics linked to it, and its registration.

What ``mlflow.pytorch.log_model`` does, through the run's client and id rather than MLflow's
global tracking URI, experiment and active run (the jobs of a sweep share a process): a
LoggedModel is created with the run's client,
``mlflow.pytorch.save_model`` writes its files, and the client uploads them.

A run's end waits for its model (a run is FINISHED only once its model is recorded), so two
things MLflow would do there are replaced by cheaper ones that give the same model:

- the requirements: MLflow infers them by loading the saved model in a subprocess (seconds);
  ampsweep pins what loading the model needs from the installed versions instead;
- the signature's output: one forward of the model on the whole input example (a batch of up
  to 65,536 values), where two rows give the same signature.

Classes that no installed distribution provides (ampsweep's own, a user's local module) are
pickled by value with the model, so it loads where only torch is installed. Nothing here
imports torch; MLflow is imported when a model is first logged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import cloudpickle

from ampsweep.tracking import store

# Always required to load a model saved in pickle format (mlflow itself is added by MLflow).
BASE_REQUIREMENTS = ("torch", "cloudpickle", "numpy")

# Module names of classes that no package provides: a script's own (cloudpickle pickles
# __main__'s classes by value already) and Python's.
NO_PACKAGE = frozenset({"__main__", "builtins"})

# Rows of the input example the signature's output is computed from: two, not one, so that a
# model which squeezes its output still shows its batch dimension.
SIGNATURE_ROWS = 2

Point = tuple[str, float, int, int]  # a metric's key, value, timestamp (ms) and step


class ModelSnapshot(Protocol):
    """The trained model as ``engine.checkpoint.ModelSnapshot`` hands it over."""

    module: Any  # a torch.nn.Module (this layer imports no torch)
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
    the run's experiment, saved by ``mlflow.pytorch.save_model`` in the pickle format (the one
    every precision mode loads back) with an input example of one batch, its signature and its
    pinned requirements, and uploaded; ``link(model_id)`` links the run's metrics of ``step``
    to it, and only then is it READY (FAILED if any of that fails)."""
    import mlflow.pytorch
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model, infer_signature

    output = signature_output(snapshot)  # what it cannot compute, it leaves out
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
            with classes_pickled_by_value(pickled_by_value(snapshot.packages)):
                mlflow.pytorch.save_model(
                    snapshot.module,
                    path,
                    mlflow_model=info,
                    input_example=snapshot.example,
                    signature=infer_signature(snapshot.example, output),
                    serialization_format="pickle",
                    pip_requirements=pinned_requirements(snapshot.packages),
                )
            client.log_model_artifacts(model.model_id, path)
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
        link(model.model_id)
    except BaseException:
        _finalize(client, model.model_id, ready=False)
        raise
    _finalize(client, model.model_id, ready=True)
    return model.model_id


def _finalize(client, model_id: str, ready: bool) -> None:
    """The model READY (all of it recorded), or FAILED."""
    from mlflow.entities import LoggedModelStatus

    status = LoggedModelStatus.READY if ready else LoggedModelStatus.FAILED
    client.finalize_logged_model(model_id, status)


def link_metrics(
    client, run_id: str, model_id: str, points: Iterable[Point], inputs: dict[str, tuple[str, str]]
) -> None:
    """The run's final ``points`` linked to the model: the same points again with its id,
    which MLflow adds to the model's metrics and does not store twice in the run's history.
    ``inputs``: each split's data set (name, digest), so that val/acc names the validation set."""
    from mlflow.entities import Metric

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
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

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


# ---------------------------------------------------------------- what the model carries


def signature_output(snapshot) -> Any:
    """The model's output on the first rows of its input example, from which the signature
    takes its outputs; None for a model whose forward does not run on the CPU (e.g. a float8
    model trained on a GPU): its signature then has inputs only."""
    try:
        return snapshot.predict(snapshot.example[:SIGNATURE_ROWS])
    except Exception:
        return None


def pickled_by_value(packages: Iterable[str]) -> set[str]:
    """Packages whose classes are pickled with the model, by value: ampsweep's own (not on
    PyPI) and any that no installed distribution provides (a user's local module), so the
    model loads where neither is importable. Classes of installed packages are pickled by
    reference and their distributions pinned as requirements."""
    return {p for p in set(packages) - NO_PACKAGE if p == "ampsweep" or not distributions_of(p)}


def pinned_requirements(packages: Iterable[str]) -> list[str]:
    """``name==version`` of what loading the model needs: torch, cloudpickle, numpy and the
    installed distributions its classes come from (torchvision, timm, transformers, torchao;
    scikit-learn for ``sklearn``...), at the versions installed (local labels such as
    ``+cu128`` dropped, so pip finds them)."""
    packages = set(packages)
    wanted = [*BASE_REQUIREMENTS, *sorted(packages - pickled_by_value(packages) - NO_PACKAGE)]
    names = [name for package in wanted for name in distributions_of(package)]
    out = []
    for name in dict.fromkeys(names):
        version = installed_version(name)
        if version is not None:
            out.append(f"{name}=={version.split('+')[0]}")
    return out


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name``, None if it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def distributions_of(package: str) -> list[str]:
    """The installed distributions that provide top-level package ``package``: most are named
    after it, others not (``sklearn`` is scikit-learn's, ``yaml`` PyYAML's: found as
    ``importlib.metadata`` maps packages to distributions). None (an empty list) for a local
    module or a built-in one."""
    if installed_version(package) is not None:
        return [package]
    return list(dict.fromkeys(_package_map().get(package, [])))


@functools.cache
def _package_map() -> Mapping[str, list[str]]:
    # Built from every file of every installed distribution: read once per process, not for
    # each package a sweep's jobs ask about.
    return importlib.metadata.packages_distributions()


@contextlib.contextmanager
def classes_pickled_by_value(packages: set[str]):
    """cloudpickle pickles the classes of ``packages`` (already imported) by value inside."""
    modules = [sys.modules[p] for p in sorted(packages) if p in sys.modules]
    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    try:
        yield
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)
