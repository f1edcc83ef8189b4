"""tracking/store.py: where the store is, opening it (one line and the fix when it cannot be),
and the queries every part of ampsweep asks of it."""

from __future__ import annotations

import os

import pytest

from ampsweep.config.schema import ConfigError
from ampsweep.tracking import store


def test_resolve_uri(tmp_path, monkeypatch):
    assert store.resolve_uri(None) == f"sqlite:///{tmp_path.resolve()}/outputs/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////somewhere/else.db")
    assert store.resolve_uri(None) == "sqlite:////somewhere/else.db"
    assert store.resolve_uri("sqlite:////given.db") == "sqlite:////given.db"  # the key wins
    assert store.uri_key(None) == "MLFLOW_TRACKING_URI"
    assert store.uri_key("sqlite:////given.db") == "tracking.uri"


def test_default_store_folder_is_created(tmp_path):
    store.check(store.resolve_uri(None))
    assert (tmp_path / "outputs").is_dir()


@pytest.mark.parametrize(
    "uri,words",
    [
        ("sqlite:////no/such/folder/mlflow.db", "does not exist"),
        ("file:///tmp/mlruns", "plain-folder stores"),
        ("just/a/folder", "plain-folder stores"),
        ("http://127.0.0.1:9/", "does not answer"),  # the discard port: nothing listens
    ],
)
def test_check_store_errors(uri, words):
    with pytest.raises(ConfigError) as info:
        store.check(uri)
    message = str(info.value)
    assert message.startswith(f"tracking.uri={uri}: ") and words in message
    assert "\n" not in message


def test_an_unwritable_store_is_refused(tmp_path, monkeypatch):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    # As root every file is writable; what a user without write access sees is simulated.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError) as info:
        store.check(f"sqlite:///{db}")
    assert str(info.value) == (
        f"tracking.uri=sqlite:///{db}: {db} is not readable and writable: fix its mode"
    )


def test_one_line():
    assert store.one_line(ValueError("a\n  b")) == "ValueError: a b"
    assert store.one_line(ConfigError("x=1: fix")) == "x=1: fix"
    assert store.one_line(KeyError()) == "KeyError: KeyError"
    assert len(store.one_line(ValueError("x" * 10_000))) == store.MAX_TAG_CHARS


def test_prepare_creates_a_new_store_once(tmp_path):
    uri = f"sqlite:///{tmp_path / 'sub' / 'mlflow.db'}"
    store.prepare(uri)
    store.prepare(uri)  # again: nothing to do
    assert (tmp_path / "sub" / "mlflow.db").stat().st_size > 0
    assert store.client_for(uri).search_experiments()  # MLflow's Default experiment


def test_queries(store_uri):
    client = store.client_for(store_uri)
    exp = client.create_experiment("e")
    assert store.find_run(client, "not-a-run-id") is None
    parent = client.create_run(exp, tags={store.SWEEP: "true", "skipped.3": "r9"})
    kids = [client.create_run(exp, tags={store.PARENT: parent.info.run_id}) for _ in range(2)]
    other = client.create_run(exp, tags={store.CONFIG_HASH: "abc"})
    client.set_terminated(other.info.run_id, store.FINISHED)
    parent = client.get_run(parent.info.run_id)
    assert [r.info.run_id for r in store.children(client, parent)] == [k.info.run_id for k in kids]
    assert [r.info.run_id for r in store.sweeps(client, [exp])] == [parent.info.run_id]
    assert store.sweeps(client, [exp], status=store.FINISHED) == []
    assert store.sweeps(client, []) == []
    assert store.skipped_jobs(parent) == {"3": "r9"}
    assert store.finished_twin(client, "e", "abc").info.run_id == other.info.run_id
    assert store.finished_twin(client, "e", "xyz") is None
    assert store.finished_twin(client, "no such experiment", "abc") is None
    running = store.running_children(client, parent)
    assert sorted(r.info.run_id for r in running) == sorted(k.info.run_id for k in kids)
