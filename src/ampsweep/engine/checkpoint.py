"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint holds the model, optimizer, schedule and GradScaler state (the loss scale and its
growth tracker: a resumed fp16 run that restarted at 65536 would overflow again), every RNG
state (Python, NumPy, torch CPU and CUDA; the data order itself is a function of (seed, epoch)
and ``TrainState.batch`` is the position in it), the ``TrainState`` with the running totals
the loop has not logged yet, the MLflow run id, and the config with its hash.

Everything is stored as tensors and plain Python values, so it loads with
``torch.load(weights_only=True)``: a checkpoint is data, never code. Files are written to a
temporary name and renamed (``os.replace`` is atomic), so a kill never leaves a half-written
checkpoint under the real name.

Where: ``<trainer.checkpoint_dir or outputs/checkpoints>/<config hash>/<run id>/step-N.pt``.
Keying the folder by the config hash lets ``trainer.resume=auto`` find the newest checkpoint of
the same config after a relaunch, and lets sweep jobs with different configs never collide.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from ampsweep.config.compose import flatten
from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine import distributed, sharded
from ampsweep.engine.loop import TrainState

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
)


# ---------------------------------------------------------------- config identity


def comparable(cfg: Config) -> dict[str, str]:
    """The flattened config without the keys that may differ on resume."""
    return {k: v for k, v in flatten(cfg).items() if k not in NOT_HASHED}


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
        tmp = self.folder / f".{target.name}.{os.getpid()}.tmp"
        torch.save(payload, tmp)
        os.replace(tmp, target)  # atomic: readers see the old file set or the new one
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


def checkpoints_in(folder: Path) -> list[Path]:
    """Checkpoints of one run folder, oldest first (by step)."""
    return sorted(folder.glob("step-*.pt"))


# ---------------------------------------------------------------- finding and loading


def load(path: Path) -> dict:
    """Read a checkpoint as data only (weights_only=True: no pickled code runs)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(
            f"trainer.resume: {path} is not a readable ampsweep checkpoint "
            f"({type(err).__name__}): point trainer.resume at a step-N.pt file"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ConfigError(
            f"trainer.resume: {path} is not an ampsweep checkpoint of format {FORMAT}: "
            "point trainer.resume at a step-N.pt file written by ampsweep"
        )
    ckpt["loaded_from"] = str(path)  # a sharded checkpoint's DCP folder lies beside it
    return ckpt


def newest(paths: list[Path]) -> Path | None:
    return max(paths, key=lambda p: (p.stat().st_mtime, p.name), default=None)


def is_path(choice: str) -> bool:
    """Whether ``trainer.resume`` names a file or folder (else it is ``auto`` or a run id)."""
    return Path(choice).expanduser().exists() or "/" in choice or choice.endswith(".pt")


def locate(cfg: Config, choice: str | None) -> tuple[Path | None, str]:
    """The checkpoint ``choice`` (``trainer.resume``: ``auto`` or a path) names, and a line
    saying what was found. (A run id is looked up in the store by the caller, which then
    asks ``newest_of_run`` for the run's folder.)

    ``auto``: the newest checkpoint of this config under the checkpoint root, unless that one
    marks the end of a run (then there is nothing to resume and training starts afresh).
    A path: that file, or the newest checkpoint in that folder.
    """
    if not choice:
        return None, ""
    if choice == "auto":
        folder = root_of(cfg) / config_hash(cfg)
        found = newest(list(folder.glob("*/step-*.pt")))
        if found is None:
            return None, f"trainer.resume=auto: no checkpoint under {folder}, starting afresh"
        if found.name.endswith(END_SUFFIX):
            return None, f"trainer.resume=auto: {found} ended its run, starting afresh"
        return found, f"resuming from {found}"
    path = Path(choice).expanduser().resolve()
    if path.is_dir():
        found = newest(checkpoints_in(path))
        if found is None:
            raise ConfigError(
                f"trainer.resume={choice}: no step-*.pt checkpoint in {path}: "
                "point it at a checkpoint file or a run's checkpoint folder"
            )
        path = found
    if not path.is_file():
        raise ConfigError(
            f"trainer.resume={choice}: no such file ({path}): give an existing checkpoint, "
            "a run id, or auto"
        )
    return path, f"resuming from {path}"


def newest_of_run(run_id: str, folder: Path | None) -> tuple[Path, str]:
    """The newest checkpoint in the folder a run recorded (its ``checkpoint_dir`` tag)."""
    found = newest(checkpoints_in(folder)) if folder and folder.is_dir() else None
    if found is None:
        raise ConfigError(
            f"trainer.resume={run_id}: run {run_id} has no checkpoint "
            f"(looked in {folder or 'nowhere: the run has no checkpoint_dir tag'})"
        )
    return found, f"resuming run {run_id} from {found}"


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
