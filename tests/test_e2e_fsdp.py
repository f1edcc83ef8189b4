"""Data parallelism across two Gloo processes on CPU, beyond plain DDP: DDP that synchronises
once per optimizer step under gradient accumulation, and FSDP2 (``trainer.strategy=fsdp``)
that trains as DDP does, with its mixed-precision policy, sharded checkpoints and per-rank
memory.

Every multi-process test starts torchrun once and does all it can in that one group (each
start costs seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import EXACT, REPO

# Runs the named scenario of this file's SCENARIOS on every rank and saves what it returns.
WORKER = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[3])
    import test_e2e_fsdp as scenarios
    from ampsweep.engine import distributed
    name, out = sys.argv[1], sys.argv[2]
    rank = distributed.from_env()
    distributed.init(rank, "cpu")
    result = getattr(scenarios, name)()
    torch.save(result, f"{out}/rank{rank.rank}.pt")
    distributed.shutdown(wait_for_all=True)
    """
)


def run_ranks(tmp_path, scenario: str, nproc: int = 2) -> list:
    """Run ``scenario`` (a function of this module) on ``nproc`` ranks; what each returned."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), scenario, str(tmp_path),
           str(REPO / "tests")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


# ---------------------------------------------------------------- scenarios (run on each rank)


class RecordGrads:
    """A callback keeping the (unscaled) gradients of the first optimizer step."""

    def __init__(self):
        self.grads = {}

    def before_update(self, view) -> None:
        if view.step == 1:
            self.grads = {n: p.grad.detach().clone() for n, p in view.module.named_parameters()}

    def after_step(self, state) -> None: ...


def ddp_accumulation() -> dict:
    """grad_accum_steps=4 under DDP, counting the all-reduces with a communication hook: as
    the loop runs it (no_sync before the last micro-batch), then synchronising on every
    micro-batch (gradient_sync made a no-op), the way the loop used to run."""
    import contextlib

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ampsweep.config import compose as config
    from ampsweep.engine import build, distributed, loop

    def train():
        args = ["trainer.batch_size=8", "trainer.grad_accum_steps=4", "trainer.max_steps=3"]
        setup = build.build(config.load([*EXACT, "tracking=none", *args]))
        buckets = []

        def counting(state, bucket):
            buckets.append(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)

        setup.model.register_comm_hook(None, counting)
        grads = RecordGrads()
        summary = loop.fit(setup, lambda m, s: None, callbacks=[grads])
        weights = {k: v.clone() for k, v in distributed.unwrap(setup.model).state_dict().items()}
        return {"buckets": buckets, "grads": grads.grads, "weights": weights,
                "steps": summary["train/steps"]}  # fmt: skip

    once = train()
    real = distributed.gradient_sync
    distributed.gradient_sync = lambda model, sync: contextlib.nullcontext()
    try:
        every = train()
    finally:
        distributed.gradient_sync = real
    return {"once": once, "every": every}


# ---------------------------------------------------------------- tests


@pytest.mark.slow
def test_ddp_all_reduces_once_per_optimizer_step_under_accumulation(tmp_path):
    for result in run_ranks(tmp_path, "ddp_accumulation"):
        once, every = result["once"], result["every"]
        assert once["steps"] == every["steps"] == 3
        n_buckets = len(set(once["buckets"]))
        assert n_buckets >= 1
        assert len(once["buckets"]) == 3 * n_buckets  # one all-reduce per step and bucket
        assert len(every["buckets"]) == 4 * 3 * n_buckets  # the old way: every micro-batch
        # The same gradients: summed locally then averaged, or averaged then summed (only the
        # order of float additions differs).
        assert once["grads"].keys() == every["grads"].keys() and once["grads"]
        for name, grad in once["grads"].items():
            torch.testing.assert_close(grad, every["grads"][name], rtol=1e-5, atol=1e-7)
        for name, w in once["weights"].items():
            torch.testing.assert_close(w, every["weights"][name], rtol=1e-5, atol=1e-6)
