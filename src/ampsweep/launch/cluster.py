"""The cluster's machines as a SLURM sweep sees them: what a partition offers, read from
``sinfo``'s text (its nodes: CPUs, GPUs counted from their generic resources, memory, address;
whether it is the default; its time limit in minutes), and whether the files a sweep's jobs
share (the sweep dir, a SQLite store, the checkpoint folders) lie on a file system the nodes
that run them can see: one only this machine sees (tmpfs, overlay, ...) is refused when the
jobs run on other machines; this machine's root file system is a note."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ampsweep.config.schema import ConfigError


@dataclass(frozen=True)
class Node:
    name: str
    hostname: str
    address: str
    cpus: int
    gpus: int
    memory_mb: int


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    time_limit_min: int | None  # None: unlimited
    nodes: tuple[Node, ...] = field(default_factory=tuple)

    @property
    def max_cpus(self) -> int:
        return max((n.cpus for n in self.nodes), default=0)

    @property
    def max_gpus(self) -> int:
        return max((n.gpus for n in self.nodes), default=0)

    @property
    def max_memory_mb(self) -> int:
        return max((n.memory_mb for n in self.nodes), default=0)


SINFO_FORMAT = "%P|%N|%n|%o|%c|%G|%m|%l"


def parse_sinfo(text: str) -> dict[str, Partition]:
    found: dict[str, tuple[bool, int | None, list[Node]]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 8:
            continue
        part, name, hostname, address, cpus, gres, memory, limit = parts
        default = part.endswith("*")
        part = part.rstrip("*")
        node = Node(name, hostname, address, _int(cpus), gpu_count(gres), _int(memory))
        entry = found.setdefault(part, (default, parse_time_limit(limit), []))
        entry[2].append(node)
    return {p: Partition(p, d, limit, tuple(nodes)) for p, (d, limit, nodes) in found.items()}


def _int(text: str) -> int:
    match = re.match(r"\d+", text.strip())
    return int(match.group()) if match else 0


def gpu_count(gres: str) -> int:
    """GPUs in a node's generic resources: ``gpu:4``, ``gpu:a100:4(S:0-1)``, ``(null)``..."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        fields = item.split("(")[0].split(":")
        if fields[0] == "gpu" and len(fields) >= 2 and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def parse_time_limit(text: str) -> int | None:
    """Minutes of a SLURM time limit (``infinite``, ``30:00``, ``2:00:00``, ``1-12:00:00``)."""
    text = text.strip()
    if text in ("infinite", "UNLIMITED", "n/a", ""):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    if len(parts) == 3:
        hours, minutes, seconds = parts
    elif len(parts) == 2:
        hours, (minutes, seconds) = 0, parts
    else:
        hours, minutes, seconds = 0, parts[0], 0
    return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)


# File systems that exist on this machine only: jobs on other machines cannot see them.
LOCAL_ONLY_FS = {"tmpfs", "ramfs", "devtmpfs", "overlay", "aufs", "squashfs"}


def _this_machine() -> tuple[set[str], set[str]]:
    names = {socket.gethostname(), socket.getfqdn(), "localhost"}
    names |= {n.split(".")[0] for n in names}
    addresses: set[str] = set()
    for name in list(names):
        try:
            addresses |= set(socket.gethostbyname_ex(name)[2])
        except OSError:
            pass
    return names, addresses


def remote_nodes(part: Partition) -> list[str]:
    """The nodes of a partition that are other machines than this one."""
    names, addresses = _this_machine()
    out = []
    for n in part.nodes:
        if n.hostname in names or n.name in names or n.address in names | addresses:
            continue
        try:
            if ipaddress.ip_address(n.address).is_loopback:
                continue
        except ValueError:
            pass
        out.append(n.name)
    return out


def mount_of(path: Path, mountinfo: str | None = None) -> tuple[str, str]:
    """The mount point and file system type holding ``path`` (or its nearest existing
    folder: the sweep dir may not exist yet), from /proc/self/mountinfo."""
    path = path.expanduser().resolve()
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return "", ""
    best = ("", "")
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == Path(point) or Path(point) in path.parents
        if inside and len(point) >= len(best[0]):
            best = (point, right.split()[0])
    return best


def check_shared(
    paths: dict[str, Path], part: Partition, mountinfo: str | None = None
) -> list[str]:
    remote = remote_nodes(part)
    if not remote:
        return []  # the jobs run on this machine: every file system is shared with them
    shown = ", ".join(remote[:4]) + (", ..." if len(remote) > 4 else "")
    notes = []
    for key, path in paths.items():
        point, fstype = mount_of(path, mountinfo)
        if fstype in LOCAL_ONLY_FS:
            fix = (
                "use a tracking server (tracking.uri=http://...) or a store on a shared file system"
                if key == "tracking.uri"
                else f"set {key} to a folder on a file system the nodes share (NFS, Lustre, ...)"
            )
            raise ConfigError(
                f"{key}={path}: it is on {fstype} ({point}), which only this machine sees, "
                f"but the jobs run on other machines ({shown}): {fix}"
            )
        if point == "/" and fstype:
            notes.append(
                f"{key}={path} is on this machine's root file system ({fstype}); the jobs run "
                f"on {shown}: unless they mount it too, put it on a shared file system"
            )
    return notes
