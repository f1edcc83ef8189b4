"""``ampsweep reproduce`` reads like a verdict: its header names every override applied, its
comparison opens with identical or the metrics that differ and by how much, and keeps what
the machine measured (system/, mem/, perf/) apart from the metrics that decide."""

from __future__ import annotations

from ampsweep.tracking import store

DETERMINISTIC = [
    "model=mlp", "model.width=8", "trainer.epochs=1", "trainer.max_steps=6",
    "trainer.log_every=2", "trainer.progress=false", "trainer.deterministic=true",
    "trainer.timing_warmup_steps=1", "precision=fp32",
]  # fmt: skip


def test_reproduce_says_identical_or_which_metric_differs(store_uri, main):
    assert main("train", *DETERMINISTIC, f"tracking.uri={store_uri}").code == 0
    (orig,) = store.client_for(store_uri).search_runs(["1"])
    rid = orig.info.run_id

    same = main("reproduce", rid, "trainer.log_every=2", f"tracking.uri={store_uri}")
    assert same.code == 0, same.err
    lines = same.out.splitlines()
    (header,) = [line for line in lines if line.startswith("reproducing run")]
    assert header.endswith(f"; applied here: trainer.log_every=2 tracking.uri={store_uri}")
    verdict = next(line for line in lines if line.startswith(("identical", "differs")))
    assert verdict.startswith("identical: all ") and verdict.endswith(
        "metrics that decide are equal"
    )
    assert "what the machine measured" in same.out
    machine = same.out.split("what the machine measured")[1]
    assert "perf/samples_per_s" in machine and "val/acc" not in machine

    other = main("reproduce", rid, "optimizer.lr=0.5", f"tracking.uri={store_uri}")
    assert other.code == 0, other.err
    verdict = next(line for line in other.out.splitlines() if line.startswith("differs"))
    assert "metrics that decide: " in verdict and "val/loss " in verdict
