"""Shared fixtures and helpers.

Every test runs in a temporary folder of its own (the current directory), and the environment,
torch's global flags and the signal handlers are restored after it, so no test writes into the
checkout or leaks state into the next one. MLflow stores are copies of one migrated empty store
(MLflow migrates a new store for seconds). ``require_tool`` skips a test whose system tool is
missing, or fails it where ``AMPSWEEP_REQUIRE_TOOLS`` asks for that tool (CI sets ``all``).
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from slurm_fixture import tool_required

REPO = Path(__file__).resolve().parents[1]

# One thread per process (unless OMP_NUM_THREADS says otherwise), here and in every process a
# test starts: the suite runs in parallel workers whose tests start more processes, and with
# more threads than cores OpenMP's spinning threads fight over them (an fp16 step on CPU then
# takes tens of times longer). The tiny models of the tests do not need more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Variables a developer's shell may hold that would send a test's runs somewhere else, or make
# a job think it is one rank of a DDP group.
FOREIGN_ENV = ("MLFLOW_TRACKING_URI", "WORLD_SIZE", "RANK")


def _module_fixture(item) -> bool:
    """Whether ``item`` uses a module-scoped fixture of its own test module (a dry run of a
    script, a browser, a server: built once per module and per worker process)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for defs in info.name2fixturedefs.values():
        func = getattr(defs[-1], "func", None)
        if defs[-1].scope == "module" and getattr(func, "__module__", "") == item.module.__name__:
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        # One SLURM cluster per test process: with parallel workers, keep its tests on one.
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm_cluster"))
        # The tests of a module that share a module-scoped fixture run on one worker, which
        # builds it once: scheduled one by one (--dist loadgroup), several workers would each
        # build it (the GPU-day dry run alone takes over a minute). A test with a group keeps
        # it (xdist joins two groups' names into a third group).
        elif not any(item.iter_markers("xdist_group")) and _module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # The slow end-to-end tests first, the quick ones after them: the workers start the
    # long tests early and fill the end with short ones, so that they finish together instead
    # of one waiting for a long test another started last (a stable sort: the order within
    # each part stays the files' order).
    items.sort(key=lambda item: "slow" not in item.keywords)


def pytest_collection_finish(session):
    """Everything imported so far (torch, MLflow, Hydra, transformers: over half a million
    objects) lives as long as the test process: frozen, Python's full garbage collections
    no longer scan it (about 0.5 s each)."""
    gc.freeze()


def pytest_configure(config):
    """``--dist loadgroup`` (scripts/test.sh) needs pytest < 9.2: pytest-xdist 3.8 marks a
    grouped test by rewriting a node id field that pytest 9.2 no longer reads, so every
    xdist_group mark is silently ignored (pytest-dev/pytest-xdist#1386) and each worker builds
    the shared fixtures (the sweep, the browser, the SLURM cluster) again."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    import xdist
    from packaging.version import Version

    new_ids = Version(pytest.__version__) >= Version("9.2")
    if new_ids and Version(xdist.__version__) <= Version("3.8.0"):
        raise pytest.UsageError(
            f"--dist loadgroup: pytest {pytest.__version__} with pytest-xdist "
            f"{xdist.__version__} ignores xdist_group marks (pytest-dev/pytest-xdist#1386): "
            "run scripts/setup_venv.sh dev, which installs pytest<9.2"
        )


# ---------------------------------------------------------------- isolation of every test


def _torch_flags() -> dict:
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    flags = {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "num_threads": torch.get_num_threads(),
        "default_dtype": torch.get_default_dtype(),
    }
    # PyTorch 2.9+ refuses reading the legacy allow_tf32 flags once fp32_precision was set.
    if hasattr(matmul, "fp32_precision"):
        flags["tf32"] = (matmul.fp32_precision, conv.fp32_precision)
    else:
        flags["tf32"] = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    return flags


def _restore_torch_flags(flags: dict) -> None:
    torch.use_deterministic_algorithms(flags["deterministic"], warn_only=flags["warn_only"])
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.set_num_threads(flags["num_threads"])
    torch.set_default_dtype(flags["default_dtype"])
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision, conv.fp32_precision = flags["tf32"]
    else:
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags["tf32"]


@contextlib.contextmanager
def restored_process_state(folder: Path):
    """Run the body in ``folder`` (the current directory), then restore the environment,
    torch's global flags, the SIGTERM/SIGINT handlers, the root logger's handlers and MLflow's
    tracking URI, all of which an in-process command may change."""
    cwd, env = os.getcwd(), os.environ.copy()
    flags = _torch_flags()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    # A handler added to the root logger would hold this test's captured stderr, closed after it.
    root_handlers = list(logging.getLogger().handlers)
    for name in FOREIGN_ENV:
        os.environ.pop(name, None)
    os.chdir(folder)
    try:
        yield folder
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        _restore_torch_flags(flags)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        logging.getLogger().handlers[:] = root_handlers
        if "mlflow" in sys.modules:  # a test that used MLflow's fluent API
            import mlflow

            while mlflow.active_run() is not None:
                mlflow.end_run()
            # runs:/ URIs resolve through the global URI: the next test's must not be this one's
            mlflow.set_tracking_uri(None)


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path):
    """Run the test in its own temporary folder (Hydra's run dirs, outputs/ and checkpoints of
    in-process jobs land there), and restore what it changed of this process after it."""
    with restored_process_state(tmp_path):
        yield tmp_path


# ---------------------------------------------------------------- optional system tools


def require_tool(tool: str, missing: str | None) -> None:
    """``missing``: why ``tool`` cannot be used here (None: it can). Skips the test, or fails
    it where AMPSWEEP_REQUIRE_TOOLS names ``tool`` (or ``all``), so that a failed install in CI
    cannot hide a feature behind a skip. Tools: chromium, postgresql, slurm, compiler,
    submitit."""
    if missing is None:
        return
    if tool_required(tool):
        pytest.fail(f"AMPSWEEP_REQUIRE_TOOLS asks for {tool}, but {missing}")
    pytest.skip(missing)


# ---------------------------------------------------------------- MLflow stores


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(backend_uri: str, folder: Path):
    """``mlflow server`` on 127.0.0.1 with served artifacts; yields its http:// URL."""
    port = free_port()
    log = open(folder / "server.log", "w")
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", backend_uri,
           "--serve-artifacts", "--artifacts-destination", str(folder / "artifacts")]  # fmt: skip
    # the environment and the wait of `ampsweep ui`'s own server (no GenAI job runner)
    from ampsweep.cli import ui

    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=folder,
                            env=ui.server_env())  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            ui.wait_until_up(url, proc, 120, folder / "server.log")
        except ui.UIError as err:
            pytest.fail(f"{err}:\n" + (folder / "server.log").read_text())
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An empty SQLite store with MLflow's tables, made once per session: MLflow runs its
    schema migrations on every new store, which costs seconds each."""
    from ampsweep.tracking.store import client_for

    path = tmp_path_factory.mktemp("empty_store") / "mlflow.db"
    client_for(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store_uri(tmp_path: Path, empty_store: Path) -> str:
    """A fresh, empty SQLite MLflow store (a copy of ``empty_store``), as an absolute URI."""
    shutil.copy(empty_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def store(store_uri: str) -> str:
    """The former name of ``store_uri`` (it shadowed the module ampsweep.tracking.store)."""
    return store_uri


def all_runs(uri: str) -> list:
    """Every run of every experiment in the store at ``uri``."""
    from ampsweep.tracking.store import client_for

    client = client_for(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps, max_results=10000) if exps else []


# ---------------------------------------------------------------- small models


class Gain(torch.nn.Module):
    """``x * gain``: a module whose output leaves fp16's range for a large gain."""

    def __init__(self, gain: float):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


# ---------------------------------------------------------------- configs and commands


# Overrides for a run that takes about a second on CPU.
QUICK = [
    "trainer.epochs=1",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.timing_warmup_steps=1",
    "trainer.progress=false",
    "model.width=8",
]

# A small deterministic run whose weights and losses tests compare across ways of running it
# (one process, DDP ranks, SLURM tasks); its tracking is the caller's choice.
EXACT = [
    "model=mlp",
    "model.width=8",
    "optimizer=sgd",
    "precision=fp32",
    "trainer.device=cpu",
    "trainer.deterministic=true",
    "trainer.epochs=2",
    "trainer.max_steps=12",
    "trainer.timing_warmup_steps=1",
    "trainer.progress=false",
]


@pytest.fixture
def quick() -> list[str]:
    """Overrides for a run that takes about a second on CPU."""
    return list(QUICK)


def sweep_jobs(*args: str) -> tuple[int, list]:
    """What ``ampsweep train -m ARGS`` would run, stopped before the first job: Hydra's
    sweeper (ampsweep's, or the one ARGS names) composes the jobs and hands each batch to the
    command's checks, here one that types them and stops the sweep. The exit code (2 when
    Hydra or the sweeper refused the command) and the typed jobs, in their order."""
    from ampsweep.launch import hydra_app
    from ampsweep.runner import plan
    from ampsweep.runner.job import CommandContext

    jobs: list = []

    def stop(nodes) -> None:
        jobs.extend(plan.typed(n) for n in nodes)
        raise plan.Refused(0)

    command = CommandContext(check_batch=stop)
    return hydra_app.run_hydra(hydra_app.hydra_args(["-m", *args]), command), jobs


def resumable(checkpoint_dir: Path, *extra: str) -> list[str]:
    """Overrides for a small, deterministic run that writes its checkpoints under
    ``checkpoint_dir`` (its tracking is the caller's choice)."""
    return [
        "trainer.epochs=2",
        "trainer.batch_size=32",
        "trainer.log_every=3",
        "trainer.timing_warmup_steps=1",
        "trainer.progress=false",
        "trainer.deterministic=true",
        "model.width=4",
        "model.dropout=0.2",  # draws from the torch RNG every step: the RNG must be restored
        f"trainer.checkpoint_dir={checkpoint_dir}",
        *extra,
    ]


def cli_env(env: dict | None = None) -> dict:
    """The environment of an ``ampsweep`` subprocess: this checkout's sources, no store from
    the developer's shell (unless ``env`` gives one)."""
    full = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for name in FOREIGN_ENV:
        full.pop(name, None)
    return {**full, **(env or {})}


def callback_env(env: dict | None = None) -> dict:
    """``env`` for a subprocess whose config names a callback of tests/callbacks.py (this
    folder on its PYTHONPATH, after the checkout's sources)."""
    path = os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])
    return {**(env or {}), "PYTHONPATH": path}


def run_cli(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 600):
    """Run ``python -m ampsweep ARGS`` in a fresh interpreter of its own; return the
    CompletedProcess. For what only a process of its own shows: signals, a kill and the resume
    after it, DDP and FSDP ranks, launcher jobs, two commands at once; the ``main`` fixture runs
    every other command in the test's own process."""
    return subprocess.run(
        [sys.executable, "-m", "ampsweep", *args],
        cwd=cwd,
        env=cli_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """``python -m ampsweep ARGS`` started in the background (stdout and stderr piped)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ampsweep", *args],
        cwd=cwd,
        env=cli_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@dataclass
class Command:
    """What an in-process ``ampsweep`` command returned and printed."""

    code: int
    out: str
    err: str


@pytest.fixture
def main(capsys):
    """Run ``ampsweep ARGS`` in this process (``cli.main.main``): much cheaper than a
    subprocess where the process boundary tests nothing more."""
    from ampsweep.cli import main as cli

    def run(*args: str) -> Command:
        capsys.readouterr()  # what came before is not this command's output
        code = cli.main(list(args))
        captured = capsys.readouterr()
        return Command(code, captured.out, captured.err)

    return run


def run_in_process(args: list[str], cwd: Path, env: dict | None = None) -> Command:
    """``ampsweep ARGS`` run as the ``main`` fixture runs it, in ``cwd`` with ``env`` added,
    for a fixture shared by many tests (which runs outside every test's isolation): what it
    changes of this process is restored after it, and its output is captured here."""
    from ampsweep.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with restored_process_state(cwd):
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(list(args))
    return Command(code, out.getvalue(), err.getvalue())


# ---------------------------------------------------------------- one sweep for many tests


@dataclass
class SweepRun:
    folder: Path  # where the command ran
    uri: str  # its store
    args: list[str]
    result: Command


@pytest.fixture(scope="session")
def three_mode_sweep(tmp_path_factory, empty_store) -> SweepRun:
    """``ampsweep train -m precision=fp32,fp16,bf16`` run once, in this process, with the
    store given by MLFLOW_TRACKING_URI. Read it, never write to it: several tests share it
    (mark them ``xdist_group("three_mode_sweep")`` so that one worker runs them all)."""
    folder = tmp_path_factory.mktemp("three_mode_sweep")
    shutil.copy(empty_store, folder / "mlflow.db")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    args = ["train", "-m", "precision=fp32,fp16,bf16", *QUICK]
    result = run_in_process(args, cwd=folder, env={"MLFLOW_TRACKING_URI": uri})
    assert result.code == 0, result.err[-3000:]
    return SweepRun(folder, uri, args, result)
