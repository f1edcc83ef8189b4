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
from callbacks import signal_at_step
from conftest import EXACT, REPO, all_runs, callback_env, run_cli

from ampsweep.measure import step_peak
from ampsweep.tracking import store

# Runs the named scenario of this file's SCENARIOS on every rank and saves what it returns.
WORKER = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, sys.argv[3])
    from e2e import test_fsdp as scenarios
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
    # weights that FSDP all-gathers in fp8 (torchao's tensor subclass inside the DTensor)
    fp8_gathered = sum(type(sharded.local(p)).__name__ == "WeightWithDynamicFloat8CastTensor"
                       for p in setup.model.parameters())  # fmt: skip
    return {"losses": [x for x in losses if x is not None], "summary": summary,
            "weights": {k: v.clone() for k, v in weights.items()},
            "sharded": sharded.is_sharded(setup.model), "fp8_gathered": fp8_gathered}  # fmt: skip


def fsdp_against_ddp() -> dict:
    """fp32 under DDP and FSDP on the CNN and the GPT; bf16 parameters under FSDP with fp32 and
    with bf16 reduction; fp16 with its GradScaler under FSDP; fp8 gathers (emulated)."""
    out = {}
    for name, base in (("cnn", CNN), ("gpt", GPT)):
        for strategy in ("ddp", "fsdp"):
            out[f"{name}-{strategy}"] = _train([*base, "precision=fp32",
                                                f"trainer.strategy={strategy}"])  # fmt: skip
    for reduce in ("fp32", "bf16"):
        out[f"gpt-bf16-{reduce}"] = _train([*GPT, "precision=bf16", "trainer.strategy=fsdp",
                                            f"precision.fsdp.reduce_dtype={reduce}"])  # fmt: skip
    out["cnn-fp16"] = _train([*CNN, "precision=fp16", "trainer.strategy=fsdp"])
    out["gpt-fp8"] = _train([*GPT, "precision=fp8_tensorwise", "precision.fp8.emulate=true",
                             "trainer.strategy=fsdp"])  # fmt: skip
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
    # fp8 under FSDP: its Linear weights are all-gathered in fp8 (torchao's tensorwise
    # recipe, emulated on a CPU) and it trains
    fp8 = r0["gpt-fp8"]
    assert fp8["fp8_gathered"] > 0 and all(math.isfinite(x) for x in fp8["losses"])
    assert fp8["losses"][-1] < fp8["losses"][0]
    fp16 = r0["cnn-fp16"]
    assert fp16["summary"]["amp/loss_scale"] > 0 and all(math.isfinite(x) for x in fp16["losses"])
    # What a rank holds under FSDP: half the parameters of the whole model (two ranks), and
    # the parameters it gathers apart; its step's peak in parts, as every run's
    whole, per_rank = r0["cnn-ddp"]["summary"], r0["cnn-fsdp"]["summary"]
    half = whole["mem/params_mib"] / 2  # DDP: every rank holds all of them
    assert per_rank["mem/params_sharded_mib"] == pytest.approx(half, rel=0.05)
    assert per_rank["mem/params_gathered_mib"] > 0
    for summary in (whole, per_rank):
        parts = [summary[f"mem/{part}_mib"] for part in (*step_peak.PARTS, "other")]
        assert sum(parts) == pytest.approx(summary["mem/step_peak_mib"], rel=1e-9)


def _end_weights(folder) -> dict:
    """The model weights of the end checkpoint under ``folder`` (read from its DCP shards)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (end,) = folder.glob("*/*/step-*-end.dcp")
    dcp_to_torch_save(end, folder / "end.pt")
    return torch.load(folder / "end.pt", weights_only=False)["model"]


@pytest.mark.slow
# torch.distributed.checkpoint says so when a checkpoint is read or written in one process
# (the one-process resume and _end_weights, in this process): that is the intent here.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_a_killed_fsdp_run_resumes_to_the_same_weights_on_two_ranks_and_on_one(
    tmp_path, store_uri, main
):
    """Through the CLI: an FSDP run writes sharded checkpoints and logs the whole model;
    ``reproduce`` of it, killed after step 6 (rank 1 SIGKILLed), resumes on two ranks from its
    step-4 checkpoint to the very weights of the first run, in a run tagged as its reproduction
    that reaches its numbers; the first run's step-8 checkpoint resumes in one process with the
    same global batch (1 x 32 = 2 x 16); a DDP resume is refused."""
    base = [*EXACT, "optimizer=adamw", "trainer.batch_size=16", "trainer.strategy=fsdp",
            "trainer.checkpoint_every=4", "trainer.keep_checkpoints=10",
            f"tracking.uri={store_uri}"]  # fmt: skip
    env = callback_env({"OMP_NUM_THREADS": "1"})
    full = run_cli(["train", *base, "trainer.nproc=2", f"trainer.checkpoint_dir={tmp_path / 'a'}"],
                   tmp_path, env=env)  # fmt: skip
    assert full.returncode == 0, full.stderr[-3000:]
    (run,) = all_runs(store_uri)
    assert run.info.status == store.FINISHED
    params, metrics = run.data.params, run.data.metrics
    assert params["trainer.strategy"] == "fsdp" and params["world_size"] == "2"
    assert params["precision.fsdp.param_dtype"] == params["precision.fsdp.reduce_dtype"] == "fp32"
    assert metrics["mem/params_gathered_mib"] > 0 and metrics["mem/params_sharded_mib"] > 0
    assert metrics["mem/step_peak_mib"] >= metrics["mem/params_sharded_mib"]
    logged = mlflow_pytorch_load(store_uri, run.info.run_id)
    whole = _end_weights(tmp_path / "a")
    assert logged.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(logged[key], value), key  # the gathered model is the trained one
    # reproduce runs the recorded FSDP config again on two ranks, in a run tagged as its
    # reproduction (the tag travels to rank 0, which records it); killed after step 6 (rank 1
    # SIGKILLed), it resumes from its step-4 checkpoint to the very weights of the first run
    base.append("tracking.log_model=false")  # logged and checked once is enough
    b = f"trainer.checkpoint_dir={tmp_path / 'b'}"
    killed = run_cli(["reproduce", run.info.run_id, f"tracking.uri={store_uri}",
                      "tracking.log_model=false", b, signal_at_step(6, "SIGKILL", rank=1)],
                     tmp_path, env=env)  # fmt: skip
    assert killed.returncode != 0
    (step4,) = (tmp_path / "b").glob("*/*/step-00000004.pt")
    assert (step4.parent / "step-00000004.dcp" / ".metadata").is_file()
    resumed = run_cli(["train", *base, "trainer.nproc=2", f"trainer.resume={step4}", b],
                      tmp_path, env=env)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _end_weights(tmp_path / "b")
    for key, value in whole.items():
        assert torch.equal(again[key], value), key  # bit for bit
    (copy,) = [r for r in all_runs(store_uri) if r.data.tags.get("reproduces") == run.info.run_id]
    assert copy.info.status == store.FINISHED and copy.data.params["world_size"] == "2"
    assert copy.data.params["trainer.strategy"] == "fsdp"
    assert copy.data.metrics["val/loss"] == pytest.approx(metrics["val/loss"], rel=1e-6)

    (step8,) = (tmp_path / "a").glob("*/*/step-00000008.pt")
    store.client_for(store_uri).set_terminated(run.info.run_id, store.KILLED)
    # one process: in this one (no rank is started, so the process boundary adds nothing)
    one = main("train", *base, "trainer.batch_size=32", f"trainer.resume={step8}",
               f"trainer.checkpoint_dir={tmp_path / 'c'}")  # fmt: skip
    assert one.code == 0, one.err[-3000:]
    assert "runs unsharded" in " ".join(one.out.split())
    on_one = _end_weights(tmp_path / "c")
    for key, value in whole.items():  # one mean over 32 against two over 16: float order only
        torch.testing.assert_close(on_one[key], value, rtol=1e-5, atol=1e-6)

    ddp = main("train", *base, "trainer.strategy=ddp", "trainer.batch_size=32",
               f"trainer.resume={step8}")  # fmt: skip
    assert ddp.code == 2
    line = ddp.err.strip().splitlines()[-1]
    assert "written by a trainer.strategy=fsdp run" in line and "Traceback" not in ddp.err


def mlflow_pytorch_load(uri: str, run_id: str) -> dict:
    import mlflow

    mlflow.set_tracking_uri(uri)  # runs:/ URIs resolve through it (conftest resets it after)
    return mlflow.pytorch.load_model(f"runs:/{run_id}/{store.MODEL_NAME}").state_dict()


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_of_an_fsdp_run_at_one_checkpoint(
    tmp_path, store_uri
):
    """SIGTERM reaches rank 1 alone after step 3: both ranks stop at the same step boundary and
    write one whole sharded checkpoint together (rather than one waiting in a collective the
    other never joins), and the run ends KILLED."""
    args = ["train", *EXACT, "trainer.batch_size=16", "trainer.strategy=fsdp", "trainer.nproc=2",
            "trainer.max_steps=400", "trainer.epochs=100", "tracking.log_model=false",
            f"trainer.checkpoint_dir={tmp_path / 'ckpt'}", f"tracking.uri={store_uri}",
            signal_at_step(3, "SIGTERM", rank=1)]  # fmt: skip
    proc = run_cli(args, tmp_path, env=callback_env({"OMP_NUM_THREADS": "1"}), timeout=240)
    assert proc.returncode != 0
    (saved,) = (tmp_path / "ckpt").glob("*/*/step-*.pt")
    step = torch.load(saved, weights_only=True)["state"]["step"]
    assert 3 <= step < 10, step
    shards = saved.with_suffix(".dcp")
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    (run,) = all_runs(store_uri)
    assert run.info.status == store.KILLED
