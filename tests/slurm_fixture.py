"""The ``slurm_cluster`` fixture: a real one-node SLURM cluster for the whole test session.

Import it from a conftest (``from slurm_fixture import slurm_cluster``) or a test module.
Where SLURM cannot run (not installed, not root) the tests that use it are skipped, unless
AMPSWEEP_REQUIRE_TOOLS names ``slurm`` (or ``all``): CI sets that so a broken install fails
loudly instead of silently skipping the only real-scheduler coverage.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm_cluster.py"


def _load_module():
    # scripts/ is not a package (and must stay importable without the project installed),
    # so load the file directly; registering it lets pickling and re-imports find it.
    name = "slurm_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def tool_required(tool: str) -> bool:
    """Whether AMPSWEEP_REQUIRE_TOOLS (comma-separated, or ``all``) demands ``tool``."""
    wanted = {t.strip().lower() for t in os.environ.get("AMPSWEEP_REQUIRE_TOOLS", "").split(",")}
    return tool in wanted or "all" in wanted


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A started ``SlurmCluster``; use ``cluster.env`` for the client commands."""
    module = _load_module()
    reason = module.SlurmCluster.unavailable_reason()
    if reason is not None:
        if tool_required("slurm"):
            pytest.fail(f"AMPSWEEP_REQUIRE_TOOLS asks for slurm, but {reason}")
        pytest.skip(reason)
    cluster = module.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start(timeout=60)
    try:
        yield cluster
    finally:
        cluster.stop()


def wait_for(what: str, check, timeout: float = 30, poll: float = 0.2):
    """``check()``'s first truthy value, polled until ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def job_state(cluster, job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (no slurmdbd here, so no sacct; finished jobs stay
    visible for MinJobAge)."""
    return dict(re.findall(r"(\w+)=(\S*)", cluster.run("scontrol", "show", "job", "-o", job_id)))


def wait_state(cluster, job_id: str, state: str, timeout: float = 30) -> dict[str, str]:
    """The job's fields once SLURM reports ``state``. SLURM's bookkeeping lags the job's own
    work: a job whose result is already written can still read RUNNING while it exits."""
    seen: dict[str, str] = {}

    def reached():
        seen.update(job_state(cluster, job_id))
        return seen if seen.get("JobState") == state else None

    try:
        return wait_for(f"job {job_id} to be {state}", reached, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last: {seen.get('JobState')} {seen.get('Reason')}") from None
