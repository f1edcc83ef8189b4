"""One run's recorder: params, tags, buffered metrics and artifacts of one MLflow run.

Everything goes through an explicit ``MlflowClient`` and run id, never MLflow's global
"active run": Hydra runs the jobs of a sweep in one process, and one job's active run must
not leak into the next. Metrics are buffered and written in batches, asynchronously, every
``tracking.metrics_flush_seconds`` (or ``metrics_flush_every`` log calls): a synchronous write
into SQLite costs ~10 ms, and even an asynchronous one takes CPU from training.
"""

from __future__ import annotations

import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from ampsweep.config.schema import TrackingConfig
from ampsweep.tracking import store
from ampsweep.tracking.secrets import mask_text, mask_values, masked_copy, secret_values


class NullRecorder:
    """tracking=none: the same interface, recording nothing."""

    run_id: str | None = None
    uri: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def flush(self) -> None: ...
    def end(self, status: str, error: str | None = None) -> None: ...


class MlflowRecorder:
    """One MLflow run: buffered async metrics, params, tags, artifacts, and its end."""

    def __init__(
        self, client, run_id: str, uri: str, flush_every: int = 0, flush_seconds: float = 10.0
    ):
        self.client, self.run_id, self.uri = client, run_id, uri
        self.flush_every, self.flush_seconds = flush_every, flush_seconds
        self._last_write = time.monotonic()
        self._buffer: list = []
        self._calls = 0
        self._pending: list = []
        # Our own single background writer rather than MLflow's async logging: ending a run
        # that used MLflow's queue joins a worker that polls once a second (~1 s per run).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ampsweep-metrics")
        self._logged: set[tuple[str, int]] = set()  # (key, step) already in the store (resume)
        self.ended = False

    @classmethod
    def start(
        cls,
        cfg: TrackingConfig,
        run_name: str,
        tags: dict[str, str] | None = None,
        parent_run_id: str | None = None,
        uri: str | None = None,
    ) -> MlflowRecorder:
        uri = uri or store.resolve_uri(cfg.uri)
        client = store.client_for(uri)
        exp_id = store.experiment_for(client, uri, cfg)
        all_tags = mask_values(tags or {})
        if parent_run_id:
            all_tags[store.PARENT] = parent_run_id
        run = client.create_run(exp_id, run_name=mask_text(run_name), tags=all_tags)
        return cls(client, run.info.run_id, uri, cfg.metrics_flush_every, cfg.metrics_flush_seconds)

    @classmethod
    def attach(
        cls,
        uri: str,
        run_id: str,
        flush_every: int = 0,
        after_step: int | None = None,
        flush_seconds: float = 10.0,
    ) -> MlflowRecorder:
        """Continue an existing run (resume): set it RUNNING again.

        ``after_step``: the step the run resumes from. A run killed after its checkpoint may
        already hold metrics of later steps; those (key, step) pairs are not logged again, so
        no step appears twice in a metric's history."""
        client = store.client_for(uri)
        client.update_run(run_id, status=store.RUNNING)
        rec = cls(client, run_id, uri, flush_every, flush_seconds)
        if after_step is not None:
            for key in client.get_run(run_id).data.metrics:
                for m in client.get_metric_history(run_id, key):
                    if m.step > after_step:
                        rec._logged.add((key, m.step))
        return rec

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in mask_values(params).items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, v[: store.MAX_TAG_CHARS]) for k, v in mask_values(tags).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, tags=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer.extend(
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if (k, step) not in self._logged
        )
        self._calls += 1
        # Few, large writes: each costs a transaction on a background thread, and on a small
        # machine that thread competes with training for the same cores.
        due = self.flush_every > 0 and self._calls % self.flush_every == 0
        if due or time.monotonic() - self._last_write >= self.flush_seconds:
            self._write(synchronous=False)

    def _write(self, synchronous: bool) -> None:
        self._last_write = time.monotonic()
        while self._buffer:
            chunk, self._buffer = self._buffer[:1000], self._buffer[1000:]
            if synchronous:
                self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            else:
                write = partial(self.client.log_batch, self.run_id, metrics=chunk, synchronous=True)
                self._pending.append(self._writer.submit(write))

    def flush(self) -> None:
        """Write what is buffered and wait for every asynchronous write to land."""
        self._write(synchronous=False)
        pending, self._pending = self._pending, []
        for op in pending:
            op.result()  # re-raises a failed write here, in the training thread

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or a folder, with every secret in its text masked first."""
        path = Path(path)
        with tempfile.TemporaryDirectory() as tmp:
            if secret_values():
                path = masked_copy(path, Path(tmp))
                artifact_path = artifact_path and mask_text(artifact_path)
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path)
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_text(self, text: str, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / name
            target.write_text(mask_text(text))
            self.log_artifact(target)

    def log_json(self, obj: Any, name: str) -> None:
        self.log_text(json.dumps(obj, indent=2, sort_keys=True, default=str), name)

    def end(self, status: str, error: str | None = None) -> None:
        """Flush, tag the error if any, and set the final status. Safe to call twice."""
        if self.ended:
            return
        self.ended = True
        try:
            self.flush()
        except Exception as err:  # metrics were lost: the run cannot count as FINISHED
            status = store.FAILED
            error = error or f"recording metrics failed: {store.one_line(err)}"
            raise
        finally:
            self._writer.shutdown(wait=True)
            try:
                if error:
                    self.set_tags({store.ERROR: error})
            finally:  # whatever the store said to the tag, the run is ended
                self.client.set_terminated(self.run_id, status=status)
