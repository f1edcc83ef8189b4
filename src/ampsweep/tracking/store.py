"""The MLflow store: where it is, opening it, and every name and query ampsweep uses in it.

Tag names and run statuses are constants here, and the questions ampsweep asks of a store
(the newest sweep, a sweep's children, a finished run of the same config) are functions here,
so the recorder, sweeps, the report, ``ui`` and ``reproduce`` agree on them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path

from ampsweep.config.schema import ConfigError, TrackingConfig
from ampsweep.errors import FaultError

DEFAULT_STORE = Path("outputs") / "mlflow.db"
MAX_TAG_CHARS = 5000

# Run statuses (MLflow's)
RUNNING, FINISHED, FAILED, KILLED = "RUNNING", "FINISHED", "FAILED", "KILLED"

# Tags of a run
PARENT = "mlflow.parentRunId"  # MLflow nests a child run under its parent by this tag
PRECISION, MODEL, DATASET = "precision", "model", "dataset"  # what the run trained
CONFIG_HASH = "config_hash"  # what determines the result (a relaunch finds a finished twin)
CHECKPOINT_DIR = "checkpoint_dir"  # the run's checkpoint folder (resume by run id)
ERROR = "error"  # why a run failed, in one line
PREVIOUS_ERROR = "previous_error"  # why a resumed run had stopped before
DIVERGED = "diverged"
JOB_NUM = "job_num"  # Hydra's job number in a sweep
CLUSTER_JOB = "slurm_job_id"  # the SLURM job that trains the run (``12_3``: array task 3)
OVERRIDES = "overrides"
REPRODUCES = "reproduces"  # the run a reproduction repeats
ENDED_BY = "ended_by"  # who ended a run whose own process could not
# MLflow's run description (mlflow.utils.mlflow_tags.MLFLOW_RUN_NOTE), which its UI shows on a
# run's Overview page: a sweep's parent carries its report's answer there
NOTE = "mlflow.note.content"
NOTE_MAX_CHARS = 8000  # MLflow's limit on a tag's value (mlflow.utils.validation)
HOST, PID = "host", "pid"  # the process that trains a run (judged when it is gone)
GIT_COMMIT, GIT_DIRTY = "git_commit", "git_dirty"
AMPSWEEP_VERSION = "ampsweep_version"
# A component named by ``_target_``: <section>.target = its dotted path, and where its code
# came from (<section>.target.version, .git_commit, .git_dirty, .sha256 of its module file),
# so ``reproduce`` can tell whether the code it imports now is the code that ran.
TARGET_FIELDS = ("version", "git_commit", "git_dirty", "sha256")
DATA_PREFIX = "data."  # facts about the data a run read (data.text_sha256, data.num_classes, ..)


def target_tag(section: str, field: str | None = None) -> str:
    """The tag holding a ``_target_`` component's path (``field`` None) or a fact about its
    code (one of TARGET_FIELDS)."""
    return f"{section}.target" + (f".{field}" if field else "")


# Where a run happened (runner.environment writes them; the report reads them back)
DEVICE, DEVICE_NAME, TORCH_VERSION, CUDA_VERSION = (
    "device",
    "device_name",
    "torch_version",
    "cuda_version",
)
COMPUTE_CAPABILITY, CPU_THREADS, CPU_HALF_ISA = (
    "compute_capability",
    "cpu_threads",
    "cpu_half_isa",
)
DEVICE_TAGS = (
    DEVICE,
    DEVICE_NAME,
    COMPUTE_CAPABILITY,
    CPU_THREADS,
    CPU_HALF_ISA,
    TORCH_VERSION,
    CUDA_VERSION,
)

# fp8 modes: which nn.Linear layers were converted (names, comma-separated), which were kept
# (every layer and why: the fp8_layers.json artifact), whether it was torchao's emulation.
FP8_CONVERTED, FP8_KEPT, FP8_EMULATED = "fp8.converted", "fp8.kept", "fp8.emulated"
FP8_LAYERS_ARTIFACT = "fp8_layers.json"
CAPACITY = "ampsweep.capacity"  # "true" on a run of ``ampsweep capacity`` (a batch search)

# What a run logs besides tags
MODEL_NAME = "model"  # the logged model's name: runs:/<run id>/model
SYSTEM_PREFIX = "system/"  # MLflow's system metrics (the UI's System metrics tab shows them)
TRAINING, VALIDATION = "training", "validation"  # a data set's context (MLflow's values)

# Tags of a sweep's parent run
SWEEP = "ampsweep.sweep"  # "true" on a sweep's parent run
SWEEP_DIR, COMMAND = "sweep_dir", "command"
JOBS_EXPECTED = "jobs_expected"
LAUNCHER_HOST, LAUNCHER_PID = "launcher_host", "launcher_pid"  # who launched it
SKIPPED_PREFIX = "skipped."  # skipped.<job num> = the FINISHED run standing in for a job
# Why a sweep's report is not on its parent (a signal while it was written): the parent ends
# KILLED with it; `ampsweep report` writes the report, removes the tag and ends the parent as
# its jobs decide.
REPORT_MISSING = "report_missing"
# Why a finished run has no figure for something the report shows (too few steps to time, no
# logged point), in words, with what to set
BLANKS = "blanks"


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
    if not uri and os.environ.get("MLFLOW_TRACKING_URI"):
        return "MLFLOW_TRACKING_URI"
    return "tracking.uri"


def describe(uri: str) -> str:
    return uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else uri


def sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


# How every command's --tracking-uri describes its default (resolve_uri)
STORE_HELP = "MLflow store (default: $MLFLOW_TRACKING_URI, else outputs/mlflow.db here)"


def is_server(uri: str) -> bool:
    """Whether ``uri`` is an MLflow tracking server (which keeps its own database)."""
    return uri.startswith(("http://", "https://"))


def check(uri: str, key: str = "tracking.uri") -> None:
    """Fail fast, with the fix, when the store cannot be opened."""
    path = sqlite_path(uri)
    if path is not None:
        if path == (Path.cwd() / DEFAULT_STORE).resolve():
            path.parent.mkdir(parents=True, exist_ok=True)
        if not path.parent.is_dir():
            raise ConfigError(
                f"{key}={uri}: cannot open the MLflow store, folder {path.parent} does not exist: "
                "create it, or leave tracking.uri unset for outputs/mlflow.db"
            )
        if path.is_dir():
            raise ConfigError(
                f"{key}={uri}: {path} is a folder, not an MLflow store: point tracking.uri at "
                "a .db file (e.g. sqlite:///" + f"{path / 'mlflow.db'})"
            )
        if path.exists() and not os.access(path, os.R_OK | os.W_OK):
            raise ConfigError(f"{key}={uri}: {path} is not readable and writable: fix its mode")
        if not os.access(path.parent, os.W_OK):  # SQLite writes its journal beside the file
            raise ConfigError(
                f"{key}={uri}: the MLflow store's folder {path.parent} is not writable: fix its "
                "permissions, or set tracking.uri to a store in a writable folder"
            )
        if not is_sqlite_file(path):
            raise ConfigError(not_a_database(key, uri, path))
        return
    if is_server(uri):
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


def is_sqlite_file(path: Path) -> bool:
    """Whether ``path`` is a SQLite database, or nothing yet (absent or empty: MLflow creates
    its tables there)."""
    if not path.is_file() or path.stat().st_size == 0:
        return True
    try:
        _ask(path, "PRAGMA schema_version")
    except sqlite3.DatabaseError as err:  # locked or busy is a database too
        return "not a database" not in str(err)
    return True


def _ask(path: Path, sql: str):
    """The first row of a read-only query on the SQLite file ``path``.

    Asked of SQLite, never by open() and close(): closing any descriptor of the file drops
    every POSIX lock this process's SQLite connections hold on it (sqlite.org/howtocorrupt,
    2.2), and a sweep checks its store per job while the last job's model is still being
    written: two sweeps on one store then corrupted it. SQLite's own connections share their
    locks."""
    con = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=0.1)
    try:
        return con.execute(sql).fetchone()
    finally:
        con.close()


def not_a_database(key: str, uri: str, path: Path) -> str:
    return (
        f"{key}={uri}: {path} is not an MLflow store (not a SQLite database): point "
        "tracking.uri at another file, or move this one away"
    )


def fault(err: BaseException, uri: str, key: str = "tracking.uri") -> Exception | None:
    """The one line for a store that failed under MLflow (SQLAlchemy's or the server's error
    text), naming the store and the fix; None if ``err`` is no store failure we know."""
    text = str(err)
    where = describe(uri)
    if "file is not a database" in text or "file is encrypted" in text:
        return ConfigError(not_a_database(key, uri, sqlite_path(uri) or Path(where)))
    if "database is locked" in text:
        return FaultError(
            f"the MLflow store {where} stayed locked by another process for longer than "
            "SQLite waits: retry when that process is done, or use a tracking server "
            "for many writers (ampsweep ui --team)"
        )
    if "readonly database" in text or "unable to open database file" in text:
        return FaultError(
            f"the MLflow store {where} cannot be written (the file or its folder is read-only "
            "or gone): fix their permissions, or set tracking.uri to a writable store"
        )
    if "database or disk is full" in text or os.strerror(errno.ENOSPC) in text:
        folder = (sqlite_path(uri) or Path(".")).parent
        return FaultError(
            f"no space left on {mount_of(folder)} for the MLflow store {where}: free space, "
            "or set tracking.uri to a store on another disk"
        )
    if is_server(uri) and ("Max retries exceeded" in text or "Connection refused" in text):
        return FaultError(
            f"the MLflow server {uri} stopped answering ({type(err).__name__}): restart it; "
            "`ampsweep repair` then writes what it missed"
        )
    return None


def mount_of(folder: Path) -> str:
    """The mount point holding ``folder`` (what ``df`` names)."""
    path = Path(os.path.abspath(folder))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def prepare(uri: str) -> None:
    """Create or migrate a SQLite store once, under a file lock, before any job writes to it.

    MLflow creates its tables on first use; several processes doing that at once on a new file
    race (``table ... already exists``). The CLI calls this before launching jobs, and the lock
    serialises independent commands started together.
    """
    path = sqlite_path(uri)
    if path is None:
        return  # a server or database migrates itself (``mlflow db upgrade``)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            client_for(uri).search_experiments(max_results=1)  # opens (creates) the store
        except Exception as err:
            raise fault(err, uri) or err from None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def client_for(uri: str):
    """An ``MlflowClient`` for the store at ``uri``."""
    # Imported here, not at the top: every command imports this module (the parser's help
    # texts), and --help, report's config errors and tracking=none import no MLflow.
    from mlflow import MlflowClient

    # MLflow logs store creation and migrations at INFO on the console; ampsweep says what
    # matters itself.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    # A store that fails is said in one line (``fault``), not as MLflow's logged traceback.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    # Every logged model is pickled on purpose (``logged_model``: torch.export refuses many
    # models a user trains), and MLflow warns of it on every save: a warning at every job of a
    # sweep that the user cannot act on. What loading one runs is said in docs/mlflow-ui.md.
    logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)
    return MlflowClient(tracking_uri=uri)


def set_tags(client, run_id: str, items) -> None:
    """``(key, value)`` pairs as the run's tags, values as strings, in one write."""
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in items])


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


def experiment_for(client, uri: str, cfg: TrackingConfig) -> str:
    """``tracking.experiment``'s id in the store at ``uri``. Only a local store gets our
    artifact location; a server decides (and may serve) its own."""
    local = uri.startswith("sqlite:")
    return get_or_create_experiment(client, cfg.experiment, cfg.artifact_root if local else None)


# ---------------------------------------------------------------- queries


def find_run(client, run_id: str):
    """The run with this id, or None (a malformed id is simply not found)."""
    try:
        return client.get_run(run_id)
    except Exception:
        return None


def finished_twin(client, experiment: str, config_hash: str):
    """The newest FINISHED run of the experiment with this config hash, or None."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.{CONFIG_HASH} = '{config_hash}' and attributes.status = '{FINISHED}'",
        max_results=1,
        order_by=["attributes.start_time DESC"],
    )
    return runs[0] if runs else None


def children(client, parent) -> list:
    """A parent run's child runs, oldest first."""
    return client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT}` = '{parent.info.run_id}'",
        max_results=10000,
        order_by=["attributes.start_time ASC"],
    )


def run_of_cluster_job(client, parent, job_id: str):
    """The child run of a sweep that SLURM job ``job_id`` trains (or trained), or None."""
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT}` = '{parent.info.run_id}' and "
        f"tags.`{CLUSTER_JOB}` = '{job_id}'",
        max_results=1,
        order_by=["attributes.start_time DESC"],
    )
    return runs[0] if runs else None


def sweeps(client, experiment_ids: list[str], status: str | None = None, limit: int = 1000):
    """Sweep parent runs, newest first (only those with ``status``, if given)."""
    if not experiment_ids:
        return []
    where = f"tags.`{SWEEP}` = 'true'"
    if status:
        where += f" and attributes.status = '{status}'"
    return client.search_runs(
        experiment_ids,
        filter_string=where,
        order_by=["attributes.start_time DESC"],
        max_results=limit,
    )


def running_children(client, parent) -> list:
    """A parent run's children that are still RUNNING."""
    return client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT}` = '{parent.info.run_id}' and "
        f"attributes.status = '{RUNNING}'",
        max_results=10000,
    )


def skipped_jobs(parent) -> dict[str, str]:
    """Job number -> the FINISHED run that stood in for it, from a relaunch's parent run."""
    tags = parent.data.tags
    return {k[len(SKIPPED_PREFIX) :]: v for k, v in tags.items() if k.startswith(SKIPPED_PREFIX)}


def fp8_tags(converted: list[str], kept: list[str], emulated: bool) -> dict[str, str]:
    """The tags of a run whose fp8 mode converted ``converted`` (none for other modes)."""
    if not converted:
        return {}
    return {
        FP8_CONVERTED: ",".join(converted)[:MAX_TAG_CHARS],
        FP8_KEPT: ",".join(kept)[:MAX_TAG_CHARS],
        FP8_EMULATED: str(emulated).lower(),
    }


def lost_a_race(err: BaseException) -> bool:
    """Whether a write failed because a concurrent writer inserted the same row between the
    store's check for it and its insert (SQLite, PostgreSQL, or either behind a server): the
    write rolled back whole, and writing again finds that row."""
    text = str(err)
    return "UNIQUE constraint failed" in text or "violates unique constraint" in text


def one_line(err: BaseException) -> str:
    """An exception as the one line recorded in the ``error`` tag and printed."""
    text = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, ConfigError | FaultError):
        text = f"{type(err).__name__}: {text}"
    return text[:MAX_TAG_CHARS]
