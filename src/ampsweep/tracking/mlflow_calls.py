"""What ampsweep does with MLflow's own classes: entities, the logged model's files, the
system monitors. Each function takes a client first and is called by name through
``store.run_with``, so that it runs where that client's MLflow is imported: in the recorder
host of a tracked run (``tracking.host``), or in the calling process for a client of its own.
The rest of the tracking layer sends plain values (tuples, dicts, numpy arrays) and imports
no MLflow; the recorder host runs no function but these.
"""

from __future__ import annotations

from collections.abc import Iterable

import psutil
from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

from ampsweep.tracking import datasets, model_files, store

Point = tuple[str, float, int, int]  # a metric's key, value, timestamp (ms) and step


def write_record(client, run_id: str, op: dict) -> None:
    """Write one journal record (``tracking.journal``) into the store."""
    kind = op["op"]
    if kind == "metrics":
        metrics = [Metric(k, v, ts, step) for k, v, ts, step in op["items"]]
        client.log_batch(run_id, metrics=metrics, synchronous=True)
    elif kind == "tags":
        set_tags(client, run_id, op["items"])
    elif kind == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in op["items"]])
    elif kind == "end":
        if op.get("error"):
            client.set_tag(run_id, store.ERROR, op["error"])
        elif store.ERROR in client.get_run(run_id).data.tags:  # an end said ahead of it
            client.delete_tag(run_id, store.ERROR)
        client.set_terminated(run_id, status=op["status"], end_time=op.get("time"))
    else:
        raise ValueError(f"unknown journal record {kind!r}")


def set_tags(client, run_id: str, items) -> None:
    """``(key, value)`` pairs as the run's tags, values as strings, in one write."""
    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in items])


def log_inputs(client, run_id: str, inputs: list) -> None:
    """Record the data sets the run saw (``datasets.records``)."""
    records = datasets.records(inputs)
    if records:
        client.log_inputs(run_id, datasets=records)


# ---------------------------------------------------------------- the logged model


def write_model_files(client, path: str, **model) -> None:
    """The model's files around its weights (``model_files.write``)."""
    model_files.write(path, **model)


def model_output(client, run_id: str, model_id: str, step: int) -> None:
    """The model as an output of the run, at ``step`` (the run page's Logged models)."""
    client.log_outputs(run_id, [LoggedModelOutput(model_id, step)])


def finalize_model(client, model_id: str, ready: bool) -> None:
    """The model READY (all of it recorded), or FAILED."""
    status = LoggedModelStatus.READY if ready else LoggedModelStatus.FAILED
    client.finalize_logged_model(model_id, status)


def link_metrics(client, run_id: str, model_id: str, points: Iterable[Point],
                 inputs: dict[str, tuple[str, str]]) -> None:  # fmt: skip
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


def register_model(client, run_id: str, model_id: str, name: str) -> int:
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


# ---------------------------------------------------------------- system metrics

_MONITORS: dict[str, list] = {}  # a sampler's collectors (``system_metrics``), by its key


def sample_system(client, key: str) -> dict[str, float]:
    """One sample of the machine's load with MLflow's own collectors (CPU and memory; disk and
    network; every GPU NVML sees, when ``nvidia-ml-py`` is installed and a driver answers), by
    MLflow's names; a sampler's first call starts its collectors."""
    if key not in _MONITORS:
        _MONITORS[key] = _collectors()
        return {}
    values: dict[str, float] = {}
    for monitor in _MONITORS[key]:
        try:
            monitor.collect_metrics()
            values.update(monitor.aggregate_metrics())
        except Exception:  # noqa: S112 - one failed reading must not end sampling
            continue
        finally:
            monitor.clear_metrics()
    return values


def stop_system(client, key: str) -> None:
    _MONITORS.pop(key, None)


def _collectors() -> list:
    """MLflow's collectors available here; the GPU's only where NVML starts."""
    psutil.cpu_percent()  # the first reading only starts the count
    monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor  # needs nvidia-ml-py

        monitors.append(GPUMonitor())  # raises without nvidia-ml-py or without a GPU
    except Exception:
        pass
    return monitors
