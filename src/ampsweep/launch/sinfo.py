"""What a SLURM partition offers, read from ``sinfo``'s text: its nodes (CPUs, GPUs counted
from their generic resources, memory, address), whether it is the default, and its time limit
in minutes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


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
