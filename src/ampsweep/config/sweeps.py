"""The values of a sweep written on a command line, one home for Hydra's sweep grammar: the
sweeper's jobs (``launch.sweeper``) and the commands that examine each job without running a
Hydra sweep (``ampsweep capacity``, ``ampsweep doctor``) ask ``sweep_values`` for them.

Hydra's parser accepts some sweeps that have no value (``range(3,0)``, ``range(0,3,0)``, a
``glob()`` that matches no option) and leaves them to fail later as a traceback; here each is
refused as one line naming the override and the fix. A range of floats is counted and written
in the decimals it was typed in (Hydra's own adds in binary: ``range(0.1,0.7,0.1)`` would give
``0.30000000000000004``).
"""

from __future__ import annotations

import itertools
import math
import random

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, RangeSweep

from ampsweep.config import messages
from ampsweep.config.schema import ConfigError


def is_hydra_override(override: str) -> bool:
    key = override.lstrip("~+").split("=", 1)[0]
    return key.startswith(("hydra.", "hydra/")) or key == "hydra"


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Every job of the overrides, as plain override lists: the product of the comma,
    ``range()`` and ``choice()`` sweeps, as Hydra's basic sweeper makes it. Raises
    ConfigError."""
    try:
        axes = [sweep_values(o) for o in OverridesParser.create().parse_overrides(overrides)]
    except ConfigError:
        raise
    except Exception as err:  # Hydra's parser's, or a glob() here with no config groups
        raise ConfigError(messages.explain(err, overrides, None)) from None
    return [list(job) for job in itertools.product(*axes)]


def sweep_values(o: Override) -> list[str]:
    """``key=value`` for each value of one override: its value, or each of a list,
    ``choice()``, ``range()`` or ``glob()`` sweep (with ``tag``, ``sort`` and ``shuffle``
    as Hydra applies them). Raises ConfigError for a sweep with no value, and for an
    ``interval()``, which has no list of values."""
    key = o.get_key_element()
    if not o.is_sweep_override():
        return [f"{key}={o.get_value_element_as_str()}"]
    if o.is_interval_sweep():
        raise ConfigError(
            f"{o.input_line}: interval() has no list of values to run: it is for a sweeper "
            "that searches (hydra/sweeper=optuna); give the values, e.g. a,b,c or range()"
        )
    value = o.value()
    if isinstance(value, RangeSweep):
        values = [str(v) for v in _range(o, value)]
        if value.shuffle:
            random.shuffle(values)
    else:
        values = list(o.sweep_string_iterator())
    if not values:
        why = _empty_range(value) if isinstance(value, RangeSweep) else _empty_glob(o)
        raise ConfigError(f"{o.input_line}: {why}")
    return [f"{key}={v}" for v in values]


def _range(o: Override, r: RangeSweep) -> list[int] | list[float]:
    """The values of ``range(start, stop, step)``, as Python's range (the stop left out).
    For floats, ``start + i * step`` counted with a tolerance (``range(0.1,0.3,0.1)`` stops
    before 0.3) and rounded to 12 significant digits of the largest bound: what was typed,
    without the error of adding in binary."""
    start, stop, step = r.start, r.stop, r.step
    assert start is not None and stop is not None
    if step == 0:
        raise ConfigError(
            f"{o.input_line}: a range with step 0 never reaches its end: give a step other "
            f"than 0, e.g. range({start},{stop},1)"
        )
    if all(isinstance(x, int) for x in (start, stop, step)):
        return list(range(int(start), int(stop), int(step)))
    count = max(0, math.ceil((stop - start) / step - 1e-9))
    digits = 12 - math.floor(math.log10(max(abs(start), abs(stop), abs(step))))
    return [round(start + i * step, digits) + 0.0 for i in range(count)]  # (+ 0.0: no -0.0)


def _empty_range(r: RangeSweep) -> str:
    assert r.start is not None and r.stop is not None  # (the parser sets both)
    low, high = sorted((r.start, r.stop))
    if low == high:
        return f"an empty range: it stops where it starts: e.g. range({low},{high + 3})"
    way = "up" if r.step > 0 else "down"
    return (
        f"an empty range: a step of {r.step} from {r.start} never goes {way} to {r.stop}: "
        f"e.g. range({low},{high}) counts up, range({high},{low},-1) down"
    )


def _empty_glob(o: Override) -> str:
    group, loader = o.key_or_group, o.config_loader
    options = loader.get_group_options(group) if loader is not None else []
    if not options:
        return (
            f"glob() picks options of a config group and {group} is not one: give the "
            "values, e.g. a,b,c"
        )
    return f"glob() matches no option of config group {group}: choose from {', '.join(options)}"
