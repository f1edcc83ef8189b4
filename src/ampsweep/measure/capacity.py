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

The step's peak, part by part (``mem/<part>_mib``: ``Breakdown``), predicts the same parts at
another batch and in every other mode without running them (``Breakdown.at``), and so the
largest batch of each mode for a budget (``Breakdown.max_batch``).

No torch here: the report, which imports no torch, predicts the largest batch for a budget
given on its command line from the numbers the runs recorded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ampsweep.precision import modes

# Metric names a run records (the report reads them back)
BYTES_PER_SAMPLE = "mem/activation_bytes_per_sample"
MODEL_MIB = "mem/model_mib"  # the batch-independent part, all of it
BUDGET_GIB = "mem/budget_gib"  # the budget max_batch_predicted assumes (CUDA: the GPU's memory)
MAX_BATCH_PREDICTED = "mem/max_batch_predicted"
MAX_BATCH_MEASURED = "mem/max_batch_measured"  # ampsweep capacity, on a CUDA GPU
STEP_PEAK = "mem/step_peak_mib"  # the measured peak of one training step
# The parts of that peak, each recorded as mem/<part>_mib; ``other`` is the peak minus the rest
PARTS = (
    "params", "grads", "optimizer", "master_weights", "autocast_cache", "activations",
    "activation_grads", "fp8", "other",
)  # fmt: skip
# The parts a larger batch leaves as they are (the rest grow with it)
FIXED_PARTS = ("params", "grads", "optimizer", "master_weights", "autocast_cache", "fp8")
# What older runs recorded: the autocast cache under its first name; all the bytes saved for
# backward (the cache among them) where the activations alone are not recorded
OLD_CACHE, SAVED = "mem/weight_copies_mib", "mem/activation_mib"
AT_OPTIMIZER = "mem/step_peak_at_optimizer"  # 1.0: the peak fell in the optimizer's step
# Then, what its step allocated and still held (its intermediate results), within ``optimizer``
INTERMEDIATES = "mem/optimizer_intermediates_mib"

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


# ---------------------------------------------------------------- the step's parts, predicted


def part_metric(part: str) -> str:
    return f"mem/{part}_mib"


def _param_bytes(mode: modes.PrecisionMode) -> int:
    """Bytes of one parameter element (and of its gradient and optimizer state)."""
    return 2 if mode.pure else 4


def _state_bytes(mode: modes.PrecisionMode, master_weights: bool) -> int:
    """Bytes of one element of the optimizer's state: fp32 beside fp32 master weights."""
    return 4 if master_weights else _param_bytes(mode)


def _act_bytes(mode: modes.PrecisionMode) -> int:
    """Bytes of one element saved for backward: a 16-bit float in every mode that computes in
    one (autocast saves the outputs of its matmuls and convolutions in their dtype)."""
    return 2 if mode.half else 4


@dataclass(frozen=True)
class Breakdown:
    """A training step's peak memory, part by part, in MiB, of ``mode`` at ``batch``: measured
    by a run, or predicted from one (``measured`` False)."""

    mode: str
    batch: int
    parts: dict[str, float]
    measured: bool = True
    estimated: tuple[str, ...] = ()  # parts predicted without a measurement of their kind
    # The peak fell in the optimizer's step, after backward freed what it saved (the parts
    # then hold no activations, and ``optimizer`` its step's ``intermediates`` beside its
    # state); ``saved``: the activations the step saved for backward (MiB), which grow with
    # the batch and make the peak of a large enough batch fall in backward instead, beside
    # ``copies``, autocast's weight copies saved with them.
    at_optimizer: bool = False
    saved: float = 0.0
    copies: float = 0.0
    intermediates: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def per_sample(self) -> float:
        """The activation bytes one sample adds."""
        grows = self.saved if self.at_optimizer else self.parts.get("activations", 0.0)
        return grows * MIB / self.batch if self.batch else 0.0

    def share(self, *parts: str) -> float:
        return sum(self.parts.get(p, 0.0) for p in parts) / self.total if self.total else 0.0

    @property
    def master_weights(self) -> bool:
        """Whether its optimizer keeps fp32 master weights (``precision.master_weights``)."""
        return self.parts.get("master_weights", 0.0) > 0

    def at(
        self, batch: int | None = None, mode: str | None = None, master_weights: bool | None = None
    ) -> Breakdown:
        """The same step at another ``batch`` and in another ``mode``, not run: parameters,
        gradients and optimizer state do not grow with the batch and take their mode's dtype;
        the activations (what autograd saves beyond the weight copies) grow in proportion to
        the batch and take the mode's compute dtype, and so do the gradients of activations in
        flight; the autocast cache exists in an autocast mode only (predicted from fp32 as a
        16-bit copy of every parameter: an upper bound, only matmul and convolution weights
        are cast); ``other`` (temporaries, workspace) scales with the activations.
        ``master_weights`` (a pure mode; default: as measured): fp32 copies of the weights
        (4 B each) and the optimizer's state in fp32."""
        batch = self.batch if batch is None else batch
        out = self._at_batch(batch)
        mode = mode or self.mode
        masters = self.master_weights if master_weights is None else master_weights
        masters = masters and modes.MODES[mode].pure
        if mode == self.mode and masters == self.master_weights:
            return out
        return out._in_mode(mode, masters)

    def _at_batch(self, batch: int) -> Breakdown:
        p = dict(self.parts)
        grow = batch / self.batch if self.batch else 1.0
        saved = self.saved * grow
        intermediates = self.intermediates
        if self.at_optimizer:  # the optimizer's peak, unless backward's grows beyond it
            backward = self.held + p.get("fp8", 0.0) + self.copies + saved
            if backward > self.total:
                state = p.get("optimizer", 0.0) - intermediates
                p = {**p, "optimizer": state, "autocast_cache": self.copies, "activations": saved}
                p["other"], intermediates = 0.0, 0.0
        else:
            for part in ("activations", "activation_grads", "other"):
                p[part] = p.get(part, 0.0) * grow
        same = self.measured and batch == self.batch
        return replace(
            self, batch=batch, parts=p, measured=same, saved=saved, intermediates=intermediates
        )

    @property
    def held(self) -> float:
        """The weights, gradients, optimizer state and master weights (MiB): what the model
        holds whatever the batch, without the optimizer's intermediate results."""
        held = ("params", "grads", "optimizer", "master_weights")
        return sum(self.parts.get(k, 0.0) for k in held) - self.intermediates

    def _in_mode(self, name: str, masters: bool = False) -> Breakdown:
        src, dst = modes.MODES[self.mode], modes.MODES[name]
        p, guessed = self.parts, set(self.estimated)
        weights = _param_bytes(dst) / _param_bytes(src)
        state = _state_bytes(dst, masters) / _state_bytes(src, self.master_weights)
        elements = p.get("params", 0.0) / _param_bytes(src)  # in Mi-elements
        acts = _act_bytes(dst) / _act_bytes(src)
        out = {part: p.get(part, 0.0) * weights for part in ("params", "grads")}
        out["optimizer"] = p.get("optimizer", 0.0) * state
        out["master_weights"] = 4.0 * elements if masters else 0.0
        cache = p.get("autocast_cache", 0.0)
        if dst.autocast and not (src.autocast and cache):
            cache = 2.0 * elements
            guessed.add("autocast_cache")
        out["autocast_cache"] = cache if dst.autocast else 0.0
        fp8 = p.get("fp8", 0.0)
        if dst.fp8 and not (src.fp8 and fp8):
            fp8 = 1.0 * elements  # an fp8 copy of every weight (only Linear layers convert)
            guessed.add("fp8")
        out["fp8"] = fp8 if dst.fp8 else 0.0
        out["activations"] = p.get("activations", 0.0) * acts
        out["activation_grads"] = p.get("activation_grads", 0.0) * acts
        # what is left beside the optimizer's step takes its state's dtype; backward's, the
        # activations' (older runs' other: the optimizer's intermediate results)
        out["other"] = p.get("other", 0.0) * (state if self.at_optimizer else acts)
        copies = 0.0
        if self.at_optimizer:  # no cache is live in the optimizer's step; backward holds one
            copies = out["autocast_cache"] if self.copies == 0.0 else self.copies
            copies = copies if dst.autocast else 0.0
            out["autocast_cache"] = 0.0
        kept = tuple(sorted(g for g in guessed if out.get(g) or (g == "autocast_cache" and copies)))
        saved, intermediates = self.saved * acts, self.intermediates * state
        if self.at_optimizer:  # master weights' step casts the gradients to fp32, freeing them
            extra = 2.0 * elements * (int(masters) - int(self.master_weights))
            out["optimizer"], intermediates = out["optimizer"] + extra, intermediates + extra
        return Breakdown(
            name, self.batch, out, False, kept, self.at_optimizer, saved, copies, intermediates
        )

    def max_batch(self, budget: float, mode: str | None = None) -> int | None:
        """The largest batch whose predicted step fits ``budget`` bytes in ``mode`` (default:
        this one): 0 when not even one sample fits; None when nothing grows with the batch."""
        bd = self.at(mode=mode)
        if bd.at_optimizer:  # the larger of the optimizer's peak and backward's, which grows
            if bd.total * MIB > budget:
                return 0
            zero = (bd.held + bd.parts.get("fp8", 0.0) + bd.copies) * MIB
            per = bd.saved * MIB / bd.batch
        else:
            zero = bd.at(0).total * MIB
            per = bd.at(1).total * MIB - zero
        if not per > 0:
            return None
        return max(0, math.floor((budget - zero) / per))


def breakdown(metrics: dict[str, float], mode: str, batch: int) -> Breakdown | None:
    """The step's parts a run recorded (``mem/<part>_mib``), or None where it recorded no
    parameters' size or its mode is not in the table. A run from before the parts were
    recorded gives what it has: its weight copies as the autocast cache, the bytes saved for
    backward less the cache as the activations, no ``other``."""
    if "mem/params_mib" not in metrics or mode not in modes.MODES or batch < 1:
        return None
    parts = {p: float(metrics.get(part_metric(p), 0.0)) for p in PARTS}
    if part_metric("autocast_cache") not in metrics:
        parts["autocast_cache"] = float(metrics.get(OLD_CACHE, 0.0))
    at_optimizer = metrics.get(AT_OPTIMIZER) == 1.0
    if part_metric("activations") not in metrics and SAVED in metrics and not at_optimizer:
        parts["activations"] = max(0.0, metrics[SAVED] - parts["autocast_cache"])
    # Autocast's weight copies among the saved bytes: not live at an optimizer's peak to be
    # told apart, so taken as what they are at most, a 16-bit copy of every parameter
    all_saved = float(metrics.get(SAVED, 0.0))
    copies = 0.0
    if modes.MODES[mode].autocast:
        copies = min(all_saved, parts["params"] * 2 / _param_bytes(modes.MODES[mode]))
    saved = all_saved - copies
    intermediates = float(metrics.get(INTERMEDIATES, 0.0)) if at_optimizer else 0.0
    return Breakdown(mode, batch, parts, True, (), at_optimizer, saved, copies, intermediates)


def memory_kinds() -> list[list[str]]:
    """The modes grouped by what they hold in memory (the dtype of their weights and of what
    they save, an autocast cache, fp8 copies): fp16 and bf16 under autocast hold the same."""
    kinds: dict[tuple, list[str]] = {}
    for m in modes.MODES.values():
        kinds.setdefault((m.pure, m.autocast, m.half, bool(m.fp8)), []).append(m.name)
    return list(kinds.values())


def by_mode(
    bd: Breakdown, batch: int, budget: float | None
) -> list[tuple[list[str], Breakdown, int | None]]:
    """Each kind of mode (``memory_kinds``) at ``batch``, predicted from ``bd`` (the kind of
    its own mode is ``bd`` itself at that batch), with the largest batch it fits in ``budget``
    bytes (None without a budget). Each kind's prediction is made for (and its list of modes
    begins with) the measured mode, else the kind's bf16 mode, else its first."""
    out = []
    for names in memory_kinds():
        bf16 = [n for n in names if modes.MODES[n].dtype == "bf16"]
        mode = bd.mode if bd.mode in names else (bf16 or names)[0]
        predicted = bd.at(batch, mode)
        largest = bd.max_batch(budget, mode) if budget else None
        out.append(([mode, *(n for n in names if n != mode)], predicted, largest))
    return out


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """How far a prediction is from its measurement, in percent of the measurement."""
    if not predicted or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


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
