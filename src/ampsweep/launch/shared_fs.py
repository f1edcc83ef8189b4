"""Whether the files a SLURM sweep's jobs share (the sweep dir, a SQLite store, the checkpoint
folders) lie on a file system the nodes that run them can see: one only this machine sees
(tmpfs, overlay, ...) is refused when the jobs run on other machines; this machine's root file
system is a note."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from ampsweep.config.schema import ConfigError
from ampsweep.launch.sinfo import Partition

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
