"""What data a run saw: each split named, sourced and identified by a digest of its content.

MLflow records a data set as a name, a digest, a source and a schema (``mlflow.log_input``);
ampsweep computes the digest itself, over all of the data: MLflow's own digest of an array looks
at its first 10,000 values only, so two data sets that differ further on would look the same.

* Tensors (every built-in data set but the image folder): SHA-256 of each tensor's dtype, shape
  and bytes, as the loader returns them (after normalisation: what the model is fed).
* A data set read per item from files (``root/<class>/<image>``, torchvision's ``ImageFolder``):
  SHA-256 of each sample's path relative to the folder, its label and its file size, in split
  order. A stat per file rather than a read of every byte (a large folder would take minutes to
  hash), and no modification times: a copy of the same folder elsewhere gets the same digest. An
  edit that keeps a file's size is not seen.
* Any other per-item data set: its items, read once and hashed as tensors.

Digests are remembered for the life of the process by a cheap key (the data set's config, the
tensors' shapes and a strided sample of their values), so the jobs of a sweep hash their data
once rather than once per job.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ampsweep.config.schema import DatasetConfig
from ampsweep.engine.data import DATASETS, Splits

DIGEST_CHARS = 16  # of the hex SHA-256 (MLflow's own digests are 8-10 characters)
SAMPLED_VALUES = 4096  # values of each tensor in the cheap key

# Content digests by cheap key (see the module doc): a memo, computed on first use.
_digests: dict[tuple, str] = {}


@dataclass
class DataInput:
    """One split as MLflow records it (plain values: the tracking layer imports no torch)."""

    name: str  # e.g. digits-train
    digest: str
    split: str  # train | val
    source_type: str  # local (a file or folder) | code (generated, or a _target_)
    source: dict[str, Any]  # {"uri": path} or {"tags": {...}}
    rows: int
    features: tuple[str, tuple[int, ...]]  # dtype, shape of one input
    targets: tuple[str, tuple[int, ...]]  # dtype, shape of one label


def describe(cfg: DatasetConfig, splits: Splits) -> list[DataInput]:
    """The train and validation splits of a loaded data set, as MLflow inputs."""
    source_type, source = source_of(cfg)
    out = []
    for part in ("train", "val"):
        split = getattr(splits, part)
        out.append(
            DataInput(
                name=f"{splits.name}-{part}",
                digest=digest(split, (part, _config_key(cfg))),
                split=part,
                source_type=source_type,
                source=source,
                rows=len(split[1]) if isinstance(split, tuple) else len(split),
                features=_spec(split, 0),
                targets=_spec(split, 1),
            )
        )
    return out


def source_of(cfg: DatasetConfig) -> tuple[str, dict[str, Any]]:
    """Where a data set comes from: a file or folder it is read from, else the code that makes
    it (a ``_target_`` callable, or the registered loader and its settings)."""
    target = getattr(cfg, "target", None)  # dataset._target_, where the config has it
    if target:
        return "code", {"tags": {"_target_": target, **_plain(cfg.args)}}
    builder = DATASETS.lookup(cfg.name)
    where = builder.info.get("source")  # a loader may say which file it reads
    if where is not None:
        return "local", {"uri": str(where())}
    if "root" in cfg.args:
        return "local", {"uri": str(Path(cfg.args["root"]).expanduser().resolve())}
    loader = f"{builder.fn.__module__}.{builder.fn.__qualname__}"
    tags = {"loader": loader, "split_seed": cfg.split_seed, **_plain(cfg.args)}
    return "code", {"tags": tags}


def digest(split, key: tuple) -> str:
    """The content digest of one split (tensors or a per-item data set), memoised."""
    cheap = (key, *_cheap_key(split))
    if cheap not in _digests:
        h = hashlib.sha256()
        if isinstance(split, tuple):
            _hash_tensors(h, split)
        else:
            files = _files_of(split)
            if files is not None:
                for rel, label, size in files:
                    h.update(f"{rel}\0{label}\0{size}\n".encode())
            else:
                for i in range(len(split)):
                    _hash_tensors(h, tuple(torch.as_tensor(v) for v in split[i]))
        _digests[cheap] = h.hexdigest()[:DIGEST_CHARS]
    return _digests[cheap]


# ---------------------------------------------------------------- helpers


def _hash_tensors(h, tensors) -> None:
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        # The raw bytes, without a copy (hashlib releases the GIL on large buffers).
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _cheap_key(split) -> tuple:
    """What identifies a split's content within one process, at almost no cost."""
    if isinstance(split, tuple):
        parts = []
        for t in split:
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // SAMPLED_VALUES)
            sample = flat[::step].cpu().contiguous()
            parts.append((str(t.dtype), tuple(t.shape), bytes(sample.view(torch.uint8).numpy())))
        return tuple(parts)
    base, indices = _unwrap(split)
    return (type(base).__qualname__, len(base), hash(tuple(indices)))


def _unwrap(split):
    """A (possibly nested) ``Subset``'s underlying data set and the indices it selects."""
    indices = list(range(len(split)))
    while isinstance(split, torch.utils.data.Subset):
        indices = [split.indices[i] for i in indices]
        split = split.dataset
    return split, indices


def _files_of(split) -> list[tuple[str, int, int]] | None:
    """(path relative to the folder, label, size) per sample of a file-backed data set
    (torchvision's ``ImageFolder`` and its kind keep ``samples`` and ``root``), else None."""
    base, indices = _unwrap(split)
    samples = getattr(base, "samples", None)
    if not isinstance(samples, list) or not samples or not isinstance(samples[0], tuple):
        return None
    root = getattr(base, "root", None)
    out = []
    for i in indices:
        path, label = samples[i][:2]
        rel = os.path.relpath(path, root) if root else os.path.basename(path)
        out.append((rel, int(label), os.path.getsize(path)))
    return out


def _spec(split, which: int) -> tuple[str, tuple[int, ...]]:
    """dtype and shape of one input (``which=0``) or label (1)."""
    if isinstance(split, tuple):
        t = split[which]
        return str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])
    t = torch.as_tensor(split[0][which])
    return str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _config_key(cfg: DatasetConfig) -> str:
    return repr(
        (
            cfg.name,
            sorted(cfg.args.items()),
            getattr(cfg, "target", None),
            cfg.split_seed,
            cfg.val_fraction,
            list(cfg.mean),
            list(cfg.std),
        )
    )


def _plain(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (str, int, float, bool)) else str(v) for k, v in args.items()}
