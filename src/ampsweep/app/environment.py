"""Facts about where a run happened: versions, device, host, code version."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

import ampsweep
from ampsweep.tracking import store


def git_state(start: Path | None = None) -> dict[str, str]:
    """``git_commit`` and ``git_dirty`` of the checkout ampsweep runs from (its source tree if
    that is a git checkout, else the current folder); empty outside git."""
    candidates = [Path(ampsweep.__file__).resolve().parent, start or Path.cwd()]
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


HALF_PRECISION_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def cpu_half_precision_isa() -> list[str]:
    """The CPU's native half-precision instruction sets (its flags): they decide whether
    bf16/fp16 autocast can be fast on this CPU at all."""
    flags = set((_cpuinfo("flags") or "").split())
    return [f for f in HALF_PRECISION_FLAGS if f in flags]


def run_tags(device: torch.device) -> dict[str, str]:
    """Where a run happened: the device and Python (the code version, host and pid are tagged
    once, when the run starts)."""
    return {**device_tags(device), "python_version": platform.python_version()}
