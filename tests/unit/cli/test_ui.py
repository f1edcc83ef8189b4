"""app/ui.py: what ``ampsweep ui`` refuses (one line, exit 2, no server started) and the link
and server command it makes. The served UI itself is tested in tests/e2e/test_ui.py."""

from __future__ import annotations

import socket

import pytest

from ampsweep.cli import ui
from ampsweep.tracking import store


@pytest.fixture
def no_server(monkeypatch):
    """Fail the test if a refusal would still start ``mlflow server``."""

    def popen(*args, **kwargs):
        raise AssertionError("mlflow server was started")

    monkeypatch.setattr(ui.subprocess, "Popen", popen)


def one_line(result) -> str:
    assert result.code == 2, (result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    return lines[0]


def test_a_missing_store_is_refused(tmp_path, main, no_server):
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    line = one_line(main("ui", "--tracking-uri", missing))
    assert f"--tracking-uri {missing}: no MLflow store at {tmp_path / 'none.db'}" in line
    assert "run `ampsweep train` first" in line
    assert not (tmp_path / "none.db").exists()  # and it made none


@pytest.mark.parametrize("uri", ["postgresql://u@db/mlflow", "file:///tmp/mlruns", "databricks"])
def test_a_store_that_is_not_sqlite_or_a_server_is_refused(uri, main, no_server):
    line = one_line(main("ui", "--tracking-uri", uri))
    assert f"--tracking-uri {uri}: ampsweep ui serves sqlite:/// or http(s):// stores" in line


def test_a_busy_port_is_refused(store_uri, main, no_server):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line(main("ui", "--tracking-uri", store_uri, "--port", str(port)))
    assert line == (
        f"error: --port {port}: 127.0.0.1:{port} is already in use: pass another --port"
    )


def test_a_server_that_does_not_answer_is_refused(main, no_server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    line = one_line(main("ui", "--tracking-uri", f"http://127.0.0.1:{port}"))
    assert f"--tracking-uri=http://127.0.0.1:{port}: the MLflow server does not answer" in line


def test_the_link_opens_the_newest_sweep_in_the_classic_runs_view(store_uri):
    client = store.client_for(store_uri)
    link, about = ui.experiment_link(store_uri, "http://h:1")
    assert link == "http://h:1/#/experiments/0?workflowType=machine_learning"  # Default
    exp = client.create_experiment("ampsweep")
    parent = client.create_run(exp, run_name="sweep-1", tags={store.SWEEP: "true"})
    link, about = ui.experiment_link(store_uri, "http://h:1")
    assert "newest sweep" not in about  # a sweep without runs yet is not worth opening
    client.create_run(exp, run_name="fp32-cnn-digits", tags={store.PARENT: parent.info.run_id})
    link, about = ui.experiment_link(store_uri, "http://h:1")
    assert link == f"http://h:1/#/experiments/{exp}?workflowType=machine_learning"
    assert f"/runs/{parent.info.run_id}?workflowType=machine_learning" in about
    assert "newest sweep sweep-1" in about


def test_the_server_keeps_artifacts_beside_the_store(tmp_path):
    cmd = ui.server_command(f"sqlite:///{tmp_path / 'mlflow.db'}", "127.0.0.1", 5001)
    assert cmd[cmd.index("--artifacts-destination") + 1] == (tmp_path / "mlartifacts").as_uri()
    assert cmd[cmd.index("--port") + 1] == "5001" and "--workers" in cmd


def test_mlflows_genai_job_runner_is_off_unless_the_user_turns_it_on():
    assert ui.server_env({"PATH": "/bin"}) == {"PATH": "/bin", ui.JOB_EXECUTION: "false"}
    assert ui.server_env({ui.JOB_EXECUTION: "true"})[ui.JOB_EXECUTION] == "true"
