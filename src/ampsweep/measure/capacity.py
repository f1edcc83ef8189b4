"""Capacity: the largest batch a precision mode fits in a memory budget, predicted and searched.

A training step's memory is, to a good approximation, a part that does not depend on the batch
(parameters, gradients, optimizer state, autocast's low-precision copies of the weights) plus
the tensors autograd saves for backward, which grow linearly with the batch. Every run measures
both (``measure.cost``), so the largest batch that fits a budget follows without trying it::

    max batch = floor((budget - model bytes) / activation bytes per sample)

On a CUDA GPU, ``ampsweep capacity`` also finds the real largest batch: doubling the batch
until a step runs out of memory, then bisecting between the last batch that fitted and the
first that did not (``search``). The search is a pure function of a ``fits(batch)`` probe, so
its logic is tested without a GPU.

No torch here: the report, which imports no torch, predicts the largest batch for a budget
given on its command line from the numbers the runs recorded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

# Metric names a run records (the report reads them back)
BYTES_PER_SAMPLE = "mem/activation_bytes_per_sample"
MODEL_MIB = "mem/model_mib"  # the batch-independent part, all of it
BUDGET_GIB = "mem/budget_gib"  # the budget max_batch_predicted assumes (CUDA: the GPU's memory)
MAX_BATCH_PREDICTED = "mem/max_batch_predicted"
MAX_BATCH_MEASURED = "mem/max_batch_measured"  # ampsweep capacity, on a CUDA GPU

MIB, GIB = 1024**2, 1024**3
UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


class SizeError(ValueError):
    """Not a memory size."""


def parse_size(text: str) -> int:
    """Bytes of a size as people write it: ``80GiB``, ``80 GB`` (decimal), ``512MiB``,
    ``1.5TiB``, or a plain number of bytes."""
    m = SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS:
        raise SizeError(
            "not a memory size: write a number and a unit, e.g. 80GiB, 40GB or 512MiB "
            "(GiB/MiB: powers of 1024; GB/MB: powers of 1000)"
        )
    value = float(m.group(1)) * UNITS[unit]
    if value < 1:
        raise SizeError("not a memory size: it must be at least one byte, e.g. 80GiB")
    return int(value)


def format_size(nbytes: float) -> str:
    """``80 GiB``, ``1.5 GiB``, ``512 MiB``: a budget as the report names it."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def predict_max_batch(budget: float, model_bytes: float, bytes_per_sample: float) -> int | None:
    """The largest batch whose memory fits ``budget``: 0 when the model alone does not fit;
    None when nothing was measured."""
    if not (bytes_per_sample > 0 and math.isfinite(bytes_per_sample)) or not budget > 0:
        return None
    return max(0, math.floor((budget - model_bytes) / bytes_per_sample))


def per_sample(bytes_at: dict[int, float]) -> tuple[float, float]:
    """(batch-independent bytes, bytes per sample) of a quantity measured at two batch sizes:
    the line through the two points. The batch-independent part is what autograd saves whatever
    the batch: autocast's low-precision copies of the weights."""
    (b1, y1), (b2, y2) = sorted(bytes_at.items())[:2]
    slope = (y2 - y1) / (b2 - b1)
    return max(0.0, y1 - slope * b1), max(0.0, slope)


# ---------------------------------------------------------------- the search


@dataclass
class Search:
    """The outcome of a largest-batch search: every batch tried, in order, and whether it fit."""

    largest: int  # the largest batch that fit (0: not even one sample)
    tried: list[tuple[int, bool]] = field(default_factory=list)
    limit_reached: bool = False  # every batch up to the search's limit fit

    @property
    def first_failure(self) -> int | None:
        failed = [b for b, ok in self.tried if not ok]
        return min(failed) if failed else None


def search(fits: Callable[[int], bool], start: int, limit: int) -> Search:
    """The largest batch ``b <= limit`` for which ``fits(b)``, assuming that whatever fits,
    every smaller batch fits too: double from ``start`` until a batch fails (halve, if ``start``
    itself fails), then bisect between the last that fit and the first that failed, to the exact
    batch. ``fits`` must leave no memory behind (the caller frees it between tries)."""
    if start < 1 or limit < start:
        raise ValueError(f"search needs 1 <= start <= limit, got start={start}, limit={limit}")
    result = Search(0)

    def tried(b: int) -> bool:
        ok = bool(fits(b))
        result.tried.append((b, ok))
        return ok

    low, high = 0, None  # low fits (0 trivially), high fails
    b = start
    if tried(b):
        low = b
        while high is None:
            if low >= limit:
                result.limit_reached = True
                result.largest = low
                return result
            b = min(2 * low, limit)
            if tried(b):
                low = b
            else:
                high = b
    else:
        high = b
        while low == 0 and high > 1:
            b = high // 2
            if tried(b):
                low = b
            else:
                high = b
        if low == 0:
            return result  # batch 1 does not fit
    while high - low > 1:
        mid = (low + high) // 2
        if tried(mid):
            low = mid
        else:
            high = mid
    result.largest = low
    return result
