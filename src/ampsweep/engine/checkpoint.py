"""What a run keeps of its model: checkpoints, everything a run needs to continue exactly where
it stopped, and the snapshot of the trained model that is handed to MLflow (``snapshot``).

A checkpoint holds the model, optimizer, schedule and GradScaler state (the loss scale and its
growth tracker: a resumed fp16 run that restarted at 65536 would overflow again), a pure mode's
fp32 master weights within the optimizer's (rebuilt from the rounded 16-bit weights, they would
lose what the rounding dropped), every RNG
state (Python, NumPy, torch CPU and CUDA; the data order itself is a function of (seed, epoch)
and ``TrainState.batch`` is the position in it), the ``TrainState`` with the running totals
the loop has not logged yet, the MLflow run id, and the config with its hash.

Everything is stored as tensors and plain Python values, so it loads with
``torch.load(weights_only=True)``: a checkpoint is data, never code. Files are written to a
temporary name and renamed (``os.replace`` is atomic), so a kill never leaves a half-written
checkpoint under the real name; a failed write (a full disk) removes the temporary file.

A checkpoint proves itself: it carries a SHA-256 digest of every tensor and value it holds
(``digest``), which loading recomputes, so a file whose bytes were overwritten (same size) or
cut short is refused as damaged, and resuming falls back to the newest good checkpoint of the
run rather than training on from damaged weights.

Where they go, the config hash that keys the folder and its lease: ``engine.run_folder``. Which
one a run resumes from, and the check that it fits the config: ``engine.resume_from``.

The snapshot, taken when training ends, is the plain module (not DDP's wrapper, not
torch.compile's), copied to the CPU in fp32: a ``*_pure`` mode trains half-precision weights,
but a logged model is for people to load anywhere, and fp32 holds every half value exactly
(``.to(torch.bfloat16)`` gives the trained weights back bit for bit). Its input example is one
batch as the model receives it (at most ``EXAMPLE_VALUES`` values, so a batch of large images
does not become a megabytes-long JSON file). Taking the snapshot is cheap and happens at once,
so the training run's memory can go; computing the example's output (for the signature) is
left to whoever logs it, off the critical path.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine import distributed, sharded
from ampsweep.engine.loop import TrainState
from ampsweep.engine.run_folder import (
    comparable,
    config_hash,
    unmasked,
)
from ampsweep.engine.tasks import logits_of
from ampsweep.errors import FaultError
from ampsweep.precision.policy import Fp32Forward

FORMAT = 1
END_SUFFIX = "-end.pt"  # the checkpoint written when training reached its end


# ---------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """Every generator the loop draws from, as tensors and plain values (weights_only-safe)."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # (the dict form only with legacy=False)
    key, mt, pos, has_gauss, gauss = legacy
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": key,
            "mt": torch.from_numpy(mt.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(
        (n["key"], n["mt"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- the digest


DIGEST = "digest"  # the payload's key holding the digest of everything else in it


# Added on load, not written: where the file was read from (engine.sharded finds the DCP folder
# beside it), so the digest leaves it out.
LOADED_FROM = "loaded_from"


def digest(payload: dict) -> str:
    """SHA-256 of a checkpoint's contents: every tensor's name, dtype, shape and bytes, and
    every other value's name and repr, in a fixed order (a dict's keys sorted)."""
    h = hashlib.sha256()
    _feed(h, "", {k: v for k, v in payload.items() if k not in (DIGEST, LOADED_FROM)})
    return h.hexdigest()


def _feed(h, name: str, value) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the raw bytes, any dtype
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _feed(h, f"{name}/{key}", value[key])
    elif isinstance(value, list | tuple):  # (a tuple may load back as a list)
        h.update(f"{name}:[{len(value)}]\n".encode())
        for i, item in enumerate(value):
            _feed(h, f"{name}[{i}]", item)
    else:
        h.update(f"{name}={value!r}\n".encode())


class DamagedCheckpoint(ConfigError):
    """A checkpoint file that cannot be trusted: unreadable, cut short, or its contents no
    longer match its digest (``why``: which, as a clause after the file's name)."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"trainer.resume: {path} {why}: resume from an earlier checkpoint")
        self.path, self.why = path, why


# ---------------------------------------------------------------- writing


class Checkpointer:
    """Writes a run's checkpoints every ``every`` steps (0: only at the end) and keeps the
    newest ``keep``. ``before_save`` runs first (the recorder's flush: every metric up to the
    checkpoint's step is in the store before the checkpoint claims that step). ``mask`` hides
    secrets in the config values a checkpoint stores (the job passes the tracking layer's);
    the config hash is of the real values."""

    def __init__(
        self,
        folder: Path,
        cfg: Config,
        run_id: str | None,
        before_save=None,
        mask: Callable[[str], str] = unmasked,
        weights: Callable[[object, Path], dict] | None = None,
    ):
        self.folder, self.cfg, self.run_id = folder, cfg, run_id
        self.every, self.keep = cfg.trainer.checkpoint_every, cfg.trainer.keep_checkpoints
        self.before_save, self.mask = before_save, mask
        # The model's and optimizer's entries of the file (``whole_weights``; a sharded run's
        # name its DCP folder instead: engine.sharded)
        self.weights = weights or whole_weights
        self.last: Path | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, setup, state, complete: bool = False) -> Path:
        if self.before_save:
            self.before_save()
        self.folder.mkdir(parents=True, exist_ok=True)
        # The end of training is marked in the name too, so ``auto`` can tell without loading.
        target = self.folder / f"step-{state.step:08d}{END_SUFFIX if complete else '.pt'}"
        payload = {
            "format": FORMAT,
            "complete": complete,  # the end of training (nothing left to resume)
            "run_id": self.run_id,
            "config_hash": config_hash(self.cfg),
            "config": {k: self.mask(v) for k, v in comparable(self.cfg).items()},
            "state": asdict(state),
            **self.weights(setup, target),
            "schedule": setup.schedule.state_dict(),
            "scaler": setup.scaler.state_dict(),  # scale + growth tracker ({} when disabled)
            "rng": rng_state(),
            "saved_at": datetime.now().isoformat(timespec="seconds"),
        }
        payload[DIGEST] = digest(payload)
        write(payload, target)  # atomic: readers see the old file set or the new one
        self.last = target
        self._prune()
        return target

    def _prune(self) -> None:
        for old in checkpoints_in(self.folder)[: -self.keep]:
            old.unlink(missing_ok=True)


def whole_weights(setup, target: Path) -> dict:
    """The plain module's weights (loadable with or without DDP / torch.compile) and the
    optimizer's state, in the checkpoint file itself."""
    return {
        "model": distributed.unwrap(setup.model).state_dict(),
        "optimizer": setup.optimizer.state_dict(),
    }


def write(payload: dict, target: Path) -> None:
    """Write to a temporary file, then rename it (atomic: readers see the old set of files or
    the new one); on any failure the temporary file is removed, and a full disk is one line."""
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    try:
        torch.save(payload, tmp)
        os.replace(tmp, target)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if _disk_full(err):
            mib = sum(_nbytes(v) for v in payload.values()) / 2**20
            raise FaultError(
                f"no space left on {_device_of(target.parent)} for the checkpoint of "
                f"{mib:.0f} MiB: free space or set trainer.checkpoint_dir"
            ) from None
        raise


def _disk_full(err: BaseException) -> bool:
    """ENOSPC (or EDQUOT) from the write, also as torch's C++ writer reports it (a
    RuntimeError whose text holds the errno's message)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and (
        os.strerror(errno.ENOSPC) in text or os.strerror(errno.EDQUOT) in text
    )


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _device_of(folder: Path) -> str:
    """The mount point holding ``folder`` (what ``df`` would name), else the folder."""
    path = folder.resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def checkpoints_in(folder: Path) -> list[Path]:
    """Checkpoints of one run folder, oldest first (by step)."""
    return sorted(folder.glob("step-*.pt"))


# ---------------------------------------------------------------- loading


def load(path: Path) -> dict:
    """Read a checkpoint as data only (weights_only=True: no pickled code runs) and verify
    its digest; a file that fails either is a DamagedCheckpoint."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        size = path.stat().st_size if path.is_file() else 0
        why = f"is not a readable ampsweep checkpoint ({type(err).__name__}, {size:,} bytes)"
        raise DamagedCheckpoint(path, why) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ConfigError(
            f"trainer.resume: {path} is not an ampsweep checkpoint of format {FORMAT}: "
            "point trainer.resume at a step-N.pt file written by ampsweep"
        )
    # (a checkpoint written before checkpoints carried a digest loads unverified)
    if DIGEST in ckpt and digest(ckpt) != ckpt[DIGEST]:
        why = "is damaged: its contents no longer match its digest (bytes changed on disk)"
        raise DamagedCheckpoint(path, why)
    ckpt[LOADED_FROM] = str(path)  # a sharded checkpoint's DCP folder lies beside it
    return ckpt


def restore(setup, ckpt: dict) -> TrainState:
    """Put a checkpoint's states into a freshly built Setup; return the TrainState.

    Called after ``build`` (which seeds every generator), so the RNG states loaded here are
    the ones the loop continues from."""
    if ckpt.get("sharded"):  # every rank reads its shards (a collective)
        sharded.load(sharded.shards_of(ckpt), setup.model, setup.optimizer)
    else:
        distributed.unwrap(setup.model).load_state_dict(ckpt["model"])
        setup.optimizer.load_state_dict(ckpt["optimizer"])
    setup.schedule.load_state_dict(ckpt["schedule"])
    if ckpt["scaler"]:
        setup.scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(ckpt["rng"])
    return TrainState(**ckpt["state"])


# ---------------------------------------------------------------- the snapshot for MLflow

EXAMPLE_VALUES = 65536  # values in the input example (whole rows, at least one)


@dataclass
class ModelSnapshot:
    module: torch.nn.Module  # fp32 (floating tensors), CPU, eval mode
    example: np.ndarray  # one batch of inputs, as numpy (float32 for floating inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The module's output on ``x`` (float32), as the signature records it."""
        with torch.inference_mode():
            out = logits_of(self.module(torch.from_numpy(x)))  # a dict's or tuple's logits
        return out.float().numpy() if out.is_floating_point() else out.numpy()

    @property
    def packages(self) -> set[str]:
        """Top-level packages the module's classes come from (torch, ampsweep, timm, ...)."""
        return {type(m).__module__.split(".")[0] for m in self.module.modules()}


def snapshot(model: torch.nn.Module, batches) -> ModelSnapshot:
    """The trained ``model`` copied for logging, with an input example from ``batches``."""
    module = distributed.unwrap(model)
    # Each tensor copied straight to a CPU fp32 tensor (deepcopy's memo), so the copy never
    # doubles the GPU memory the trained model holds.
    params = {id(p) for p in module.parameters()}
    memo = {}
    for t in [*module.parameters(), *module.buffers()]:
        cpu = t.detach().to("cpu", _fp32(t.dtype), copy=True)
        memo[id(t)] = torch.nn.Parameter(cpu, t.requires_grad) if id(t) in params else cpu
    copied = copy.deepcopy(module, memo).eval()
    for m in copied.modules():  # all fp32 now: precision.keep_fp32's wrappers have no use left
        if isinstance(m.__dict__.get("forward"), Fp32Forward):
            del m.forward
    x, _ = next(iter(batches.epoch(0)))
    per_row = max(1, x[0].numel())
    rows = max(1, min(len(x), EXAMPLE_VALUES // per_row))
    example = x[:rows].detach().to("cpu", _fp32(x.dtype)).contiguous().numpy()
    return ModelSnapshot(copied, example)


def _fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype
