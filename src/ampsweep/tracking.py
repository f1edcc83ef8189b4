"""MLflow tracking: where the store is, and one run's recorder.

Everything goes through an explicit ``MlflowClient`` and run id, never MLflow's global
"active run": Hydra runs the jobs of a sweep in one process, and one job's active run must
not leak into the next. Metrics are buffered and written in batches, asynchronously, every
``tracking.metrics_flush_seconds`` (or ``metrics_flush_every`` log calls): a synchronous write
into SQLite costs ~10 ms, and even an asynchronous one takes CPU from training.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from ampsweep.schema import ConfigError, TrackingConfig

DEFAULT_STORE = Path("outputs") / "mlflow.db"
PARENT_TAG = "mlflow.parentRunId"
RUNNING, FINISHED, FAILED, KILLED = "RUNNING", "FINISHED", "FAILED", "KILLED"
MAX_TAG_CHARS = 5000
# Environment variables whose values must never reach a param or tag (an ${oc.env:...} in a
# config, a token inside a tracking URI or a command line).
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY")
MIN_SECRET_CHARS = 4  # shorter values ("1", "true") would mask ordinary values everywhere
MASK = "***"


def secret_values() -> list[str]:
    """Values of the environment variables whose names contain a secret word, longest first."""
    found = {
        value
        for name, value in os.environ.items()
        if any(word in name.upper() for word in SECRET_WORDS) and len(value) >= MIN_SECRET_CHARS
    }
    return sorted(found, key=len, reverse=True)


def mask_secrets(values: dict[str, Any]) -> dict[str, str]:
    """``values`` as strings with every secret environment value replaced by ``***``."""
    secrets = secret_values()
    return {k: mask_text(str(v), secrets) for k, v in values.items()}


def mask_text(text: str, secrets: list[str] | None = None) -> str:
    for secret in secret_values() if secrets is None else secrets:
        text = text.replace(secret, MASK)
    return text


def resolve_uri(uri: str | None) -> str:
    """``tracking.uri``, else $MLFLOW_TRACKING_URI, else an absolute SQLite URI for
    outputs/mlflow.db under the current folder (never MLflow's cwd-relative default)."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(Path.cwd() / DEFAULT_STORE).resolve()}"


def uri_key(uri: str | None) -> str:
    """Where the URI came from, for error messages: the config key or the variable."""
    return (
        "MLFLOW_TRACKING_URI"
        if not uri and os.environ.get("MLFLOW_TRACKING_URI")
        else ("tracking.uri")
    )


def describe_store(uri: str) -> str:
    return uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else uri


def check_store(uri: str, key: str = "tracking.uri") -> None:
    """Fail fast, with the fix, when the store cannot be opened."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///") :])
        if path == (Path.cwd() / DEFAULT_STORE).resolve():
            path.parent.mkdir(parents=True, exist_ok=True)
        if not path.parent.is_dir():
            raise ConfigError(
                f"{key}={uri}: cannot open the MLflow store, folder {path.parent} does not exist: "
                "create it, or leave tracking.uri unset for outputs/mlflow.db"
            )
        if path.exists() and not os.access(path, os.R_OK | os.W_OK):
            raise ConfigError(f"{key}={uri}: {path} is not readable and writable: fix its mode")
        return
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5):
                return
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise ConfigError(
                f"{key}={uri}: the MLflow server does not answer ({getattr(err, 'reason', err)}):"
                " start it (mlflow server ...) or fix the address"
            ) from None
    if uri.startswith("file:") or "://" not in uri:
        raise ConfigError(
            f"{key}={uri}: MLflow 3 no longer writes plain-folder stores: use a database, "
            "e.g. tracking.uri=sqlite:////abs/path/mlflow.db, or an http:// server"
        )


def prepare_store(uri: str) -> None:
    """Create or migrate a SQLite store once, under a file lock, before any job writes to it.

    MLflow creates its tables on first use; several processes doing that at once on a new file
    race (``table ... already exists``). The CLI calls this before launching jobs, and the lock
    serialises independent commands started together.
    """
    if not uri.startswith("sqlite:///"):
        return  # a server or database migrates itself (``mlflow db upgrade``)
    import fcntl

    path = Path(uri[len("sqlite:///") :])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            client_for(uri).search_experiments(max_results=1)  # opens (creates) the store
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def client_for(uri: str):
    import logging

    from mlflow import MlflowClient

    # MLflow logs store creation and migrations at INFO on the console; ampsweep says what
    # matters itself.
    logging.getLogger("mlflow").setLevel(logging.WARNING)

    return MlflowClient(tracking_uri=uri)


def get_or_create_experiment(client, name: str, artifact_root: str | None) -> str:
    """The experiment's id; a new one gets an explicit artifact location (for local stores)
    so artifacts land under outputs/, not in ./mlruns of whatever folder we run from."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if artifact_root:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        location = (Path(artifact_root).expanduser().resolve() / safe).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created meanwhile by a concurrent job
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_run(uri: str, run_id: str):
    """The run with this id in this store, or None (a malformed id is simply not found)."""
    try:
        return client_for(uri).get_run(run_id)
    except Exception:
        return None


def find_finished(uri: str, experiment: str, config_hash: str):
    """A FINISHED run of the experiment whose ``config_hash`` tag matches, or None."""
    client = client_for(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.config_hash = '{config_hash}' and attributes.status = 'FINISHED'",
        max_results=1,
        order_by=["attributes.start_time DESC"],
    )
    return runs[0] if runs else None


def experiment_for(client, uri: str, cfg: TrackingConfig) -> str:
    """``tracking.experiment``'s id in the store at ``uri``. Only a local store gets our
    artifact location; a server decides (and may serve) its own."""
    local = uri.startswith("sqlite:")
    return get_or_create_experiment(client, cfg.experiment, cfg.artifact_root if local else None)


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, ConfigError):
        text = f"{type(err).__name__}: {text}"
    return text[:MAX_TAG_CHARS]


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
        uri = uri or resolve_uri(cfg.uri)
        client = client_for(uri)
        exp_id = experiment_for(client, uri, cfg)
        all_tags = mask_secrets(tags or {})
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
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
        client = client_for(uri)
        client.update_run(run_id, status=RUNNING)
        rec = cls(client, run_id, uri, flush_every, flush_seconds)
        if after_step is not None:
            for key in client.get_run(run_id).data.metrics:
                for m in client.get_metric_history(run_id, key):
                    if m.step > after_step:
                        rec._logged.add((key, m.step))
        return rec

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in mask_secrets(params).items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, v[:MAX_TAG_CHARS]) for k, v in mask_secrets(tags).items()]
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
        path = Path(path)
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
        finally:
            self._writer.shutdown(wait=True)
            if error:
                self.set_tags({"error": error})
            self.client.set_terminated(self.run_id, status=status)
