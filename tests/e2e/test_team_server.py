"""`ampsweep ui` for a team: other machines reach it by a Host header that must be allowed."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import REPO, free_port

from ampsweep.cli import ui

pytestmark = pytest.mark.slow


def _status(port: int, host_header: str) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1",
        headers={"Host": host_header},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def _reader(proc: subprocess.Popen) -> queue.Queue[str]:
    """The server's output lines, read on a thread (so a wait can time out)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    return lines


def _wait_for_ui(
    proc: subprocess.Popen, lines: queue.Queue[str], seen: list[str], until: str = "MLflow UI: "
) -> None:
    """Until ``ampsweep ui`` prints a line starting with ``until`` (by default: it serves);
    each line read is kept in ``seen``."""
    deadline = time.monotonic() + 180
    while not any(x.lstrip().startswith(until) for x in seen):
        assert time.monotonic() < deadline and proc.poll() is None, seen
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            pass


def test_allowed_hosts_let_another_name_in_and_keep_unknown_ones_out(tmp_path, empty_store):
    import shutil

    shutil.copy(empty_store, tmp_path / "mlflow.db")
    port = free_port()
    cmd = [sys.executable, "-m", "ampsweep", "ui", "--host", "0.0.0.0", "--port", str(port)]
    cmd += ["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    cmd += ["--allowed-hosts", f"mlflow.lab.example:{port}"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, seen = _reader(proc), []
    try:
        _wait_for_ui(proc, lines, seen)
        assert _status(port, f"mlflow.lab.example:{port}") == 200  # the name others use
        assert _status(port, f"127.0.0.1:{port}") == 200  # this machine still gets in
        assert _status(port, f"evil.example:{port}") == 403  # DNS rebinding stays refused
        _wait_for_ui(proc, lines, seen, until="Ctrl-C stops it.")  # its last line
        text = "".join(seen)
        assert f"other machines reach it as mlflow.lab.example:{port}" in text
        # The server's access log and warnings go to its log file, not over our lines.
        assert "INFO" not in text and "Uvicorn" not in text
        assert (tmp_path / "mlflow-ui.log").is_file()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_local_names_stay_allowed_beside_the_ones_given():
    cmd = ui.server_command("sqlite:////x/mlflow.db", "0.0.0.0", 5000, "lab.example:5000")
    allowed = cmd[cmd.index("--allowed-hosts") + 1].split(",")
    assert "lab.example:5000" in allowed and "127.0.0.1:5000" in allowed
    assert "localhost:5000" in allowed
    assert "--allowed-hosts" not in ui.server_command("sqlite:////x/mlflow.db", "127.0.0.1", 5000)


def test_a_port_in_time_wait_is_free_to_listen_on():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the side that closes first keeps the port in TIME_WAIT
    client.close()
    server.close()
    assert ui.port_free("127.0.0.1", port)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert not ui.port_free("127.0.0.1", busy.getsockname()[1])


# ---------------------------------------------------------------- logins (MLflow basic-auth)

ADMIN_PASSWORD = "adm1n-e2e-password"
PASSWORDS = {"alice": "alice-e2e-password", "bob": "bob-e2e-password1"}
# No logged model and no system metrics: each file and each batch is a request, and the server
# checks the password of every request (werkzeug's scrypt: 0.1 s of CPU each), while this test
# is about who may write, not about what a run writes.
TINY = ["model=mlp", "model.width=8", "trainer.epochs=1", "trainer.max_steps=4",
        "trainer.log_every=2", "trainer.progress=false", "trainer.timing_warmup_steps=1",
        "diagnostics.every=0", "tracking.log_model=false",
        "tracking.system_metrics=false"]  # fmt: skip


def _as(user: str | None) -> dict[str, str]:
    """The environment of a command run as ``user`` (None: no login at all)."""
    if user is None:
        return {"MLFLOW_TRACKING_USERNAME": "", "MLFLOW_TRACKING_PASSWORD": ""}
    password = ADMIN_PASSWORD if user == "admin" else PASSWORDS[user]
    return {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}


def test_a_team_server_refuses_a_user_without_permission_and_records_one_with_it(
    tmp_path, empty_store, monkeypatch, main
):
    """``ampsweep ui --team``: MLflow's basic-auth in front of the store. A user without EDIT
    on an experiment is refused in one line before anything trains, so is a command without
    a login; a user granted EDIT records a sweep there; no password is printed."""
    import shutil

    from mlflow import MlflowClient
    from mlflow.server import get_app_client

    shutil.copy(empty_store, tmp_path / "mlflow.db")
    port = free_port()
    cmd = [sys.executable, "-m", "ampsweep", "ui", "--team", "--port", str(port)]
    cmd += ["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD,
    }
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines, seen = _reader(proc), []
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_ui(proc, lines, seen)
        assert _status(port, f"127.0.0.1:{port}") == 401  # nothing without a login
        with monkeypatch.context() as admin:  # the admin creates the users and the experiment
            for name, value in _as("admin").items():
                admin.setenv(name, value)
            auth = get_app_client("basic-auth", tracking_uri=url)
            for user, password in PASSWORDS.items():
                auth.create_user(user, password)
            exp_id = MlflowClient(url).create_experiment("team")
            auth.grant_user_permission("bob", "experiment", exp_id, "EDIT")
        train = ["train", *TINY, f"tracking.uri={url}", "tracking.experiment=team"]
        for user, says in [
            (None, f"error: tracking.uri={url}: the MLflow server needs a login and refused "
                   "no login: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"),
            ("alice", "error: tracking.experiment=team: user alice may not write to this "
                      f"experiment on {url}: ask its owner or the server's admin for EDIT"),
        ]:  # fmt: skip
            with monkeypatch.context() as login:  # in this process: refused before training
                for name, value in _as(user).items():
                    login.setenv(name, value)
                refused = main(*train)
            assert refused.code == 2, refused.err[-2000:]
            (line,) = refused.err.strip().splitlines()
            assert line.startswith(says), line
        sweep_args = ["train", "-m", *train[1:], "precision=fp32,bf16"]
        with monkeypatch.context() as login:
            for name, value in _as("bob").items():
                login.setenv(name, value)
            sweep = main(*sweep_args)
        assert sweep.code == 0, sweep.err[-3000:]
        assert "Findings" in sweep.out
        assert PASSWORDS["bob"] not in sweep.out + sweep.err
        with monkeypatch.context() as admin:
            for name, value in _as("admin").items():
                admin.setenv(name, value)
            runs = MlflowClient(url).search_runs([exp_id])
        assert len(runs) == 3 and all(r.info.status == "FINISHED" for r in runs)
        assert (tmp_path / "mlflow-auth.db").is_file()  # the users live beside the store
    finally:
        proc.terminate()
        proc.wait(timeout=30)
