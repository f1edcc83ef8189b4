"""An environment variable set for the length of a block, then put back as it was: how a
command hands a setting to the library or the processes it starts (MLflow's progress bar,
the ranks a launcher spawns) without leaving it behind in the caller's process."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def setenv(key: str, value: str | None):
    """``key=value`` inside the block (``None``: leave ``key`` as it is)."""
    if value is None:
        yield
        return
    saved = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved
