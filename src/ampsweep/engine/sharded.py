"""FSDP2 (``trainer.strategy=fsdp``): each rank holds a shard of every parameter, gradient and
optimizer state, gathers a unit's parameters just before the unit runs and reduce-scatters
its gradients just after.

The units are the model's blocks (``units``): ``trainer.fsdp.shard`` patterns, else the blocks
a Hugging Face model declares (``_no_split_modules``), else the elements of its
``nn.ModuleList`` s (the GPT's transformer blocks), else each top-level child with parameters;
``fully_shard`` wraps each, then the root (which takes what is left: embeddings, the head).
The precision policy decides FSDP's ``MixedPrecisionPolicy``: the dtype the parameters are
gathered in and the dtype gradients are reduced in (``precision.fsdp.*``, defaults from the
mode table); autocast still runs as in every mode.

Checkpoints of a sharded run are written with ``torch.distributed.checkpoint`` (DCP): every
rank writes its shards of the model and optimizer into ``step-N.dcp/``, and rank 0 writes the
usual ``step-N.pt`` beside it with everything else (schedule, scaler, RNG, the data position),
naming the folder. DCP re-shards on load, so a checkpoint resumes on any number of ranks
(one process loads it into the unsharded model).
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ampsweep.config.schema import Config, ConfigError, Strategy
from ampsweep.engine.distributed import uncompiled
from ampsweep.measure.memory import dtype_name, model_memory
from ampsweep.precision.modes import Dtype, FsdpPrecisionConfig, PrecisionConfig, PrecisionMode
from ampsweep.precision.policy import TORCH_DTYPES

DCP_SUFFIX = ".dcp"


# The norm layers that may keep running statistics (torch's public classes; their lazy forms
# become these at their first forward).
RUNNING_STATS_NORMS = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)  # fmt: skip


def wanted(cfg: Config) -> bool:
    return cfg.trainer.strategy == Strategy.fsdp


def is_sharded(model: nn.Module) -> bool:

    return isinstance(uncompiled(model), FSDPModule)


# ---------------------------------------------------------------- what is sharded


def units(model: nn.Module, patterns: list[str]) -> list[str]:
    """The names of the modules each sharded as one FSDP unit (the root is sharded last)."""
    named = [(n, m) for n, m in model.named_modules() if n]
    if patterns:
        unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n, _ in named)]
        if unmatched:
            raise ConfigError(unmatched_message(unmatched, [n for n, _ in named]))
        chosen = [n for n, _ in named if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        return _outermost(chosen)
    # Hugging Face models name their block classes (``_no_split_modules``: private by its
    # name, but the attribute Transformers itself shards by, with no public accessor; checked
    # on transformers 5.24.0, tests/unit/engine/test_sharded.py fails if it moves); then any
    # ModuleList's elements.
    blocks = {c for m in model.modules() for c in getattr(m, "_no_split_modules", None) or ()}
    found = [n for n, m in named if type(m).__name__ in blocks]
    if not found:
        lists = [(n, m) for n, m in named if isinstance(m, nn.ModuleList)]
        found = [f"{n}.{i}" for n, m in lists for i in range(len(m))]
    if not found:
        found = [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    return _outermost(found)


def _outermost(names: list[str]) -> list[str]:
    """Drop the names inside another chosen module: a unit's parameters belong to it once."""
    return [n for n in names if not any(n.startswith(f"{o}.") for o in names if o != n)]


def unmatched_message(patterns: list[str], names: list[str]) -> str:
    parts = []
    for pattern in patterns:
        close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
        parts.append(pattern + (f" (closest: {', '.join(close)})" if close else ""))
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return (
        f"trainer.fsdp.shard: no module of the model is called {'; '.join(parts)}: use names "
        f"from model.named_modules() ({shown}), or glob patterns such as 'blocks.*'"
    )


# ---------------------------------------------------------------- sharding


def check(cfg: Config, policy, device: torch.device) -> None:
    """Refuse, in one line, what FSDP cannot run here."""
    mode = policy.mode
    if mode.fp8 and mode.fp8 != "tensorwise":
        raise ConfigError(
            f"precision={mode.name} cannot run with trainer.strategy=fsdp: torchao's float8 "
            "all-gather under FSDP takes the tensorwise recipe only: use "
            "precision=fp8_tensorwise, or trainer.strategy=ddp for the rowwise recipe"
        )
    if cfg.diagnostics.numerics or cfg.diagnostics.every:
        raise ConfigError(
            "diagnostics.numerics / diagnostics.every cannot run with trainer.strategy=fsdp: "
            "they read whole gradients and activations of one rank, and FSDP holds only "
            "shards: run the diagnostics with trainer.strategy=ddp or on one process"
        )


def resolved_precision(pc: PrecisionConfig, mode: PrecisionMode) -> PrecisionConfig:
    """The precision section with FSDP's dtypes filled in from the mode where not given."""
    f = pc.fsdp
    return replace(
        pc,
        fsdp=FsdpPrecisionConfig(
            param_dtype=f.param_dtype or Dtype[mode.fsdp_param_dtype],
            reduce_dtype=f.reduce_dtype or Dtype[mode.fsdp_reduce_dtype],
        ),
    )


def mixed_precision(pc: PrecisionConfig):
    """FSDP's policy from the resolved precision section (``resolved_precision``)."""
    param_dtype, reduce_dtype = _dtypes(pc)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _dtypes(pc: PrecisionConfig) -> tuple[torch.dtype, torch.dtype]:
    """FSDP's parameter and reduction dtypes of a resolved precision section."""
    f = pc.fsdp
    assert f.param_dtype is not None and f.reduce_dtype is not None  # resolved_precision's
    return TORCH_DTYPES[f.param_dtype.name], TORCH_DTYPES[f.reduce_dtype.name]


def shard(model: nn.Module, cfg: Config) -> nn.Module:
    """``fully_shard`` each unit, then the root (in place: the model becomes an FSDPModule
    whose parameters are DTensor shards)."""

    options = dict(
        mp_policy=mixed_precision(cfg.precision),
        reshard_after_forward=cfg.trainer.fsdp.reshard_after_forward,
    )
    # BatchNorm keeps its fp32 running statistics, and its kernel refuses half parameters
    # beside them: each such layer is a unit of its own whose parameters stay fp32 (the
    # kernel takes half inputs with fp32 parameters).
    fp32 = dict(options, mp_policy=replace(options["mp_policy"], param_dtype=None))
    norms = [m for m in model.modules() if isinstance(m, RUNNING_STATS_NORMS)]
    for norm in norms:
        fully_shard(norm, **fp32)
    for name in units(model, list(cfg.trainer.fsdp.shard)):
        if model.get_submodule(name) not in norms:  # a top-level BatchNorm: done above
            fully_shard(model.get_submodule(name), **options)
    fully_shard(model, **options)
    return model


class Float8Scales:
    """After each optimizer step, every fp8 weight's scale for its next all-gather, computed
    for all of them in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``)
    instead of one per weight inside each all-gather. A loop callback (engine.loop.Callback's
    two methods; that module imports this one, so it is not subclassed)."""

    def __init__(self, model: nn.Module):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        self.model, self.precompute = model, precompute_float8_dynamic_scale_for_fsdp

    def before_update(self, view) -> None:
        pass

    def after_step(self, state) -> None:
        self.precompute(self.model)


def template(model: nn.Module) -> nn.Module:
    """An unsharded copy of ``model``'s structure on the meta device (no memory): what the
    gathered full weights are loaded into for the logged model and the end-of-run FLOPs."""
    return copy.deepcopy(model).to("meta")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard; any other tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def gathered_bytes(model: nn.Module, cfg: Config, param_dtype: torch.dtype) -> int:
    """Bytes of unsharded parameters a rank holds at once while a step runs: the largest
    unit's (they are freed after each unit's forward), or every unit's when
    ``reshard_after_forward`` is off (kept from forward to backward)."""
    size = torch.empty((), dtype=param_dtype).element_size()
    names = units(model, list(cfg.trainer.fsdp.shard))
    per_unit = [sum(p.numel() for p in model.get_submodule(n).parameters()) for n in names]
    in_units = {id(p) for n in names for p in model.get_submodule(n).parameters()}
    per_unit.append(sum(p.numel() for p in model.parameters() if id(p) not in in_units))
    total = sum(per_unit) if not cfg.trainer.fsdp.reshard_after_forward else max(per_unit)
    return total * size


def held_memory(model: nn.Module, optimizer, cfg: Config) -> dict[str, float]:
    """Bytes this rank holds, as ``measure.memory.model_memory`` counts them (its shards of the
    parameters, gradients and optimizer state), and ``params_gathered_<dtype>``: the unsharded
    parameters it holds at once while a step runs (``gathered_bytes``)."""
    held = model_memory(model, optimizer)
    dtype, _ = _dtypes(cfg.precision)
    held[f"params_gathered_{dtype_name(dtype)}"] = gathered_bytes(model, cfg, dtype)
    return held


def predicted_held(model: nn.Module, optimizer, cfg: Config) -> dict[str, float]:
    """What one of ``trainer.nproc`` ranks would hold of the unsharded ``model`` under FSDP:
    1/nproc of its parameters, gradients and optimizer state (FSDP shards every one evenly,
    up to padding), and the parameters it gathers at once (``gathered_bytes``)."""
    ranks = cfg.trainer.nproc
    held = {key: nbytes / ranks for key, nbytes in model_memory(model, optimizer).items()}
    dtype, _ = _dtypes(cfg.precision)
    held[f"params_gathered_{dtype_name(dtype)}"] = gathered_bytes(model, cfg, dtype)
    return held


def full_module(model: nn.Module, skeleton: nn.Module, main: bool) -> nn.Module | None:
    """The whole trained model, unsharded, on rank 0's CPU (``None`` on the other ranks). A
    collective: every rank calls it."""
    # torch.distributed.checkpoint here and below, not at the top: an import that every run
    # would pay (this module is built into every run), for sharded runs only.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if not main:
        return None
    plain = copy.deepcopy(skeleton).to_empty(device="cpu")
    plain.load_state_dict(state)
    return plain


# ---------------------------------------------------------------- checkpoints


def _states(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def save(folder: Path, name: str, model, optimizer, main: bool) -> None:
    """Write every rank's shards of the model and optimizer into ``folder/name`` (a DCP
    folder), atomically: written under a temporary name that rank 0 renames once every rank
    is done. A collective."""
    import torch.distributed.checkpoint as dcp

    target, tmp = folder / name, folder / f".{name}.tmp"
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed half-way
    _barrier(dist)
    dcp.save(_states(model, optimizer), checkpoint_id=tmp)
    _barrier(dist)
    if main:
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    _barrier(dist)


def load(path: Path, model, optimizer) -> None:
    """Read a DCP folder into ``model`` and ``optimizer``, re-sharding it for this group (or
    into the unsharded model of a single process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    states = _states(model, optimizer)
    dcp.load(states, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=states["model"], optim_state_dict=states["optimizer"]
    )


def _barrier(dist) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shards_of(ckpt: dict) -> Path:
    """The DCP folder a sharded checkpoint file names (beside the file it was loaded from:
    checkpoint.LOADED_FROM, which checkpoint.load adds; that module imports this one)."""
    return Path(ckpt["loaded_from"]).parent / ckpt["sharded"]


def dcp_name(target: Path) -> str:
    """The DCP folder of checkpoint file ``step-N.pt`` (or ``step-N-end.pt``): ``step-N.dcp``."""
    return target.name.removesuffix(".pt") + DCP_SUFFIX


def in_file(setup, target: Path) -> dict:
    """A sharded checkpoint file's model and optimizer entries: the name of its DCP folder
    (``Checkpointer(weights=in_file)``)."""
    return {"model": {}, "optimizer": {}, "sharded": dcp_name(target)}


class ShardedCheckpoints:
    """The checkpoints of an FSDP run, on every rank: each writes its shards (DCP, a
    collective), then rank 0's ``Checkpointer`` (made with ``weights=in_file``) writes the
    file with the rest. ``checkpointer``: rank 0's; None on the other ranks."""

    def __init__(self, folder: Path, every: int, checkpointer=None):
        self.folder, self.every, self.checkpointer = folder, every, checkpointer

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, setup, state, complete: bool = False) -> Path:
        end = "-end" if complete else ""
        target = self.folder / f"step-{state.step:08d}{end}.pt"
        main = self.checkpointer is not None
        save(self.folder, dcp_name(target), setup.model, setup.optimizer, main)
        if not main:
            return target
        written = self.checkpointer.save(setup, state, complete)
        kept = {dcp_name(p) for p in self.folder.glob("step-*.pt")}
        for old in self.folder.glob(f"step-*{DCP_SUFFIX}"):  # the files the pruning removed
            if old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)
        return written


def agreed_folder(folder: Path) -> Path:
    """Rank 0's checkpoint folder, on every rank (the others have no run id to name it)."""

    if not (dist.is_available() and dist.is_initialized()):
        return folder
    shared = [str(folder)]
    dist.broadcast_object_list(shared, src=0)
    return Path(shared[0])


def strategy_of(ckpt: dict) -> str:
    return ckpt.get("config", {}).get("trainer.strategy", Strategy.ddp.name).split(".")[-1]


def mismatch(ckpt: dict, cfg: Config, choice: str, path: Path) -> str | None:
    """A checkpoint written under the other strategy (DDP's whole weights against FSDP's
    shards): the one-line refusal, naming the strategy that wrote it."""
    saved, now = strategy_of(ckpt), cfg.trainer.strategy.name
    if saved == now:
        return None
    return (
        f"trainer.resume={choice}: {path} was written by a trainer.strategy={saved} run and "
        f"this run is trainer.strategy={now}: resume it with trainer.strategy={saved}, or drop "
        "trainer.resume to start a new run"
    )


def as_saved(ckpt: dict, cfg: Config) -> Config:
    """``cfg`` as the sharded checkpoint's run had it, where it differs only in how many
    ranks share the same global batch (trainer.nproc x trainer.batch_size): a sharded
    checkpoint resumes on any number of ranks. Anything else is left for the config check."""
    saved = ckpt.get("config", {})
    if not ckpt.get("sharded") or "trainer.nproc" not in saved:
        return cfg
    t = cfg.trainer
    nproc, batch = int(saved["trainer.nproc"]), int(saved["trainer.batch_size"])
    if nproc * batch != t.nproc * t.batch_size:
        return cfg
    return replace(cfg, trainer=replace(t, nproc=nproc, batch_size=batch))


class GroupStop:
    """A stop request every rank agrees on, asked at each step boundary: a signal one rank
    received stops them all at the same step, so the checkpoint they write together (a
    collective) is taken at one step. The flag travels over a Gloo group of its own (a CPU
    all-reduce of one number), so a GPU run adds no device synchronisation per step."""

    def __init__(self, stop):

        self.stop = stop
        self.group = dist.new_group(backend="gloo")
        self.flag = torch.zeros((), dtype=torch.int32)

    @property
    def requested(self) -> bool:

        self.flag.fill_(int(bool(self.stop.requested)))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self.flag.item())
