"""``ampsweep capacity`` on a CPU: the step's memory of every kind of mode predicted at another
batch, with the largest batch each fits in the budget, checked against a real training run at
that batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import all_runs

from ampsweep.measure import capacity as cap
from ampsweep.tracking.store import client_for


def predicted(uri: str) -> dict[str, dict]:
    """The capacity run's memory_by_mode.json, by the mode each prediction was made for."""
    client = client_for(uri)
    (run,) = [r for r in all_runs(uri) if r.data.tags.get("ampsweep.capacity") == "true"]
    path = client.download_artifacts(run.info.run_id, "memory_by_mode.json", str(Path.cwd()))
    return {p["modes"][0]: p for p in json.loads(Path(path).read_text())["predicted"]}


def test_the_prediction_of_another_batch_meets_a_run_at_that_batch(main, quick, store_uri):
    common = [*quick, "model=mlp", "precision=bf16", f"tracking.uri={store_uri}"]
    out = main("capacity", "--budget", "1GiB", "--predict-batch", "64", *common)
    assert out.code == 0, out.err
    assert "a training step's memory at batch 64 in MiB, measured in bf16 at batch" in out.out
    assert "max batch in 1 GiB" in out.out
    by_mode = predicted(store_uri)
    assert set(by_mode) == {"fp32", "bf16", "bf16_pure", "fp8_tensorwise"}
    bf16, fp32, pure = by_mode["bf16"], by_mode["fp32"], by_mode["bf16_pure"]
    assert bf16["batch"] == 64
    # fp32 keeps no autocast cache and stores its activations in 4 bytes, not 2
    assert fp32["parts_mib"]["autocast_cache"] == 0.0
    assert fp32["parts_mib"]["activations"] == pytest.approx(2 * bf16["parts_mib"]["activations"])
    assert pure["parts_mib"]["params"] == pytest.approx(bf16["parts_mib"]["params"] / 2)
    assert fp32["max_batch"] < bf16["max_batch"]

    # The run at that batch: what it saved for backward in its first step (the activations
    # and autocast's weight copies), measured by the loop, not by the capacity prediction.
    # Within 10%: saved bytes are linear in the batch for an MLP.
    assert main("train", *common, "trainer.batch_size=64").code == 0
    (run,) = [r for r in all_runs(store_uri) if r.data.tags.get("ampsweep.capacity") != "true"]
    saved = bf16["parts_mib"]["activations"] + bf16["parts_mib"]["autocast_cache"]
    assert saved == pytest.approx(run.data.metrics[cap.SAVED], rel=0.10)
    # parameters and optimizer state do not grow with the batch
    for part in ("params", "optimizer"):
        assert bf16["parts_mib"][part] == pytest.approx(run.data.metrics[f"mem/{part}_mib"])


def test_a_batch_to_predict_below_one_is_refused_in_one_line(main):
    out = main("capacity", "--budget", "1GiB", "--predict-batch", "0", "model=mlp")
    assert out.code == 2
    assert "--predict-batch 0 must be >= 1, e.g. --predict-batch 64" in out.err
    assert "Traceback" not in out.err


@pytest.mark.parametrize("flag", ["--budget", "--memory-budget", "--budget=", "--mem"])
def test_a_bad_budget_is_refused_under_the_name_the_user_typed(flag, main):
    args = [flag + "lots"] if flag.endswith("=") else [flag, "lots"]
    out = main("capacity", *args, "model=mlp")
    assert out.code == 2
    named = "--memory-budget" if flag == "--mem" else flag.rstrip("=")  # argparse's full name
    (line,) = out.err.splitlines()
    assert line.startswith(f"error: {named} lots: not a memory size: write a number and a unit")
