"""Facts about where a run happened: versions, device, host, code version."""

from __future__ import annotations

import hashlib
import inspect
import platform
import subprocess
import sys
from pathlib import Path

import torch

import ampsweep
from ampsweep.config.schema import Config
from ampsweep.engine.components import builders
from ampsweep.precision import modes
from ampsweep.runner import estimate
from ampsweep.tracking import store
from ampsweep.tracking.logged_model import distributions_of, installed_version


def git_state(start: Path | None = None, own: bool = True) -> dict[str, str]:
    """``git_commit`` and ``git_dirty`` of the checkout ampsweep runs from (its source tree if
    that is a git checkout, else the current folder); empty outside git. ``own=False``: of the
    checkout ``start`` lies in only."""
    candidates = [Path(ampsweep.__file__).resolve().parent] if own else []
    candidates.append(start or Path.cwd())
    for folder in candidates:
        try:
            commit = subprocess.run(
                ["git", "-C", str(folder), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        return {store.GIT_COMMIT: commit, store.GIT_DIRTY: str(bool(dirty)).lower()}
    return {}


def target_provenance(fn) -> dict[str, str]:
    """Where a ``_target_`` callable's code came from: the version of the installed
    distribution that holds its package, the git commit (and dirty state) of the checkout its
    module lives in, and a SHA-256 of its module's file; each one that can be found."""

    out: dict[str, str] = {}
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    top = (getattr(module, "__name__", "") or "").split(".")[0]
    dists = distributions_of(top)
    if dists:
        dist = dists[0]
        out["version"] = f"{dist} {installed_version(dist)}"
    try:
        path = Path(inspect.getfile(module)).resolve() if module else None
    except TypeError:  # a built-in module has no file
        path = None
    if path and path.is_file():
        out["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        git = git_state(path.parent, own=False)
        if git:
            out["git_commit"], out["git_dirty"] = git[store.GIT_COMMIT], git[store.GIT_DIRTY]
    return out


def device_tags(device: torch.device) -> dict[str, str]:
    tags = {store.DEVICE: device.type, store.TORCH_VERSION: torch.__version__}
    if device.type == "cuda":
        tags[store.DEVICE_NAME] = torch.cuda.get_device_name(device)
        tags[store.CUDA_VERSION] = str(torch.version.cuda)
        major, minor = torch.cuda.get_device_capability(device)
        tags[store.COMPUTE_CAPABILITY] = f"{major}.{minor}"
    else:
        tags[store.DEVICE_NAME] = cpu_name()
        tags[store.CPU_THREADS] = str(torch.get_num_threads())
        tags[store.CPU_HALF_ISA] = ",".join(cpu_half_precision_isa()) or "none"
    return tags


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` of /proc/cpuinfo (Linux), None elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU model, else what platform knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "cpu"


def cpu_half_precision_isa() -> list[str]:
    """The CPU's native half-precision instruction sets (its flags, as the mode table names
    them in ``modes.NATIVE_CPU_FLAGS``): they decide whether bf16/fp16 autocast can be fast
    on this CPU at all."""
    flags = estimate.cpu_flags() or set()
    native = dict.fromkeys(f for names in modes.NATIVE_CPU_FLAGS.values() for f in names)
    return [f for f in native if f in flags]


def run_tags(device: torch.device) -> dict[str, str]:
    """Where a run happened: the device and Python (the code version, host and pid are tagged
    once, when the run starts)."""
    return {**device_tags(device), "python_version": platform.python_version()}


def code_changes(cfg: Config, tags: dict[str, str]) -> list[str]:
    """How the code this job would run differs from the code a run of its config ran:
    ampsweep's version, and the version and module digest of each ``_target_`` component."""
    now = {store.AMPSWEEP_VERSION: ampsweep.__version__}
    now.update({k: v for k, v in target_tags(cfg).items() if k.endswith((".version", ".sha256"))})
    return [
        f"{key}: {_short(tags.get(key)) or '(not recorded)'} then, {_short(value)} now"
        for key, value in now.items()
        if tags.get(key) != value
    ]


def _short(value: str | None) -> str | None:
    return value[:12] if value and len(value) == 64 else value  # a SHA-256: its prefix


def target_tags(cfg: Config) -> dict[str, str]:
    """For each component named by ``_target_``: its path and where its code came from."""
    tags = {}
    for section, builder in builders(cfg).items():
        if builder.target:
            tags[store.target_tag(section)] = builder.target
            for key, value in target_provenance(builder.fn).items():
                tags[store.target_tag(section, key)] = value
    return tags
