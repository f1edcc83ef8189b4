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

from ampsweep.app import ui

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
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any(x.startswith("MLflow UI: ") for x in seen):
            assert time.monotonic() < deadline and proc.poll() is None, seen
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        assert _status(port, f"mlflow.lab.example:{port}") == 200  # the name others use
        assert _status(port, f"127.0.0.1:{port}") == 200  # this machine still gets in
        assert _status(port, f"evil.example:{port}") == 403  # DNS rebinding stays refused
        time.sleep(1)
        while not lines.empty():
            seen.append(lines.get())
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
