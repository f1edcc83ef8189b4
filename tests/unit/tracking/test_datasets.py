"""tracking/datasets.py: the data sets a run saw, recorded with their digests, contexts,
schemas and sizes (through the recorder, into a real store)."""

from __future__ import annotations

import json

from sqlalchemy.orm import Session

from ampsweep.tracking import store as mlflow_store


def test_data_sets_are_recorded_with_digest_context_schema_and_size(new_recorder, data_inputs):
    r = new_recorder()
    r.log_inputs(data_inputs)
    r.log_inputs(data_inputs)  # a resumed run logs them again: still two
    r.end(mlflow_store.FINISHED)
    got = r.client.get_run(r.run_id).inputs.dataset_inputs
    by_name = {d.dataset.name: d for d in got}
    assert set(by_name) == {"toy-train", "toy-val"}
    train = by_name["toy-train"]
    assert train.dataset.digest == "aaaa" and train.dataset.source_type == "code"
    assert [t.value for t in train.tags] == [mlflow_store.TRAINING]
    assert [t.value for t in by_name["toy-val"].tags] == [mlflow_store.VALIDATION]
    assert json.loads(train.dataset.profile)["num_rows"] == 12
    features = json.loads(json.loads(train.dataset.schema)["mlflow_tensorspec"]["features"])
    assert features[0]["tensor-spec"] == {"dtype": "float32", "shape": [-1, 1, 8, 8]}


def test_jobs_logging_the_same_data_set_at_once_both_record_it(
    new_recorder, data_inputs, monkeypatch
):
    # The race of a sweep's concurrent jobs, made to happen every time: another job inserts the
    # data set after this one looked for it and before it inserts it.
    first, other = new_recorder(), new_recorder()
    add_all, raced = Session.add_all, []

    def add_all_after_the_other_job(session, objects):
        if not raced:
            raced.append(True)
            other.log_inputs(data_inputs)
        return add_all(session, objects)

    monkeypatch.setattr(Session, "add_all", add_all_after_the_other_job)
    first.log_inputs(data_inputs)
    assert raced
    for r in (first, other):
        got = r.client.get_run(r.run_id).inputs.dataset_inputs
        assert sorted((d.dataset.name, d.dataset.digest) for d in got) == [
            ("toy-train", "aaaa"), ("toy-val", "bbbb")]  # fmt: skip
        r.end(mlflow_store.FINISHED)
