"""app/environment.py: what a run records about where it ran."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import sys
from pathlib import Path

import pytest
import torch

from ampsweep.precision import modes
from ampsweep.runner import environment


def test_the_half_precision_isa_tag_names_the_mode_tables_native_flags_this_cpu_has():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo (not Linux)")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    native = {f for names in modes.NATIVE_CPU_FLAGS.values() for f in names}
    assert set(environment.cpu_half_precision_isa()) == flags & native


def test_a_targets_provenance_names_its_distribution_or_its_files_digest(tmp_path, monkeypatch):
    from_torch = environment.target_provenance(torch.nn.Linear)
    assert from_torch["version"] == f"torch {importlib.metadata.version('torch')}"
    (tmp_path / "my_local_model.py").write_text("def build():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_local_model")
    monkeypatch.setitem(sys.modules, "my_local_model", module)
    local = environment.target_provenance(module.build)
    assert "version" not in local  # a module of the user's own folder: no distribution
    digest = hashlib.sha256((tmp_path / "my_local_model.py").read_bytes()).hexdigest()
    assert local["sha256"] == digest
