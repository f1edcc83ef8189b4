"""The ``slurm_cluster`` fixture: a real one-node SLURM cluster for the whole test session.

Import it from a conftest (``from slurm_fixture import slurm_cluster``) or a test module.
Where SLURM cannot run (not installed, not root) the tests that use it are skipped, unless
AMPSWEEP_REQUIRE_TOOLS names ``slurm`` (or ``all``): CI sets that so a broken install fails
loudly instead of silently skipping the only real-scheduler coverage.
"""

from __future__ import annotations

import importlib.util
import os
import sys
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
