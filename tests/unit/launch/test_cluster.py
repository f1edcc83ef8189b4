"""launch/cluster.py: sinfo's text read into partitions with their nodes, GPUs counted from
the generic resources, time limits in minutes; the mount holding a path, the nodes that are
other machines, and files on a file system only this machine sees refused when a SLURM
sweep's jobs run elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ampsweep.config.schema import ConfigError
from ampsweep.launch import cluster
from ampsweep.launch.cluster import parse_sinfo
from unit.launch.test_slurm import SINFO


def test_sinfo_is_read_into_partitions_with_their_nodes():
    parts = cluster.parse_sinfo(SINFO)
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
    assert cluster.gpu_count(gres) == gpus


@pytest.mark.parametrize(
    "text, minutes",
    [("infinite", None), ("UNLIMITED", None), ("30:00", 30), ("2:00:00", 120),
     ("1-12:00:00", 2160), ("45", 45), ("10:30", 11)],
)  # fmt: skip
def test_time_limits_in_minutes(text, minutes):
    assert cluster.parse_time_limit(text) == minutes


MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
30 22 0:40 / /home rw,relatime shared:9 - nfs4 fs:/home rw,vers=4.2
31 22 0:41 / /scratch rw,relatime shared:10 - lustre 10.0.0.5@tcp:/scratch rw
"""


def test_the_mount_holding_a_path_is_the_longest_match():
    assert cluster.mount_of(Path("/home/me/sweeps/x"), MOUNTINFO) == ("/home", "nfs4")
    assert cluster.mount_of(Path("/dev/shm/run"), MOUNTINFO) == ("/dev/shm", "tmpfs")
    assert cluster.mount_of(Path("/tmp/not/yet/made"), MOUNTINFO) == ("/", "ext4")
    assert cluster.mount_of(Path("/scratch"), MOUNTINFO) == ("/scratch", "lustre")


def test_nodes_that_are_this_machine_are_not_remote():
    names = parse_sinfo(
        "p*|n1|n1|127.0.0.1|2|(null)|1000|infinite\n"
        f"p*|{os.uname().nodename}|{os.uname().nodename}|10.9.9.9|2|(null)|1000|infinite\n"
        "p*|far|far.example|10.9.9.10|2|(null)|1000|infinite\n"
    )["p"]
    assert cluster.remote_nodes(names) == ["far"]


def _remote():
    return parse_sinfo("p*|far1|far1|10.9.9.1|2|(null)|1000|infinite\n")["p"]


def test_files_on_a_file_system_only_this_machine_sees_are_refused_when_jobs_run_elsewhere():
    with pytest.raises(ConfigError) as err:
        cluster.check_shared({"hydra.sweep.dir": Path("/dev/shm/sweep")}, _remote(), MOUNTINFO)
    assert str(err.value) == (
        "hydra.sweep.dir=/dev/shm/sweep: it is on tmpfs (/dev/shm), which only this machine "
        "sees, but the jobs run on other machines (far1): set hydra.sweep.dir to a folder on a "
        "file system the nodes share (NFS, Lustre, ...)"
    )
    with pytest.raises(ConfigError, match=r"^tracking.uri=/dev/shm/m.db: .*use a tracking server"):
        cluster.check_shared({"tracking.uri": Path("/dev/shm/m.db")}, _remote(), MOUNTINFO)
    # the root file system of this machine: probably not shared, said as a note
    notes = cluster.check_shared({"trainer.checkpoint_dir": Path("/tmp/c")}, _remote(), MOUNTINFO)
    assert notes == [
        "trainer.checkpoint_dir=/tmp/c is on this machine's root file system (ext4); the jobs "
        "run on far1: unless they mount it too, put it on a shared file system"
    ]
    assert cluster.check_shared({"hydra.sweep.dir": Path("/home/u/s")}, _remote(), MOUNTINFO) == []
    # jobs on this machine see every file system
    local = parse_sinfo("p*|n|n|127.0.0.1|2|(null)|1000|infinite\n")["p"]
    assert cluster.check_shared({"hydra.sweep.dir": Path("/dev/shm/s")}, local, MOUNTINFO) == []


def test_this_machines_own_mounts_are_read(tmp_path):
    point, fstype = cluster.mount_of(tmp_path)
    assert point and fstype and Path(point) in [tmp_path, *tmp_path.parents]
