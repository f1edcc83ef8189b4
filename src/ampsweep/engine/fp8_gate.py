"""The numerics gate of an fp8 mode: how far each converted Linear layer's fp8 matmuls stray
from bf16's on the model's own data, as torchao measures it (``compute_error``: the
signal-to-quantization-noise ratio in dB).

A reference step of a few batches runs the model under bf16 autocast and records, for every
layer the mode would convert (``engine.fp8.plan``, so ``keep_first_last``, ``keep_bf16`` and
``keep_fp32`` count), the input it received and the gradient that came back to its output.
Each layer is then run alone on those, once as the bf16 Linear and once as torchao's
``Float8Linear`` with the mode's recipe: its output, its input gradient and its weight gradient
are compared. One layer at a time, so that a layer's error is its own and not the sum of the
layers before it. On a CPU the fp8 side is torchao's emulation (the values rounded to fp8 as on
a GPU, the products summed in fp32, as fp8 tensor cores sum them).

A layer whose output or input gradient (what it passes on) has an SQNR under the threshold
(20 dB: noise a tenth of the signal's magnitude) loses too much to fp8:
``precision.fp8.keep_bf16`` leaves it in bf16.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ampsweep.engine.fp8 import plan
from ampsweep.precision.modes import Fp8Config, PrecisionMode

THRESHOLD_DB = 20.0  # noise a tenth of the signal's magnitude


@dataclass(frozen=True)
class LayerSqnr:
    """One converted layer's fp8 error against bf16, in dB (higher is closer; inf: exact)."""

    name: str
    output: float
    input_grad: float
    weight_grad: float

    @property
    def least(self) -> tuple[str, float]:
        """The worse of what the layer passes on, forward and back: which and its SQNR. The
        weight gradient is measured, not judged: rounding the output gradient to e5m2 (two
        mantissa bits) alone leaves it near 20 dB on a small batch, and the optimizer averages
        that noise over steps as it averages the batch's own."""
        return min((("output", self.output), ("input gradient", self.input_grad)), key=_second)

    def words(self) -> str:
        parts = (self.output, self.input_grad, self.weight_grad)
        return f"{self.name} " + "/".join(_db(v) for v in parts)


@dataclass
class Gate:
    """The gate's measurement of a mode on a model."""

    mode: str
    threshold: float = THRESHOLD_DB
    batches: int = 0
    emulated: bool = True
    layers: list[LayerSqnr] = field(default_factory=list)
    kept_bf16: list[str] = field(default_factory=list)  # the config's own keep_bf16

    @property
    def failing(self) -> list[LayerSqnr]:
        return [la for la in self.layers if la.least[1] < self.threshold]

    @property
    def passed(self) -> bool:
        return not self.failing

    def keep_bf16(self) -> list[str]:
        """The config's keep_bf16 patterns, then the layers under the threshold."""
        return [*self.kept_bf16, *(la.name for la in self.failing)]

    def override(self) -> str:
        return f"precision.fp8.keep_bf16=[{','.join(self.keep_bf16())}]"

    def summary(self) -> str:
        """One line: which layers fall under the threshold, or the least SQNR seen."""
        how = f"{self.mode} vs bf16, SQNR of output/input grad/weight grad, {self.batches} batches"
        if not self.layers:
            return f"fp8 gate ({how}): no layer converted"
        if self.passed:
            name, (what, db) = min(((la.name, la.least) for la in self.layers), key=_by_db)
            return (
                f"fp8 gate ({how}): every converted layer >= {self.threshold:g} dB "
                f"(least: {name}'s {what}, {_db(db)})"
            )
        bad = ", ".join(f"{la.words()} dB" for la in self.failing)
        return f"fp8 gate ({how}): under {self.threshold:g} dB: {bad}"

    def table(self) -> dict:
        return {
            "mode": self.mode,
            "threshold_db": self.threshold,
            "batches": self.batches,
            "emulated": self.emulated,
            "layers": [dataclasses.asdict(la) for la in self.layers],
        }


def _by_db(item: tuple[str, tuple[str, float]]) -> float:
    return item[1][1]


def _second(item: tuple[str, float]) -> float:
    return item[1]


def _db(value: float) -> str:
    return "exact" if math.isinf(value) else f"{value:.1f}"


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    """torchao's ``compute_error`` (20 log10 of the signal's norm over the noise's); inf where
    the two agree exactly (torchao's would divide by zero)."""
    from torchao.float8.float8_utils import compute_error

    reference, other = reference.float(), other.float()
    if torch.equal(reference, other):
        return math.inf
    return float(compute_error(reference, other))


def measure(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    mode: PrecisionMode,
    cfg: Fp8Config,
    kept: Callable[[str], bool] = lambda name: False,
    threshold: float = THRESHOLD_DB,
) -> Gate:
    """The gate of ``mode`` on ``model`` (fp32 weights, not converted; left unchanged) over
    ``batches`` (inputs and targets on the model's device). ``loss``: of the model's output
    and the targets (the task's objective). ``kept``: precision.keep_fp32's test of a name."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    batches = list(batches)
    device = next(model.parameters()).device
    emulated = cfg.emulate or device.type != "cuda"
    gate = Gate(mode.name, threshold, len(batches), emulated, kept_bf16=list(cfg.keep_bf16))
    if not batches:
        return gate
    planned = plan(model, batches[0][0], cfg, mode.fp8, kept)
    seen = _reference_step(model, batches, loss, planned.converted, device)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(mode.fp8), emulate=emulated)
    for name in planned.converted:
        if not seen[name]:  # no gradient reached it (its output unused by the loss)
            continue
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)  # plan converts only nn.Linear layers
        bf16 = copy.deepcopy(linear)
        fp8 = Float8Linear.from_float(copy.deepcopy(linear), config=config)
        # output, input gradient, weight gradient: each over every batch
        ref = zip(*(_alone(bf16, x, g, device) for x, g in seen[name]), strict=True)
        got = zip(*(_alone(fp8, x, g, device) for x, g in seen[name]), strict=True)
        errors = [sqnr(torch.cat(r), torch.cat(o)) for r, o in zip(ref, got, strict=True)]
        gate.layers.append(LayerSqnr(name, *errors))
    return gate


def _reference_step(model, batches, loss, names: list[str], device) -> dict:
    """Each named layer's inputs and output gradients over ``batches``, under bf16 autocast
    (the model's gradients are left as they were)."""
    seen: dict[str, list] = {name: [] for name in names}
    grads = {n: p.grad for n, p in model.named_parameters()}
    handles = []
    for name in names:

        def hook(mod, args, out, name=name):
            entry = [args[0].detach(), None]
            seen[name].append(entry)
            out.register_hook(lambda g, entry=entry: entry.__setitem__(1, g.detach()))

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    was_training = model.training
    model.eval()  # no dropout drawn, no BatchNorm statistics moved
    try:
        for x, y in batches:
            with torch.enable_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                value = loss(model(x), y)
            value.backward()
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():
            p.grad = grads[n]
    return {n: [(x, g) for x, g in entries if g is not None] for n, entries in seen.items()}


def _alone(layer: nn.Linear, x: torch.Tensor, g: torch.Tensor, device) -> list[torch.Tensor]:
    """``layer``'s output, input gradient and weight gradient for input ``x`` and output
    gradient ``g``, under bf16 autocast; flattened, in fp32."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with torch.enable_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        y = layer(x)
    y.backward(g.to(y.dtype))
    assert x.grad is not None and layer.weight.grad is not None  # both took part in y
    return [t.detach().float().flatten() for t in (y, x.grad, layer.weight.grad)]
