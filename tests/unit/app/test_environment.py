"""app/environment.py: what a run records about where it ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampsweep.app import environment
from ampsweep.precision import modes


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
