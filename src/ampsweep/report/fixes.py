"""The config changes the numerics findings propose: a mode named by what it is, asked of the
mode table (never spelled out here), and a loss scale as a config value."""

from __future__ import annotations

import math

from ampsweep.precision import modes


def mode_named(test) -> str:
    """The name of the first mode of the table that passes ``test``."""
    return next(m.name for m in modes.MODES.values() if test(m))


def autocast_mode(dtype: str) -> str:
    """The plain autocast mode of ``dtype``: its math in dtype, its weights in fp32."""
    return mode_named(lambda m: m.autocast and m.dtype == dtype and not m.fp8)


def wide_range_fix() -> str:
    return f"precision={autocast_mode('bf16')} (fp32's range)"


def scale_text(x: float) -> str:
    """A loss scale as a config value (``1048576``, not ``1.04858e+06``); below 1, the power
    of two that every backed-off scale is (``2^-14``, not ``6.10352e-05``)."""
    if x >= 1 and x == int(x):
        return f"{x:.0f}"
    if x > 0 and math.log2(x).is_integer():
        return f"2^{math.log2(x):.0f}"
    return f"{x:g}"
