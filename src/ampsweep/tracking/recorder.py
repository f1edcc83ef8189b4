"""One run's recorder: params, tags, buffered metrics and artifacts of one MLflow run.

Everything goes through an explicit ``MlflowClient`` and run id, never MLflow's global
"active run": Hydra runs the jobs of a sweep in one process, and one job's active run must
not leak into the next. MLflow is imported when a run is first recorded (``store.client_for``),
so a run with ``tracking=none`` (a ``NullRecorder``) never imports it.

Metrics are buffered and written in batches, asynchronously, every
``tracking.metrics_flush_seconds`` (or ``metrics_flush_every`` log calls): a synchronous write
into SQLite costs ~10 ms, and even an asynchronous one takes CPU from training.

Besides numbers, a run records what MLflow users look for first, each in its own module: the
data sets it saw (``log_inputs``: ``datasets``), the machine's load while it trained
(``start_system_metrics``: ``system_metrics``) and the trained model (``log_model``:
``logged_model``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampsweep.config.schema import TrackingConfig
from ampsweep.tracking import datasets, journal, logged_model, store
from ampsweep.tracking.journal import Journal
from ampsweep.tracking.secrets import mask_text, mask_values, masked_copy, secret_values
from ampsweep.tracking.system_metrics import SystemMetrics

if TYPE_CHECKING:
    from ampsweep.tracking.datasets import DataInput
    from ampsweep.tracking.logged_model import ModelSnapshot

RETRY_S = 15.0  # while the store is down, how often a write tries it again


class NullRecorder:
    """tracking=none: the same interface, recording nothing."""

    run_id: str | None = None
    uri: str | None = None

    def log_params(self, params: dict[str, Any]) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def log_inputs(self, inputs: Iterable[DataInput]) -> None: ...
    def start_system_metrics(self, interval: float) -> None: ...
    def stop_system_metrics(self) -> None: ...
    def flush(self) -> None: ...
    def keep_journal(self, path: Path) -> None: ...
    def end(self, status: str, error: str | None = None) -> None: ...

    down: str | None = None
    on_down = None
    unsent = 0


class MlflowRecorder:
    """One MLflow run: buffered async metrics, params, tags, artifacts, and its end."""

    def __init__(
        self,
        client,
        run_id: str,
        uri: str,
        flush_every: int = 0,
        flush_seconds: float = 10.0,
        experiment_id: str | None = None,
    ):
        self.client, self.run_id, self.uri = client, run_id, uri
        self.experiment_id = experiment_id or client.get_run(run_id).info.experiment_id
        self.flush_every, self.flush_seconds = flush_every, flush_seconds
        self._last_write = time.monotonic()
        self._buffer: list = []
        self._calls = 0
        self._pending: list = []
        # The training thread and the system-metrics sampler both log metrics.
        self._lock = threading.Lock()
        # key -> the newest point logged, (key, value, timestamp, step): linked to the model
        self._latest: dict[str, tuple[str, float, int, int]] = {}
        self._params: dict[str, str] = {}  # what log_params recorded (the logged model's too)
        self._system: SystemMetrics | None = None
        self._system_step = 0  # a resumed run continues its system metrics' steps
        self._inputs: dict[str, tuple[str, str]] = {}  # split -> data set (name, digest)
        # Our own single background writer rather than MLflow's async logging: ending a run
        # that used MLflow's queue joins a worker that polls once a second (~1 s per run).
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ampsweep-metrics")
        self._logged: set[tuple[str, int]] = set()  # (key, step) already in the store (resume)
        self.ended = False
        # What is sent goes to the journal first; a store outage leaves it waiting there.
        self.journal = Journal()
        self.down: str | None = None  # the store's failure, while it does not answer
        self.on_down: Callable[[str], None] | None = None  # told once per outage
        self._retry_at = 0.0
        self._sending = threading.Lock()

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
        return cls(
            client,
            run.info.run_id,
            uri,
            cfg.metrics_flush_every,
            cfg.metrics_flush_seconds,
            experiment_id=exp_id,
        )

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
        run = client.get_run(run_id)
        rec = cls(client, run_id, uri, flush_every, flush_seconds, run.info.experiment_id)
        rec._params = dict(run.data.params)  # the logged model carries the run's params
        if after_step is not None:
            for key in run.data.metrics:
                for m in client.get_metric_history(run_id, key):
                    if m.step > after_step:
                        rec._logged.add((key, m.step))
                    if key.startswith(store.SYSTEM_PREFIX):
                        rec._system_step = max(rec._system_step, m.step + 1)
        return rec

    # Params, tags and metrics travel as tuples (the journal's records), made into MLflow's
    # entities only where they are written (journal.write).

    def log_params(self, params: dict[str, Any]) -> None:
        items = [(k, v[:6000]) for k, v in mask_values(params).items()]
        self._params.update(items)
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self._send({"op": "params", "items": items[i : i + 100]})

    def set_tags(self, tags: dict[str, Any]) -> None:
        items = [(k, v[: store.MAX_TAG_CHARS]) for k, v in mask_values(tags).items()]
        for i in range(0, len(items), 100):
            self._send({"op": "tags", "items": items[i : i + 100]})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [
            (k, float(v), now, step) for k, v in metrics.items() if (k, step) not in self._logged
        ]
        with self._lock:
            self._buffer.extend(batch)
            self._latest.update((point[0], point) for point in batch)
            self._calls += 1
            # Few, large writes: each costs a transaction on a background thread, and on a
            # small machine that thread competes with training for the same cores.
            due = self.flush_every > 0 and self._calls % self.flush_every == 0
            if due or time.monotonic() - self._last_write >= self.flush_seconds:
                self._write()

    def _write(self) -> None:
        """Hand what is buffered to the writer thread (the caller holds the lock)."""
        self._last_write = time.monotonic()
        while self._buffer:
            chunk, self._buffer = self._buffer[:1000], self._buffer[1000:]
            self.journal.append({"op": "metrics", "items": chunk})
            self._pending.append(self._writer.submit(self._drain))

    def flush(self) -> None:
        """Write what is buffered and wait for every asynchronous write to land (or, while
        the store does not answer, to wait in the journal)."""
        with self._lock:
            self._write()
            pending, self._pending = self._pending, []
        for op in pending:
            op.result()  # re-raises a failed write here, in the calling thread

    # ------------------------------------------------------------ the journal

    def keep_journal(self, path: Path) -> None:
        """Keep the journal in ``path`` (the run's folder) from now on."""
        self.journal.keep_in(path, self.uri, self.run_id)

    def _send(self, op: dict) -> None:
        self.journal.append(op)
        self._drain()

    def _drain(self) -> None:
        """Write every waiting journal record, in order, until the store fails: then it is
        down (the records wait), and tried again after ``RETRY_S``. A record the store
        refuses for another reason (a bad value) is dropped and the error raised."""
        with self._sending:
            if self.down and time.monotonic() < self._retry_at:
                return
            for seq, op in self.journal.waiting():
                try:
                    journal.write(self.client, self.run_id, op)
                except Exception as err:
                    known = store.fault(err, self.uri)
                    if known is None:
                        self.journal.ack(seq)
                        raise
                    self._went_down(str(known))
                    return
                self.journal.ack(seq)
            self.down = None

    def _went_down(self, why: str) -> None:
        self._retry_at = time.monotonic() + RETRY_S
        first, self.down = self.down is None, why
        if first and self.on_down is not None:
            self.on_down(why)

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

    # ------------------------------------------------------------ data sets

    def log_inputs(self, inputs: Iterable[DataInput]) -> None:
        """Record the data sets the run saw (``datasets``: metadata and digests, never the
        data)."""
        inputs = list(inputs)
        self._inputs.update((d.split, (d.name, d.digest)) for d in inputs)
        if inputs:
            datasets.log(self.client, self.run_id, inputs)

    # ------------------------------------------------------------ system metrics

    def start_system_metrics(self, interval: float) -> None:
        """Sample the machine's load every ``interval`` seconds until the run stops training."""
        if self._system is None:
            self._system = SystemMetrics(self.log_metrics, interval, self._system_step)
            self._system.start()

    def stop_system_metrics(self) -> None:
        """Take a last sample and stop sampling (so even a short run has one point)."""
        if self._system is not None:
            self._system.stop()
            self._system_step, self._system = self._system.step, None

    # ------------------------------------------------------------ the model

    def log_model(
        self,
        snapshot: ModelSnapshot,
        step: int,
        name: str = store.MODEL_NAME,
        tags: dict[str, str] | None = None,
    ) -> str:
        """Log the trained model as an MLflow model of this run, with the run's params and the
        metrics of ``step`` linked to it (``logged_model.log``); its id (``m-...``)."""
        link = functools.partial(self._link_metrics, step=step)
        return logged_model.log(
            self.client,
            self.run_id,
            self.experiment_id,
            snapshot,
            step,
            name=name,
            params=self._params,
            tags=mask_values(tags or {}),
            link=link,
        )

    def _link_metrics(self, model_id: str, step: int) -> None:
        """The metrics logged at ``step`` (the run's final numbers), once written, linked to
        the model."""
        self.flush()
        with self._lock:
            final = [point for point in self._latest.values() if point[3] == step]
        logged_model.link_metrics(self.client, self.run_id, model_id, final, self._inputs)

    def register_model(self, model_id: str, name: str) -> int:
        """A new version of the registered model ``name`` (created if new); its number."""
        return logged_model.register(self.client, self.run_id, model_id, name)

    def end(self, status: str, error: str | None = None) -> None:
        """Flush, tag the error if any, and set the final status. Safe to call twice."""
        if self.ended:
            return
        self.ended = True
        try:
            self.stop_system_metrics()
            self.flush()
        except Exception as err:  # metrics were lost: the run cannot count as FINISHED
            status = store.FAILED
            error = error or f"recording metrics failed: {store.one_line(err)}"
            raise
        finally:
            self._writer.shutdown(wait=True)
            # The end goes to the journal like the rest: a store that is down when the run
            # ends gets it (and everything before it) when it answers again.
            error = error and mask_text(error)[: store.MAX_TAG_CHARS]
            end = {"op": "end", "status": status, "error": error, "time": int(time.time() * 1000)}
            self.journal.append(end)
            self._retry_at = 0.0  # try the store once more now, down or not
            try:
                self._drain()
                if self.unsent:
                    self._end_ahead(len(self.journal.pending))
            finally:
                self.journal.close()  # removed when the store has all of it

    def _end_ahead(self, waiting: int) -> None:
        """The store took none of the end: try ending the run FAILED ahead of what waits
        (a store that takes a status but not metrics must not leave the run RUNNING); the
        journal's own end replaces it when the rest is written."""
        why = (
            f"{waiting} records wait in {self.journal.path or 'memory'} (the store failed: "
            f"{self.down}): `ampsweep repair` writes them and this run's real end"
        )
        with contextlib.suppress(Exception):
            self.client.set_tag(self.run_id, store.ERROR, why[: store.MAX_TAG_CHARS])
            self.client.set_terminated(self.run_id, status=store.FAILED)

    @property
    def unsent(self) -> int:
        """Records waiting in the journal for the store (0: the store has everything)."""
        return len(self.journal.pending)
