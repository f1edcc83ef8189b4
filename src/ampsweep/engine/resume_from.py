"""Which checkpoint a run resumes from: the candidates ``trainer.resume`` names (``auto``, a
folder, a file, a run's folder), the newest that is free, undamaged and not the end of its run,
with the lease on its run's folder (``choose``, a ``Choice``), and the check that it was written
by this config (``check``). Every refusal is one line that names ``trainer.resume``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine import run_folder, sharded
from ampsweep.engine.checkpoint import END_SUFFIX, DamagedCheckpoint, checkpoints_in, load
from ampsweep.engine.run_folder import Lease, NoLease, config_hash, differences, root_of, unmasked


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
                leases[folder] = run_folder.take(folder) if claim else NoLease()
            except run_folder.Owned as owned:
                who = owned.owner.describe() if owned.owner else "another process"
                if not auto:
                    release_all()
                    raise ConfigError(
                        f"trainer.resume={choice}: the run of {path} is being trained by "
                        f"{who}: wait for it to end, or drop trainer.resume to start a new run"
                    ) from None
                busy.add(folder)
                say(
                    f"trainer.resume=auto: run {folder.name} is being trained by {who}: "
                    "leaving it to that process"
                )
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
