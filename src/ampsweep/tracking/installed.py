"""What is installed in this Python environment, read once per process and environment.

A logged model pins the versions of what loading it needs (``tracking.logged_model``), and a run
of a ``_target_`` component records the distribution its code came from
(``runner.environment.target_provenance``): the installed distributions that provide its
top-level package. ``importlib.metadata.packages_distributions`` answers that for every
package at once, through the path of every file of every distribution (the importlib_metadata
backport installed beside MLflow stats each one): 0.4-0.7 s here, which a run paid for its
model and again for its data set, and a sweep on every job. One package needs only each
distribution's declared top-level names or, where it declares none, its RECORD's text: 0.03-
0.06 s, once per package, process and environment. Nothing here imports MLflow: an untracked
run records these facts too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import re
import sys


def environment_key() -> tuple:
    """What the installed distributions depend on, cheap to read: the interpreter and the
    modification time of each folder on ``sys.path`` (installing, upgrading or removing a
    distribution adds or removes a ``*.dist-info`` entry in its folder)."""
    folders = []
    for entry in sys.path:
        with contextlib.suppress(OSError):
            folders.append((entry, os.stat(entry or ".").st_mtime_ns))
    return (sys.executable, sys.version, tuple(folders))


def version(name: str) -> str | None:
    """The installed version of distribution ``name``, None if it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def distributions_of(package: str) -> list[str]:
    """The installed distributions that provide top-level package ``package`` (none for a
    local module or a built-in one), as ``importlib.metadata.packages_distributions`` names
    them."""
    return list(_providers(package, environment_key()))


@functools.lru_cache(maxsize=256)
def _providers(package: str, environment: tuple) -> tuple[str, ...]:
    # What packages_distributions reads of each distribution: its declared top-level names
    # (top_level.txt), else the top-level names of the .py files it installed (RECORD, or
    # the file list of an old egg-info install), here matched for one package without
    # building a path per file.
    in_record = re.compile(rf"^{re.escape(package)}(?:/[^,\n]*)?\.py,", re.MULTILINE)
    found = []
    for dist in importlib.metadata.distributions():
        declared = (dist.read_text("top_level.txt") or "").split()
        if declared:
            provides = package in declared
        elif (record := dist.read_text("RECORD")) is not None:
            provides = in_record.search(record) is not None
        else:
            provides = package in {
                f.parts[0] if len(f.parts) > 1 else f.with_suffix("").name
                for f in dist.files or ()
                if f.suffix == ".py"
            }
        if provides:
            found.append(dist.metadata["Name"])
    return tuple(dict.fromkeys(found))
