"""app/shared_fs.py: the mount holding a path, the nodes that are other machines, and files on a
file system only this machine sees refused when a SLURM sweep's jobs run elsewhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ampsweep.config.schema import ConfigError
from ampsweep.launch import shared_fs
from ampsweep.launch.sinfo import parse_sinfo

MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
30 22 0:40 / /home rw,relatime shared:9 - nfs4 fs:/home rw,vers=4.2
31 22 0:41 / /scratch rw,relatime shared:10 - lustre 10.0.0.5@tcp:/scratch rw
"""


def test_the_mount_holding_a_path_is_the_longest_match():
    assert shared_fs.mount_of(Path("/home/me/sweeps/x"), MOUNTINFO) == ("/home", "nfs4")
    assert shared_fs.mount_of(Path("/dev/shm/run"), MOUNTINFO) == ("/dev/shm", "tmpfs")
    assert shared_fs.mount_of(Path("/tmp/not/yet/made"), MOUNTINFO) == ("/", "ext4")
    assert shared_fs.mount_of(Path("/scratch"), MOUNTINFO) == ("/scratch", "lustre")


def test_nodes_that_are_this_machine_are_not_remote():
    names = parse_sinfo(
        "p*|n1|n1|127.0.0.1|2|(null)|1000|infinite\n"
        f"p*|{os.uname().nodename}|{os.uname().nodename}|10.9.9.9|2|(null)|1000|infinite\n"
        "p*|far|far.example|10.9.9.10|2|(null)|1000|infinite\n"
    )["p"]
    assert shared_fs.remote_nodes(names) == ["far"]


def _remote():
    return parse_sinfo("p*|far1|far1|10.9.9.1|2|(null)|1000|infinite\n")["p"]


def test_files_on_a_file_system_only_this_machine_sees_are_refused_when_jobs_run_elsewhere():
    with pytest.raises(ConfigError) as err:
        shared_fs.check_shared({"hydra.sweep.dir": Path("/dev/shm/sweep")}, _remote(), MOUNTINFO)
    assert str(err.value) == (
        "hydra.sweep.dir=/dev/shm/sweep: it is on tmpfs (/dev/shm), which only this machine "
        "sees, but the jobs run on other machines (far1): set hydra.sweep.dir to a folder on a "
        "file system the nodes share (NFS, Lustre, ...)"
    )
    with pytest.raises(ConfigError, match=r"^tracking.uri=/dev/shm/m.db: .*use a tracking server"):
        shared_fs.check_shared({"tracking.uri": Path("/dev/shm/m.db")}, _remote(), MOUNTINFO)
    # the root file system of this machine: probably not shared, said as a note
    notes = shared_fs.check_shared({"trainer.checkpoint_dir": Path("/tmp/c")}, _remote(), MOUNTINFO)
    assert notes == [
        "trainer.checkpoint_dir=/tmp/c is on this machine's root file system (ext4); the jobs "
        "run on far1: unless they mount it too, put it on a shared file system"
    ]
    assert (
        shared_fs.check_shared({"hydra.sweep.dir": Path("/home/u/s")}, _remote(), MOUNTINFO) == []
    )
    # jobs on this machine see every file system
    local = parse_sinfo("p*|n|n|127.0.0.1|2|(null)|1000|infinite\n")["p"]
    assert shared_fs.check_shared({"hydra.sweep.dir": Path("/dev/shm/s")}, local, MOUNTINFO) == []


def test_this_machines_own_mounts_are_read(tmp_path):
    point, fstype = shared_fs.mount_of(tmp_path)
    assert point and fstype and Path(point) in [tmp_path, *tmp_path.parents]
