"""A shared tracking server: a real ``mlflow server`` on loopback (SQLite, and PostgreSQL from
Debian's postgresql package, required in CI), with artifacts served over HTTP. The commands run
in this process (``cli.main.main``): the server is the other side of the wire."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import subprocess
import tempfile
from glob import glob
from pathlib import Path

import pytest
from conftest import free_port, mlflow_server, require_tool

TINY = [
    "model=mlp",
    "model.width=8",
    "trainer.epochs=1",
    "trainer.max_steps=4",
    "trainer.log_every=1",
    "trainer.progress=false",
    "trainer.timing_warmup_steps=1",
]


def _read_back(url: str):
    """Every run in the server's store, read over HTTP (``ampsweep report`` comes later)."""
    from mlflow import MlflowClient

    client = MlflowClient(url)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client, client.search_runs(exps, max_results=1000)


@pytest.mark.slow
def test_sweep_over_http_with_served_artifacts(tmp_path, main):
    with mlflow_server(f"sqlite:///{tmp_path / 'server.db'}", tmp_path) as url:
        res = main("train", "-m", *TINY, "precision=fp32,bf16", f"tracking.uri={url}")
        assert res.code == 0, res.err[-3000:]
        client, runs = _read_back(url)
        parent = next(r for r in runs if r.data.tags.get("ampsweep.sweep") == "true")
        kids = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert len(runs) == 3 and len(kids) == 2
        assert parent.info.status == "FINISHED"
        metric_points = 0
        for kid in kids:
            assert kid.info.status == "FINISHED"
            # artifacts went through the server (mlflow-artifacts:), not to a local folder
            assert kid.info.artifact_uri.startswith("mlflow-artifacts:")
            names = {a.path for a in client.list_artifacts(kid.info.run_id)}
            assert {"config.yaml", "summary.json", ".hydra"} <= names
            text = Path(client.download_artifacts(kid.info.run_id, "config.yaml", str(tmp_path)))
            assert "precision:" in text.read_text()
            for key in kid.data.metrics:
                metric_points += len(client.get_metric_history(kid.info.run_id, key))
            assert len(client.get_metric_history(kid.info.run_id, "train/loss")) == 4
        assert not (tmp_path / "outputs" / "mlflow.db").exists()  # nothing fell back to local
        print(f"server test: {len(runs)} runs, {metric_points} metric points over HTTP")


# ---------------------------------------------------------------- PostgreSQL


def _pg_bin() -> Path | None:
    found = sorted(glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@contextlib.contextmanager
def postgres():
    """A throw-away PostgreSQL cluster on 127.0.0.1; yields a SQLAlchemy URI for database
    ``mlflow``. PostgreSQL refuses to run as root, so as root it runs as user postgres."""
    bindir = _pg_bin()
    require_tool(
        "postgresql",
        None if bindir else "PostgreSQL is not installed (Debian: apt-get install postgresql)",
    )
    psycopg2 = importlib.util.find_spec("psycopg2")
    require_tool(
        "postgresql", None if psycopg2 else "MLflow's PostgreSQL backend needs psycopg2-binary"
    )
    as_user: list[str] = []
    user = None
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            missing = "running as root and there is no 'postgres' user to run PostgreSQL"
            require_tool("postgresql", missing)
    folder = Path(tempfile.mkdtemp(prefix="ampsweep-pg-"))  # not under root's private /tmp dir
    if user is not None:
        os.chown(folder, user.pw_uid, user.pw_gid)
        as_user = [shutil.which("runuser") or "runuser", "-u", "postgres", "--"]
    data, port = folder / "data", free_port()

    def pg(*cmd):
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=120)

    pg(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")
    opts = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1"
    log = str(folder / "pg.log")
    pg(str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", log, "-w", "start")
    try:
        pg(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "mlflow")
        # SQLAlchemy 2.1 reads plain postgresql:// as psycopg 3: name the driver we install
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/mlflow"
    finally:
        pg(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_server_with_postgresql_backend(tmp_path, main):
    with postgres() as db, mlflow_server(db, tmp_path) as url:
        res = main("train", *TINY, f"tracking.uri={url}")
        assert res.code == 0, res.err[-3000:]
        client, runs = _read_back(url)
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
        run = runs[0]
        assert {"val/acc", "perf/samples_per_s", "train/loss"} <= set(run.data.metrics)
        assert run.data.params["model.name"] == "mlp"
        assert "summary.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
        # the rows really are in PostgreSQL
        import sqlalchemy

        with sqlalchemy.create_engine(db).connect() as conn:
            n = conn.execute(sqlalchemy.text("select count(*) from runs")).scalar()
        assert n == 1
