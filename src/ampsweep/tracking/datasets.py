"""The data sets a run saw, as MLflow records them (``mlflow.log_input``'s entities): the UI's
Datasets column and the run page list them with their digests, contexts, schemas and sizes.
Only metadata is recorded, never the data."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Protocol

from ampsweep.tracking import store

CONTEXTS = {"train": store.TRAINING, "val": store.VALIDATION}  # a split's MLflow context


class DataInput(Protocol):
    """One data set a run saw, as ``engine.fingerprint.DataInput`` describes it."""

    name: str
    digest: str
    split: str  # train | val
    source_type: str  # local | code
    source: dict
    rows: int
    features: tuple[str, tuple[int, ...]]  # dtype, shape of one input
    targets: tuple[str, tuple[int, ...]]


def log(client, run_id: str, inputs: list[DataInput]) -> None:
    """Record the data sets the run saw in the store."""
    # The jobs of a sweep log the same data sets at once, and MLflow looks for a data set
    # before inserting it: a job that loses that race gets a unique-constraint error.
    for attempt in (1, 2, 3):
        try:
            client.log_inputs(run_id, datasets=records(inputs))
            return
        except Exception as err:
            if attempt == 3 or not store.lost_a_race(err):
                raise


def records(inputs: Iterable[DataInput]) -> list:
    """MLflow's record of each data set (``DatasetInput``): name, digest, source, tensor
    schema, row count, and its context (training or validation)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    out = []
    for d in inputs:
        schema = {
            "mlflow_tensorspec": {
                "features": json.dumps([_tensor_spec("x", *d.features)]),
                "targets": json.dumps([_tensor_spec("y", *d.targets)]),
            }
        }
        profile = {
            "num_rows": d.rows,
            "features_shape": [d.rows, *d.features[1]],
            "targets_shape": [d.rows, *d.targets[1]],
        }
        dataset = Dataset(
            name=d.name,
            digest=d.digest,
            source_type=d.source_type,
            source=json.dumps(d.source),
            schema=json.dumps(schema),
            profile=json.dumps(profile),
        )
        out.append(DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, CONTEXTS[d.split])]))
    return out


def _tensor_spec(name: str, dtype: str, shape: tuple[int, ...]) -> dict:
    return {"name": name, "type": "tensor", "tensor-spec": {"dtype": dtype, "shape": [-1, *shape]}}
