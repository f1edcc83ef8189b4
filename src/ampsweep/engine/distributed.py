"""DistributedDataParallel: who this process is, its process group, and the launcher.

One training across N processes is one MLflow run. Every rank runs the same command (the same
composed config, the same seed); they differ only in ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``,
which torchrun (or ``ampsweep train trainer.nproc=N``, which starts torchrun's elastic agent) or
a submitit/SLURM task array sets. Rank 0 alone writes Hydra's outputs, MLflow and checkpoints;
the other ranks train, take part in the collectives, and record nothing.

``trainer.batch_size`` is per process: a step's global batch is ``batch_size * world_size``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from dataclasses import dataclass

# torch is imported in the functions below, not here: runner.job imports this module, and
# `ampsweep train --help` or `--cfg job` (which train nothing) then answer without importing
# torch, the largest import of all.


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env(environ=None) -> Rank:
    """This process's place in the group, from the variables torchrun sets (or a single
    process when they are absent)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return Rank()
    return Rank(int(env.get("RANK", 0)), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))


def current() -> Rank:
    """The group this process already belongs to (after ``init``), else from the env."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Rank(dist.get_rank(), dist.get_world_size(), from_env().local_rank)
    return from_env()


def export_submitit_env() -> None:
    """Inside a submitit task array (hydra/launcher=submitit_* with tasks_per_node > 1), set
    the torchrun variables from the job environment so each task is one rank."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if cpus.isdigit() and "OMP_NUM_THREADS" not in os.environ:
        # A task uses the CPUs SLURM gave it (hydra.launcher.cpus_per_task), as torchrun
        # limits its workers: without binding, torch would take every core of the node.
        os.environ["OMP_NUM_THREADS"] = cpus
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(cpus))
    if "WORLD_SIZE" in os.environ:
        return
    try:
        from submitit.helpers import TorchDistributedEnvironment

        env = TorchDistributedEnvironment()
    except Exception:  # not a submitit job after all
        return
    if env.world_size > 1:
        # submitit pins one GPU per task only when asked; leave CUDA_VISIBLE_DEVICES alone so
        # LOCAL_RANK picks the device, as under torchrun.
        env.export(set_cuda_visible_devices=False)


def init(rank: Rank, device_type: str) -> None:
    """Join the process group: NCCL between GPUs, Gloo on CPU."""
    import torch
    import torch.distributed as dist

    if not rank.enabled or dist.is_initialized():
        return
    if device_type == "cuda":
        torch.cuda.set_device(rank.local_rank)  # before any CUDA work: one GPU per process
    dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")


def shutdown(wait_for_all: bool) -> None:
    """Leave the process group. After a good run every rank waits for the others first (rank 0
    is still recording): tearing Gloo down under a peer that is still connected can abort it.
    After a failure there is no waiting: the peers may be stuck in a collective, and the
    launcher ends them when this process exits non-zero."""
    if "torch" not in sys.modules:  # a job that failed before importing torch
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait_for_all:
            dist.barrier()
        dist.destroy_process_group()


def wrap(model, device):
    """DDP around the model when this process is part of a group (else the model itself)."""
    import torch

    if not current().enabled:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


NO_CONTEXT = contextlib.nullcontext()  # stateless: one instance serves every `with`


def gradient_sync(model, sync: bool):
    """A context for one micro-batch's forward and backward: ``sync=False`` keeps DDP from
    all-reducing its gradients (``no_sync``: they accumulate locally until a micro-batch with
    ``sync=True``). Nothing changes for a model without DDP (one process, or FSDP, whose
    reduce-scatter on every micro-batch is what keeps the gradients sharded)."""
    if sync:  # every micro-batch of a run without accumulation: decided first, cheaply
        return NO_CONTEXT
    ddp = uncompiled(model)  # DDP under torch.compile's wrapper
    if not isinstance(ddp, _ddp_class()):
        return NO_CONTEXT
    return ddp.no_sync()  # DDP decides in forward whether backward syncs: wrap both


def _ddp_class():
    import torch

    return torch.nn.parallel.DistributedDataParallel


def unwrap(model):
    """The plain module under torch.compile and DDP (for evaluation and checkpoints)."""
    model = uncompiled(model)
    if hasattr(model, "no_sync") and hasattr(model, "module"):
        model = model.module
    return uncompiled(model)


def uncompiled(model):
    """The module under torch.compile's wrapper (the model itself when not compiled).
    Private: the wrapper keeps it in ``_orig_mod``, with no public accessor (checked on torch
    2.14.1; tests/unit/engine/test_distributed.py fails if it moves)."""
    return getattr(model, "_orig_mod", model)


def all_reduce(tensor, op: str = "sum"):
    """Reduce a tensor over the group in place (a no-op in a single process)."""
    import torch.distributed as dist

    if current().enabled:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        dist.all_reduce(tensor, op=ops[op])
    return tensor


def reduce_floats(values: dict[str, float], op: str, device) -> dict[str, float]:
    """Reduce a dict of floats over the group with one collective."""
    import torch

    if not current().enabled or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    all_reduce(t, op)
    return dict(zip(keys, t.tolist(), strict=True))


# ---------------------------------------------------------------- launching


class LaunchError(RuntimeError):
    """The elastic agent itself failed (rendezvous, ports): one line for the user."""


@dataclass(frozen=True)
class RankFailure:
    """The rank whose failure ended a launch, and its exit code (the agent then stops the
    other ranks: their exits, by SIGTERM, say nothing of what went wrong)."""

    rank: int
    exit_code: int


# Exit codes of a rank the agent stopped: by a signal (negative), or its Ctrl-C/SIGTERM exit.
STOPPED_CODES = (130, 143)


def rank_overrides(rank: Rank) -> list[str]:
    """Hydra overrides for a rank other than 0: no output folder, no .hydra/ files of its own
    (rank 0 writes the run dir; Hydra would otherwise create one per process)."""
    if rank.is_main:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null"]


def launch(args: list[str], nproc: int) -> RankFailure | None:
    """Run ``python -m ampsweep train ARGS`` in ``nproc`` processes under torchrun's elastic
    agent (standalone rendezvous on this machine); the rank that failed first, if one did.

    The agent runs in this process through ``torch.distributed.launcher.api.elastic_launch``
    (the engine behind ``torchrun``), so ``trainer.nproc=N`` and ``torchrun --nproc-per-node N
    -m ampsweep train`` run the very same worker command; each worker sees RANK/WORLD_SIZE and
    does not launch again.
    """
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every rendezvous step, and each failed worker at ERROR: the workers say
    # what went wrong themselves, and the exit code carries it.
    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"ampsweep-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # what torchrun --standalone uses: a free local port
        max_restarts=0,
        monitor_interval=0.5,
        logs_specs=DefaultLogsSpecs(),  # workers write to this console, as under torchrun
    )
    entry = elastic_launch(config, sys.executable)
    try:
        entry("-m", "ampsweep", "train", *args)
    except ChildFailedError as err:
        return first_failure(err.failures)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # the agent itself failed (rendezvous, ports)
        raise LaunchError(f"trainer.nproc={nproc}: the elastic launcher failed: {err}") from None
    return None


def first_failure(failures: dict) -> RankFailure:
    """The failure that ended the launch, from the agent's ``{global rank: ProcessFailure}``:
    the agent records the ranks that failed on their own first (in the order it found them),
    then the ones it stopped; a rank's own exit beats a stop, whatever the timing."""
    ranks = list(failures.items())
    own = [(r, f) for r, f in ranks if f.exitcode > 0 and f.exitcode not in STOPPED_CODES]
    rank, failure = (own or ranks)[0]
    return RankFailure(int(rank), int(failure.exitcode) if failure.exitcode > 0 else 1)
