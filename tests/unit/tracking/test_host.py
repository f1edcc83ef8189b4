"""tracking/host.py: MLflow in a process of its own. Its clients' calls come back as plain
values or as the original error's name and text; the functions of mlflow_calls run there; a
host that is gone leaves the calls to this process; a fork of the command has no host."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys

import pytest

from ampsweep.tracking import host, store


@pytest.fixture
def served(store_uri):
    """A host serving this test process (no imports of its own: MLflow is imported here)."""
    recorder = host.Host.start((), store.local_client)
    host.serve_this_process(recorder)
    yield recorder
    host.stop_serving()


def test_calls_are_made_in_the_host_and_come_back_as_plain_values(served, store_uri):
    client = store.client_for(store_uri)
    assert isinstance(client, host.RemoteClient)
    exp_id = client.create_experiment("e")
    run = client.create_run(exp_id, run_name="r", tags={"a": "1"})
    store.run_with(client, "set_tags", run.info.run_id, [("b", 2)])
    store.run_with(client, "write_record", run.info.run_id, {"op": "metrics", "items": [
        ("loss", 0.5, 1000, 3)]})  # fmt: skip
    found = client.search_runs([exp_id], max_results=10)
    assert isinstance(found, host.Records) and found.token is None
    [got] = found
    assert isinstance(got, host.Record) and isinstance(got.info, host.Record)
    assert got.data.tags["a"] == "1" and got.data.tags["b"] == "2"
    assert got.data.metrics == {"loss": 0.5} and got.info.status == store.RUNNING
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [3]
    # what comes back unpickles where MLflow is not imported
    code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); print(sorted(sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(got), env=env,
                         capture_output=True)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "mlflow" not in res.stdout.decode()


def test_an_error_in_the_host_is_raised_here_by_its_name_and_text(served, store_uri):
    client = store.client_for(store_uri)
    with pytest.raises(host.RemoteError) as caught:
        client.get_run("0" * 32)
    assert type(caught.value).__name__ == "MlflowException"
    assert "not found" in str(caught.value).lower()
    assert store.one_line(caught.value).startswith("MlflowException: ")
    assert store.find_run(client, "0" * 32) is None
    again = pickle.loads(pickle.dumps(caught.value))  # a launcher may carry it back
    assert type(again) is type(caught.value) and str(again) == str(caught.value)


def test_the_host_ignores_the_process_groups_signals_and_ends_with_the_command(served, store_uri):
    client = store.client_for(store_uri)
    os.kill(served.pid, signal.SIGINT)  # Ctrl-C at a terminal reaches the whole group
    os.kill(served.pid, signal.SIGTERM)  # as does SLURM's notice
    assert client.get_experiment_by_name("Default").experiment_id == "0"
    host.stop_serving()  # the command's exit: its end closes, the host ends and is reaped
    with pytest.raises(ChildProcessError):
        os.waitpid(served.pid, os.WNOHANG)
    assert host.serving() is None
    assert not isinstance(store.client_for(store_uri), host.RemoteClient)


def test_calls_after_the_host_was_killed_are_made_here(served, store_uri):
    client = store.client_for(store_uri)
    exp_id = client.create_experiment("e")
    os.kill(served.pid, signal.SIGKILL)
    os.waitpid(served.pid, 0)
    run = client.create_run(exp_id)  # made in this process: a real MLflow entity
    assert type(run).__module__.startswith("mlflow.")
    assert store.run_with(client, "set_tags", run.info.run_id, [("x", "y")]) is None
    assert client.get_run(run.info.run_id).data.tags["x"] == "y"


def test_a_process_forked_from_the_command_has_no_host(served):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if host.serving() is None else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert host.serving() is served


def test_only_plain_values_come_back():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="cannot send a Opaque back"):
        host.plain(Opaque())
    assert host.plain({"a": (1, 2.0, "x", None)}) == {"a": [1, 2.0, "x", None]}


def test_an_argument_that_cannot_be_sent_is_refused_and_the_host_serves_on(served, store_uri):
    client = store.client_for(store_uri)
    with pytest.raises(Exception, match="pickle"):
        client.search_experiments(filter_string=lambda: None)
    assert not served.gone
    assert client.get_experiment("0").name == "Default"
