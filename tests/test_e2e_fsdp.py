"""Data parallelism across two Gloo processes on CPU, beyond plain DDP: DDP that synchronises
once per optimizer step under gradient accumulation, and FSDP2 (``trainer.strategy=fsdp``)
that trains as DDP does, with its mixed-precision policy, sharded checkpoints and per-rank
memory.

Every multi-process test starts torchrun once and does all it can in that one group (each
start costs seconds)."""

from __future__ import annotations

import math
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


# The CNN and a two-block GPT, small and deterministic, logging train/loss every step.
CNN = ["model=cnn", "model.width=4", "optimizer=sgd", "trainer.device=cpu",
       "trainer.deterministic=true", "trainer.epochs=1", "trainer.max_steps=6",
       "trainer.batch_size=16", "trainer.log_every=1", "trainer.timing_warmup_steps=1",
       "trainer.progress=false", "tracking=none"]  # fmt: skip
GPT = ["dataset=pysource", "dataset.max_bytes=20000", "dataset.seq_len=16", "model=gpt",
       "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
       "trainer.device=cpu", "trainer.deterministic=true", "trainer.epochs=1",
       "trainer.max_steps=6", "trainer.batch_size=8", "trainer.log_every=1",
       "trainer.timing_warmup_steps=1", "trainer.progress=false", "tracking=none"]  # fmt: skip


def _train(overrides: list[str]) -> dict:
    """Train in this group; the losses of every step, the summary, and the whole weights."""
    from ampsweep.config import compose as config
    from ampsweep.engine import build, distributed, loop, sharded

    setup = build.build(config.load(overrides))
    losses = []
    summary = loop.fit(setup, lambda m, step: losses.append(m.get("train/loss")))
    if sharded.is_sharded(setup.model):
        full = sharded.full_module(setup.model, setup.skeleton, distributed.current().is_main)
        weights = full.state_dict() if full is not None else {}
    else:
        weights = distributed.unwrap(setup.model).state_dict()
    return {"losses": [x for x in losses if x is not None], "summary": summary,
            "weights": {k: v.clone() for k, v in weights.items()},
            "sharded": sharded.is_sharded(setup.model)}  # fmt: skip


def fsdp_against_ddp() -> dict:
    """fp32 under DDP and FSDP on the CNN and the GPT; bf16 parameters under FSDP with fp32 and
    with bf16 reduction; fp16 with its GradScaler under FSDP."""
    out = {}
    for name, base in (("cnn", CNN), ("gpt", GPT)):
        for strategy in ("ddp", "fsdp"):
            out[f"{name}-{strategy}"] = _train([*base, "precision=fp32",
                                                f"trainer.strategy={strategy}"])  # fmt: skip
    for reduce in ("fp32", "bf16"):
        out[f"gpt-bf16-{reduce}"] = _train([*GPT, "precision=bf16", "trainer.strategy=fsdp",
                                            f"precision.fsdp.reduce_dtype={reduce}"])  # fmt: skip
    out["cnn-fp16"] = _train([*CNN, "precision=fp16", "trainer.strategy=fsdp"])
    return out


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


@pytest.mark.slow
def test_fsdp_trains_as_ddp_does_and_its_precision_policy_runs(tmp_path):
    r0, r1 = run_ranks(tmp_path, "fsdp_against_ddp")
    for model in ("cnn", "gpt"):
        ddp, fsdp = r0[f"{model}-ddp"], r0[f"{model}-fsdp"]
        assert fsdp["sharded"] and not ddp["sharded"]
        assert len(ddp["losses"]) == len(fsdp["losses"]) == 6
        # fp32 both ways: only the order of float additions differs (all-reduce against
        # reduce-scatter of the same gradients).
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-5), model
        assert fsdp["weights"].keys() == ddp["weights"].keys()
        for key, value in ddp["weights"].items():
            torch.testing.assert_close(fsdp["weights"][key], value, rtol=1e-4, atol=1e-6)
        assert r1[f"{model}-fsdp"]["losses"] == fsdp["losses"]  # one loss for the group
        assert fsdp["summary"]["val/loss"] == pytest.approx(ddp["summary"]["val/loss"], rel=1e-5)
    # bf16 gathers with fp32 and with bf16 reduction both train, and they differ (the policy
    # really changed the reduction).
    a, b = r0["gpt-bf16-fp32"], r0["gpt-bf16-bf16"]
    for run in (a, b):
        assert len(run["losses"]) == 6 and all(math.isfinite(x) for x in run["losses"])
        assert run["losses"][-1] < run["losses"][0]
    assert a["losses"] != b["losses"]
    assert a["losses"] != r0["gpt-fsdp"]["losses"]  # bf16 parameters are not fp32's
    fp16 = r0["cnn-fp16"]
    assert fp16["summary"]["amp/loss_scale"] > 0 and all(math.isfinite(x) for x in fp16["losses"])
    # What a rank holds under FSDP: half the parameters of the whole model (two ranks)
    whole, per_rank = r0["cnn-ddp"]["summary"], r0["cnn-fsdp"]["summary"]
    assert per_rank["mem/params_mib"] == pytest.approx(whole["mem/params_mib"] / 2, rel=0.05)
    assert per_rank["mem/gathered_mib"] > 0
