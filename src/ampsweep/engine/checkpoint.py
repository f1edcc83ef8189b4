"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint holds the model, optimizer, schedule and GradScaler state (the loss scale and its
growth tracker: a resumed fp16 run that restarted at 65536 would overflow again), every RNG
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

Where: ``<trainer.checkpoint_dir or outputs/checkpoints>/<config hash>/<run id>/step-N.pt``.
Keying the folder by the config hash lets ``trainer.resume=auto`` find the newest checkpoint of
the same config after a relaunch, and lets sweep jobs with different configs never collide.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from ampsweep.config.compose import flatten
from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine import distributed, lease, sharded
from ampsweep.engine.lease import Lease, NoLease
from ampsweep.engine.loop import TrainState
from ampsweep.errors import FaultError

FORMAT = 1
DEFAULT_ROOT = Path("outputs") / "checkpoints"
END_SUFFIX = "-end.pt"  # the checkpoint written when training reached its end
# Keys that say only where things are written, how often, how they are shown, or what
# watches the run (trainer.callbacks: a run a callback stopped resumes without it): they may
# differ between a checkpoint and the command resuming it, and they are left out of the hash.
NOT_HASHED = (
    "trainer.resume",
    "trainer.callbacks",
    "trainer.checkpoint_dir",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.progress",
    "tracking.uri",
    "tracking.artifact_root",
    "tracking.metrics_flush_every",
    "tracking.metrics_flush_seconds",
    "tracking.skip_finished",
    "tracking.log_model",
    "tracking.register_model",
    "tracking.system_metrics",
    "tracking.system_metrics_interval",
    "tracking.on_store_failure",
)


# ---------------------------------------------------------------- config identity


class _ComparableByValue:
    """``comparable`` of the last few configs, by value. A job asks for its config's hash
    about seven times (its tags, the finished-twin look-up, the checkpoint folder twice, each
    save), and each is a flatten through OmegaConf (8 ms of CPU on 2 cores) of a config that
    does not change. The key is the config's repr: a dataclass's repr spells every field's
    value, so a config changed in between is a new key, never a stale hash."""

    def __init__(self, size: int = 16):
        self.size = size
        self._seen: dict[str, dict[str, str]] = {}

    def __call__(self, cfg: Config) -> dict[str, str]:
        key = repr(cfg)
        if key not in self._seen:
            if len(self._seen) >= self.size:
                self._seen.pop(next(iter(self._seen)))  # the oldest
            self._seen[key] = {k: v for k, v in flatten(cfg).items() if k not in NOT_HASHED}
        return dict(self._seen[key])  # a copy: callers may change theirs


_comparable = _ComparableByValue()


def comparable(cfg: Config) -> dict[str, str]:
    """The flattened config without the keys that may differ on resume."""
    return _comparable(cfg)


def config_hash(cfg: Config) -> str:
    """A short hash of what determines the result (resolved precision included)."""
    text = json.dumps(comparable(cfg), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def root_of(cfg: Config) -> Path:
    return Path(cfg.trainer.checkpoint_dir or DEFAULT_ROOT).expanduser().resolve()


def folder_for(cfg: Config, run_id: str | None) -> Path:
    """This run's checkpoint folder (absolute)."""
    name = run_id or f"untracked-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
    return root_of(cfg) / config_hash(cfg) / name


def unmasked(text: str) -> str:
    return text


def differences(saved: dict[str, str], cfg: Config, mask: Callable[[str], str] = unmasked):
    """Where the config stored in a checkpoint (masked by ``mask``) differs from ``cfg``."""
    now = {k: mask(v) for k, v in comparable(cfg).items()}
    keys = sorted(set(saved) | set(now))
    return [
        f"{k}={saved.get(k, '<absent>')} in the checkpoint, {now.get(k, '<absent>')} now"
        for k in keys
        if saved.get(k) != now.get(k) and k not in NOT_HASHED
    ]


# ---------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """Every generator the loop draws from, as tensors and plain values (weights_only-safe)."""
    key, mt, pos, has_gauss, gauss = np.random.get_state()
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


# ---------------------------------------------------------------- finding and loading


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


def first_good(paths: list[Path], say: Callable[[str], None]) -> tuple[Path, dict] | None:
    """The first of ``paths`` (newest first) that loads and verifies, with its contents;
    each damaged one before it is skipped with a line said through ``say``."""
    for i, path in enumerate(paths):
        try:
            return path, load(path)
        except DamagedCheckpoint as err:
            rest = paths[i + 1 :]
            then = f"falling back to {rest[0].name}" if rest else "no earlier checkpoint"
            say(f"{err.path} {err.why}: {then}")
    return None


def newest_first(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)


def newest(paths: list[Path]) -> Path | None:
    return max(paths, key=lambda p: (p.stat().st_mtime, p.name), default=None)


def is_path(choice: str) -> bool:
    """Whether ``trainer.resume`` names a file or folder (else it is ``auto`` or a run id)."""
    return Path(choice).expanduser().exists() or "/" in choice or choice.endswith(".pt")


def candidates(cfg: Config, choice: str | None) -> tuple[list[Path], str]:
    """The checkpoints ``choice`` (``trainer.resume``: ``auto`` or a path) names, newest
    first, and the line to say when there are none. (A run id is looked up in the store by
    the caller, which then asks ``candidates_of_run`` for the run's folder.)

    ``auto``: every checkpoint of this config under the checkpoint root (``choose`` stops at
    the end of a run: then training starts afresh). A folder: its checkpoints. A file: it.
    """
    if not choice:
        return [], ""
    if choice == "auto":
        folder = root_of(cfg) / config_hash(cfg)
        found = newest_first(list(folder.glob("*/step-*.pt")))
        return found, f"trainer.resume=auto: no checkpoint under {folder}, starting afresh"
    path = Path(choice).expanduser().resolve()
    if path.is_dir():
        found = newest_first(checkpoints_in(path))
        if not found:
            raise ConfigError(
                f"trainer.resume={choice}: no step-*.pt checkpoint in {path}: "
                "point it at a checkpoint file or a run's checkpoint folder"
            )
        return found, ""
    if not path.is_file():
        raise ConfigError(
            f"trainer.resume={choice}: no such file ({path}): give an existing checkpoint, "
            "a run id, or auto"
        )
    return [path], ""


def candidates_of_run(run_id: str, folder: Path | None) -> list[Path]:
    """The checkpoints in the folder a run recorded (its ``checkpoint_dir`` tag), newest
    first."""
    found = newest_first(checkpoints_in(folder)) if folder and folder.is_dir() else []
    if not found:
        raise ConfigError(
            f"trainer.resume={run_id}: run {run_id} has no checkpoint "
            f"(looked in {folder or 'nowhere: the run has no checkpoint_dir tag'})"
        )
    return found


@dataclass
class Choice:
    """The checkpoint to resume (None: start afresh), its contents, the lease on its run's
    folder (held: no other process trains that run meanwhile), and the line to say."""

    path: Path | None = None
    ckpt: dict | None = None
    lease: Lease | NoLease = field(default_factory=NoLease)
    line: str = ""


def choose(
    paths: list[Path], choice: str, say: Callable[[str], None], claim: bool = True
) -> Choice:
    """The newest of ``paths`` (newest first) that is free, undamaged and not the end of
    its run, with the lease on its folder.

    ``auto`` skips a run another live process trains (it keeps its run; this job starts its
    own) and a damaged checkpoint (said through ``say``), falling back to the next; it starts
    afresh at the end of a run. A path or run id names one run: a live owner or no undamaged
    checkpoint is refused in one line, never trained on. ``claim`` False (a DDP rank other
    than 0, whose rank 0 holds the lease): no lease is taken."""
    auto = choice == "auto"
    leases: dict[Path, Lease | NoLease] = {}
    busy, damaged = set(), []

    def release_all(keep: Path | None = None) -> None:
        for folder, held in leases.items():
            if folder != keep:
                held.release()

    for path in paths:
        folder = path.parent
        if folder in busy:
            continue
        if folder not in leases:
            try:
                leases[folder] = lease.take(folder) if claim else NoLease()
            except lease.Owned as owned:
                who = owned.owner.describe() if owned.owner else "another process"
                if not auto:
                    release_all()
                    raise ConfigError(
                        f"trainer.resume={choice}: the run of {path} is being trained by "
                        f"{who}: wait for it to end, or drop trainer.resume to start a new run"
                    ) from None
                busy.add(folder)
                say(f"trainer.resume=auto: run {folder.name} is being trained by {who}: "
                    "leaving it to that process")  # fmt: skip
                continue
        if auto and path.name.endswith(END_SUFFIX):
            release_all()
            return Choice(line=f"trainer.resume=auto: {path} ended its run, starting afresh")
        try:
            ckpt = load(path)
        except DamagedCheckpoint as err:
            damaged.append(err)
            say(f"{err.path} {err.why}: not resuming from it")
            continue
        release_all(keep=folder)
        return Choice(path, ckpt, leases[folder], f"resuming from {path}")
    release_all()
    if damaged and not auto:
        raise ConfigError(
            f"trainer.resume={choice}: no undamaged checkpoint ({len(damaged)} damaged, the "
            f"newest {damaged[0].path}): drop trainer.resume to start a new run"
        )
    if damaged or busy:
        return Choice(line="trainer.resume=auto: no free, undamaged checkpoint: starting afresh")
    return Choice()


def check(
    ckpt: dict,
    cfg: Config,
    path: Path,
    choice: str,
    run_id: str | None = None,
    mask: Callable[[str], str] = unmasked,
) -> None:
    """Refuse a checkpoint whose config differs from this one in anything that matters
    (``mask``: the one the checkpoint was written with, to compare its stored config)."""
    refusal = sharded.mismatch(ckpt, cfg, choice, path)  # DDP's weights against FSDP's shards
    if refusal:
        raise ConfigError(refusal)
    cfg = sharded.as_saved(ckpt, cfg)  # a sharded checkpoint resumes on any number of ranks
    if ckpt["config_hash"] != config_hash(cfg):
        diff = differences(ckpt["config"], cfg, mask)
        more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
        first = diff[0] if diff else "the config hash differs"
        raise ConfigError(
            f"trainer.resume={choice}: {path} was written by a different config: "
            f"{first}{more}: resume with the checkpoint's config, or drop trainer.resume to "
            "start a new run"
        )
    if run_id is not None and ckpt["run_id"] != run_id:
        raise ConfigError(
            f"trainer.resume={run_id}: {path} belongs to run {ckpt['run_id']}, not {run_id}"
        )
    if ckpt.get("complete"):
        raise ConfigError(
            f"trainer.resume={choice}: {path} is the end of run {ckpt['run_id']}, "
            "which trained to the end: nothing to resume; drop trainer.resume for a new run"
        )


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
