#!/usr/bin/env python3
"""A throwaway one-node SLURM cluster (munged + slurmctld + slurmd) living in one folder.

Tests and local experiments need a *real* scheduler (sbatch/srun/requeue/signals) without
touching /etc, /var or systemd, and several such clusters must be able to coexist (parallel
test sessions), so everything -- config, munge key and socket, state, spool, logs, pid
files -- is inside the folder given by the caller, and the ports are picked free at start.

Usage:
    python scripts/slurm_cluster.py start DIR   # prints `export SLURM_CONF=...` for eval
    python scripts/slurm_cluster.py status DIR
    python scripts/slurm_cluster.py stop DIR

or from Python:
    cluster = SlurmCluster(folder); cluster.start()
    subprocess.run(["sbatch", ...], env={**os.environ, **cluster.env})
    cluster.stop()

Needs (Debian/Ubuntu): apt-get install slurmctld slurmd slurm-client munge; run as root.
There is no slurmdbd, so plain `sacct` fails: follow jobs with `squeue` / `scontrol show job`
(kept for MinJobAge=300 s after they end) or `sacct --completion` (finished jobs only).
Dependency-free on purpose: it is imported by the test fixtures and run by CI scripts
before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sinfo", "sbatch", "squeue", "scontrol", "scancel", "srun")
INSTALL_HINT = "apt-get install slurmctld slurmd slurm-client munge"
# Set in the daemons' environment only (slurmstepd inherits it from slurmd), so that stop()
# can find this cluster's leftover step daemons without ever matching a user's shell that
# merely exported SLURM_CONF.
MARKER = "AMPSWEEP_SLURM_CLUSTER"
# sun_path is 108 bytes on Linux; munged also creates "<socket>.lock" next to it.
MAX_SOCKET_PATH = 100


def _free_port() -> int:
    # Bound on all addresses because slurmctld/slurmd listen on INADDR_ANY; the tiny race
    # between closing here and the daemon binding is acceptable for tests.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"  ({path}: {exc.strerror})"
    return "\n".join("  " + line for line in text[-lines:]) or f"  ({path} is empty)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as gone since it holds no resources we need.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return False


class SlurmCluster:
    """One-node SLURM cluster on 127.0.0.1 whose every file lives under ``folder``."""

    partition = "debug"

    def __init__(self, folder: str | os.PathLike, cpus: int | None = None):
        self.folder = Path(folder).resolve()
        # The host's count, as `slurmd -C` reports it; SlurmdParameters=config_overrides keeps
        # the node usable if a caller declares a different number.
        self.cpus = cpus or os.cpu_count() or 1
        self.node = socket.gethostname().split(".")[0] or "localhost"
        self.conf = self.folder / "slurm.conf"
        self.log_dir = self.folder / "log"
        self.run_dir = self.folder / "run"
        self.munge_dir = self.folder / "munge"

    # -- what clients need -------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """Variables a client (sbatch, squeue, submitit, ...) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True, timeout: float = 30) -> str:
        """Run a SLURM client command against this cluster and return its stdout."""
        proc = subprocess.run(
            list(args),
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        return proc.stdout

    # -- availability ----------------------------------------------------------------------

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None if a cluster can be started here, else a one-line reason (for pytest.skip)."""
        for exe in (*DAEMONS, *CLIENTS):
            if shutil.which(exe) is None and not Path("/usr/sbin", exe).exists():
                return f"{exe} not found: {INSTALL_HINT}"
        if os.geteuid() != 0:
            # slurmd must be root to switch to the job's user and to own the munge key.
            return "a local SLURM cluster needs root (slurmd runs as root)"
        try:
            proc = subprocess.run(
                [cls._exe("slurmctld"), "-V"], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"slurmctld cannot run here: {exc}"
        if proc.returncode != 0:
            return f"slurmctld -V failed: {(proc.stderr or proc.stdout).strip()[:200]}"
        return None

    @staticmethod
    def _exe(name: str) -> str:
        # /usr/sbin is often missing from PATH for non-login shells and CI steps.
        return shutil.which(name) or str(Path("/usr/sbin", name))

    # -- files -----------------------------------------------------------------------------

    def _pidfile(self, daemon: str) -> Path:
        return self.run_dir / f"{daemon}.pid"

    def _logfile(self, daemon: str) -> Path:
        return self.log_dir / f"{daemon}.log"

    def _munge_socket(self) -> Path:
        path = self.munge_dir / "munge.socket"
        if len(str(path)) <= MAX_SOCKET_PATH:
            return path
        # Deep pytest tmp folders can exceed the unix-socket path limit; then the socket
        # (only) goes to a short private dir, remembered in the folder so stop() cleans it.
        link = self.folder / "munge_socket_dir"
        if not link.exists():
            link.write_text(tempfile.mkdtemp(prefix="munge-"))
        return Path(link.read_text().strip()) / "munge.socket"

    def _real_memory_mb(self) -> int:
        # slurmd measures memory with the same sysconf call; a few MB of slack avoids the
        # node draining for "Low RealMemory" after rounding differences.
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
        return max(1, total - 16)

    def _write_config(self) -> None:
        ctld_port, slurmd_port = _free_port(), _free_port()
        while slurmd_port == ctld_port:
            slurmd_port = _free_port()
        state, spool = self.folder / "state", self.folder / "spool"
        for d in (state, spool, self.log_dir, self.run_dir):
            d.mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=ampsweep",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire is also how long a requeued job is held before it may start again
            # (default 120 s); keep it short so requeue tests take seconds.
            f"AuthInfo=socket={self._munge_socket()},cred_expire=5",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={spool}",
            f"SlurmctldPidFile={self._pidfile('slurmctld')}",
            f"SlurmdPidFile={self._pidfile('slurmd')}",
            f"SlurmctldLogFile={self._logfile('slurmctld')}",
            f"SlurmdLogFile={self._logfile('slurmd')}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # Containers rarely give us a writable cgroup hierarchy or systemd, so track job
            # processes through /proc and do no binding.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # Without slurmdbd, plain `sacct` only says "accounting storage is disabled"; a
            # completion log still lets `sacct --completion` report finished jobs for good.
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.folder / 'jobcomp.txt'}",
            "MpiDefault=none",
            # Debian's default mailer is usually absent; without this slurmctld logs an error.
            "MailProg=/bin/true",
            # Raising rlimits to the submitter's values can fail in containers.
            "PropagateResourceLimits=NONE",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            # Pending jobs whose begin time passes (e.g. requeued ones) are only looked at by
            # the periodic loops (60 s / 30 s by default): poll every second instead.
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            # CPUs only: with memory as a consumable resource a job without --mem would take
            # the whole node's memory and serialize everything.
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # Trust the node line below instead of draining on small hardware mismatches.
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "JobRequeue=1",
            # Signals before kill (--signal=B:USR1@N, scancel) matter more than a long grace.
            "KillWait=5",
            # No slurmdbd/sacct: finished jobs must stay visible to `scontrol show job`.
            "MinJobAge=300",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            f"NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={self.node} "
            f"CPUs={self.cpus} RealMemory={self._real_memory_mb()} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node} Default=YES "
            "MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    # -- lifecycle -------------------------------------------------------------------------

    def _daemon_env(self) -> dict[str, str]:
        return {**os.environ, **self.env, MARKER: str(self.folder)}

    def _start_munged(self) -> None:
        # munged refuses group/world-writable key and socket dirs, and wants the socket dir
        # traversable by everyone (any user's client must reach it): hence exactly 0755.
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        self.munge_dir.chmod(0o755)
        sock = self._munge_socket()
        sock.parent.mkdir(parents=True, exist_ok=True)
        sock.parent.chmod(0o755)
        key = self.munge_dir / "munge.key"
        if not key.exists():
            # A fresh random key per cluster: nothing outside the folder can authenticate.
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            key.chmod(0o600)
        proc = subprocess.run(
            [
                self._exe("munged"),
                # munged insists that every directory above its socket be traversable by all
                # users; the caller's folder may well be private (pytest's tmp dirs are 0700).
                # Only root talks to this cluster, so downgrade that check to a warning.
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={self._pidfile('munged')}",
                f"--log-file={self._logfile('munged')}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
            ],
            env=self._daemon_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"munged exited with {proc.returncode}: {proc.stderr.strip()}")

    def _start_daemon(self, name: str, *extra: str) -> None:
        # The daemons fork into the background themselves and write their pid files, so
        # the CLI `start` can exit while the cluster keeps running.
        proc = subprocess.run(
            [self._exe(name), "-f", str(self.conf), *extra],
            env=self._daemon_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{name} exited with {proc.returncode}: {proc.stderr.strip()}\n"
                + self._log_report()
            )

    def _log_report(self) -> str:
        return "\n".join(
            f"--- {name} log ({self._logfile(name)}):\n{_tail(self._logfile(name))}"
            for name in DAEMONS
        )

    def _wait(self, ready, what: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"SLURM cluster in {self.folder}: {what}\n{self._log_report()}")

    def _node_state(self) -> str:
        try:
            out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return ""
        return out.strip()

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Write the config, start munged, slurmctld and slurmd, and wait for an idle node."""
        if self.running():
            raise RuntimeError(f"a cluster is already running in {self.folder}")
        deadline = time.monotonic() + timeout
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_config()
        try:
            self._start_munged()
            sock = self._munge_socket()
            self._wait(sock.exists, "munged did not create its socket", deadline)
            # -i: ignore state left by an earlier run in the same folder.
            self._start_daemon("slurmctld", "-i")
            self._wait(
                lambda: "UP" in self.run("scontrol", "ping", check=False, timeout=10),
                "slurmctld did not answer `scontrol ping`",
                deadline,
            )
            self._start_daemon("slurmd", "-N", self.node)
            self._wait(
                lambda: self._node_state() == "idle",
                f"node {self.node} not idle (sinfo says {self._node_state()!r})",
                deadline,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def _pid(self, daemon: str) -> int | None:
        try:
            return int(self._pidfile(daemon).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def running(self) -> dict[str, int]:
        """The daemons of this cluster that are alive, by name, with their pids."""
        pids = {name: self._pid(name) for name in DAEMONS}
        return {name: pid for name, pid in pids.items() if pid and _pid_alive(pid)}

    def _marked_processes(self) -> list[int]:
        """Live processes started by this cluster's daemons (slurmstepd, strays)."""
        needle = f"{MARKER}={self.folder}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in environ and _pid_alive(int(entry.name)):
                found.append(int(entry.name))
        return found

    @staticmethod
    def _kill_and_wait(pids: list[int], timeout: float = 10) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids:
            if _pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def stop(self, timeout: float = 20) -> None:
        """Cancel all jobs, stop the daemons and any leftover step daemons. Idempotent."""
        alive = self.running()
        if {"slurmctld", "slurmd"} <= alive.keys():
            # With proctrack/linuxproc, killing slurmd does not kill running jobs, so let
            # the scheduler end them first (bounded: KillWait is 5 s).
            try:
                jobs = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).split()
                if jobs:
                    self.run("scancel", *jobs, check=False, timeout=10)
                    end = time.monotonic() + timeout / 2
                    while (
                        time.monotonic() < end
                        and self.run("squeue", "-h", "-o", "%i", check=False, timeout=10).split()
                    ):
                        time.sleep(0.25)
            except (subprocess.TimeoutExpired, OSError):
                pass
        # slurmd before slurmctld (it reports to it), munged last (both authenticate via it).
        for name in ("slurmd", "slurmctld", "munged"):
            pid = alive.get(name)
            if pid:
                self._kill_and_wait([pid], timeout=timeout / 4)
        self._kill_and_wait(self._marked_processes(), timeout=5)
        for name in DAEMONS:
            self._pidfile(name).unlink(missing_ok=True)
        link = self.folder / "munge_socket_dir"
        if link.exists():
            shutil.rmtree(link.read_text().strip(), ignore_errors=True)
            link.unlink()

    def status(self) -> str:
        alive = self.running()
        lines = [
            f"{name}: " + (f"running (pid {alive[name]})" if name in alive else "stopped")
            for name in DAEMONS
        ]
        if "slurmctld" in alive:
            lines.append(self.run("sinfo", check=False, timeout=10).rstrip())
            lines.append(self.run("squeue", check=False, timeout=10).rstrip())
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("folder", help="folder holding all of the cluster's files")
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    if args.action == "start" and (reason := SlurmCluster.unavailable_reason()):
        print(f"cannot start a SLURM cluster: {reason}", file=sys.stderr)
        return 2
    cluster = SlurmCluster(args.folder)
    if args.action == "start":
        cluster.start(timeout=args.timeout)
        for key, value in cluster.env.items():
            print(f"export {key}={shlex.quote(value)}")
    elif args.action == "stop":
        cluster.stop()
    else:
        print(cluster.status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
