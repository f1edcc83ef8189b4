"""A sweep beside a busy machine, through the CLI: its jobs run seed-major, each run logs
the cores it and the other processes used while its steps were timed, and the report flags
the contended timings and leaves them out of its speed verdicts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import all_runs

from ampsweep.measure import contention
from ampsweep.tracking import store as mlflow_store

pytestmark = pytest.mark.slow

# 200 steps: the kernel counts CPU time in ticks of 10 ms, so the timed span must be long
# against them: 16 steps were 35 ms on a fast CPU, and read 84.98% busy against the 85% rule.
SWEEP = ["precision=fp32,bf16", "sweep.repeats=2", "model=cnn", "trainer.epochs=10",
         "trainer.max_steps=200", "trainer.batch_size=64", "trainer.log_every=20",
         "trainer.timing_warmup_steps=2", "trainer.progress=false",
         "diagnostics.every=0"]  # fmt: skip
# A busy loop at the lowest priority: it takes every core the other processes leave idle (the
# machine is full, and others hold a share of it, as the report's rule asks), without slowing
# the tests that run beside this one.
SPIN = "import os, time\nos.nice(19)\nend = time.time() + 300\nwhile time.time() < end: pass"


def test_a_sweep_beside_a_busy_loop_is_flagged_contended_and_runs_seed_major(store, main):
    cores = contention.available_cores()
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(cores)]
    try:
        res = main("train", "-m", *SWEEP, f"tracking.uri={store}")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert res.code == 0, res.err
    kids = [r for r in all_runs(store) if mlflow_store.PARENT in r.data.tags]
    by_job = sorted(kids, key=lambda r: int(r.data.tags["job_num"]))
    order = [(r.data.params["precision.name"], r.data.params["trainer.seed"]) for r in by_job]
    assert order == [("fp32", "0"), ("bf16", "0"), ("fp32", "1"), ("bf16", "1")]
    for r in kids:
        m = r.data.metrics
        assert m[contention.CORES] == cores
        # the spinners took their share of every core the run could use
        assert m[contention.CORES_OTHERS] >= contention.OTHERS_SHARE * cores, m
        assert contention.contended(
            m[contention.CORES_USED], m[contention.CORES_OTHERS], m[contention.CORES]
        )
    out = res.out
    assert "Timing contended, other processes competing for the CPU" in out
    assert "Their speed is left out of the speed verdicts" in out
    assert "Speed (" not in out and "Speed, paired by seed" not in out  # no verdict on it
    table = out[out.index("\nSweep ") :].split("Findings")[0]
    assert "2/2 contended" in table
