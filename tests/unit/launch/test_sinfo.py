"""app/sinfo.py: sinfo's text read into partitions with their nodes, GPUs counted from the
generic resources, time limits in minutes."""

from __future__ import annotations

import pytest

from ampsweep.launch import sinfo
from unit.launch.test_slurm import SINFO


def test_sinfo_is_read_into_partitions_with_their_nodes():
    parts = sinfo.parse_sinfo(SINFO)
    assert sorted(parts) == ["cpu", "debug", "gpu"]
    cpu, gpu, debug = parts["cpu"], parts["gpu"], parts["debug"]
    assert cpu.default and not gpu.default and not debug.default
    assert [n.name for n in cpu.nodes] == ["c1", "c2"]
    assert (cpu.max_cpus, cpu.max_gpus, cpu.max_memory_mb) == (64, 0, 257000)
    assert (gpu.max_cpus, gpu.max_gpus) == (48, 10)  # g2: 8 H100 + 2 A100
    assert (cpu.time_limit_min, gpu.time_limit_min, debug.time_limit_min) == (2880, 720, 30)


@pytest.mark.parametrize(
    "gres, gpus",
    [("(null)", 0), ("gpu:4", 4), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:2,gpu:v100:1", 3),
     ("gpu:a100:4(S:0,1),mps:100", 4), ("tmpdisk:100", 0)],
)  # fmt: skip
def test_gpus_are_counted_from_the_generic_resources(gres, gpus):
    assert sinfo.gpu_count(gres) == gpus


@pytest.mark.parametrize(
    "text, minutes",
    [("infinite", None), ("UNLIMITED", None), ("30:00", 30), ("2:00:00", 120),
     ("1-12:00:00", 2160), ("45", 45), ("10:30", 11)],
)  # fmt: skip
def test_time_limits_in_minutes(text, minutes):
    assert sinfo.parse_time_limit(text) == minutes
