"""``ampsweep ui`` lists ampsweep's experiments only: MLflow's empty "Default" experiment,
whose artifact location (./mlruns/0) no ampsweep run uses, is hidden before the UI starts."""

from __future__ import annotations

from ampsweep.cli import ui
from ampsweep.tracking import store


def test_an_empty_default_experiment_is_hidden_once(store_uri):
    client = store.client_for(store_uri)
    client.create_experiment("ampsweep")
    assert ui.hide_empty_default(client) is True
    assert [e.name for e in client.search_experiments()] == ["ampsweep"]  # what the UI lists
    assert client.get_experiment("0").lifecycle_stage == "deleted"  # restorable
    assert ui.hide_empty_default(client) is False


def test_a_default_experiment_someone_logged_to_is_kept(store_uri):
    client = store.client_for(store_uri)
    client.create_run("0")
    assert ui.hide_empty_default(client) is False
    assert "Default" in [e.name for e in client.search_experiments()]
