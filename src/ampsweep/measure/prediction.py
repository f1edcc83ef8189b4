"""Each precision mode's step time on a GPU, predicted from one traced step (``measure.trace``)
by the roofline (``measure.roofline``): what ``ampsweep predict`` prints.

Per mode, every traced kernel is timed at the mode's formats: matmuls, convolutions and
attention at the dense peak of the mode's math (fp32, TF32, fp16 or bf16); every op's
floating-point bytes at 4 bytes an element in fp32 and tf32, at 2 in a pure mode, and under
autocast at 2 except for the ops autocast keeps in fp32 (norms, softmax, losses, reductions).
Autocast adds the casts of each matmul and convolution weight to the half dtype (forward) and
of its gradient back to fp32 (backward). Each ``nn.Linear``'s matmuls (output, grad_input,
grad_weight) are timed by ``roofline.linear_times``, the one account fp8's layer filter reads
too: in the mode's format, and in fp8 with torchao's cast kernels for the layers an fp8 mode
converts. ``torch.compile`` is not modelled: a compiled run is predicted as eager. The
optimizer's update is one pass over the parameters, gradients and its state; a loss scaler's
unscale one more over the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ampsweep.measure.capacity import error_pct
from ampsweep.measure.roofline import Gpu, Kernel, kernel, linear_times, matmul
from ampsweep.measure.trace import Op
from ampsweep.precision.modes import BASELINE, MODES, PrecisionMode

HELPS = 1.15  # a predicted speed-up below this is within the model's error: not claimed
LOSS = "(loss)"  # the row of the ops outside every module: the loss, the gradient's seed
OPTIMIZER = "(optimizer)"
SCALER = "(loss scaler)"


@dataclass(frozen=True)
class Model:
    """What the prediction needs to know of the model besides its traced step."""

    ops: list[Op]
    weights: dict[str, int]  # each Linear and convolution layer: its weight's elements
    params: int  # trainable parameters' elements
    optimizer_states: int  # state tensors per parameter (AdamW 2, SGD with momentum 1)
    # the Linear layers an fp8 mode converts (None: unknown, the model cannot be planned)
    fp8_layers: frozenset[str] | None = frozenset()
    micro_batches: int = 1  # forward and backward passes a step (gradient accumulation)
    types: dict[str, str] = field(default_factory=dict)  # each module's class name


@dataclass
class Layer:
    """One module's kernels in one mode."""

    name: str
    seconds: float = 0.0
    flops: float = 0.0
    by_bound: dict[str, float] = field(default_factory=dict)
    fp8: bool = False
    type: str = ""  # the module's class ("Linear", "Conv2d", ...)
    math_s: float = 0.0  # of its seconds, in matmuls, convolutions and attention

    def add(self, k: Kernel, flops: float = 0.0, times: int = 1) -> None:
        self.seconds += k.seconds * times
        self.flops += flops * times
        if flops:
            self.math_s += k.seconds * times
        self.by_bound[k.bound] = self.by_bound.get(k.bound, 0.0) + k.seconds * times

    @property
    def bound(self) -> str:
        """What bounds most of its time: "compute", "memory" or "launch"."""
        return max(self.by_bound, key=self.by_bound.__getitem__) if self.by_bound else "launch"


@dataclass
class ModeTime:
    """One mode's predicted step."""

    mode: str
    layers: dict[str, Layer]
    math_s: float  # in matmuls, convolutions and attention
    kernels: int

    @property
    def step_s(self) -> float:
        return sum(layer.seconds for layer in self.layers.values())

    def by_bound(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for layer in self.layers.values():
            for bound, s in layer.by_bound.items():
                out[bound] = out.get(bound, 0.0) + s
        return out

    def top(self, n: int) -> list[Layer]:
        return sorted(self.layers.values(), key=lambda la: -la.seconds)[:n]


def math_kind(mode: PrecisionMode) -> str:
    """The kind of math the mode's matmuls run in (an fp8 mode's other matmuls: its dtype)."""
    return "tf32" if mode.tf32 else mode.dtype


def why_not(gpu: Gpu, model: Model, mode: PrecisionMode) -> str:
    """Why ``mode`` cannot be predicted here ("": it can)."""
    for kind in ("fp8", math_kind(mode)) if mode.fp8 else (math_kind(mode),):
        if getattr(gpu, kind) is None:
            return f"the {gpu.label} has no {kind} tensor cores"
    if mode.fp8 and model.fp8_layers is None:
        return "which layers fp8 converts is decided by a forward pass this model fails"
    return ""


def linear_layers(model: Model, converted: frozenset[str]) -> dict[str, bool]:
    """The modules whose matmuls are one ``nn.Linear``'s (its class is Linear, or fp8 converts
    it) and were traced as 2-D matmuls: each is timed by ``roofline.linear_times``, as fp8's
    layer filter times it. The value: whether its backward computes the input's gradient
    (autograd skips it where the input needs none: a first layer on the data)."""
    forward: dict[str, int] = {}
    backward: dict[str, int] = {}
    shapeless = set()
    for op in model.ops:
        if op.kind == "matmul":
            counts = backward if op.backward else forward
            counts[op.module] = counts.get(op.module, 0) + 1
            if not op.backward and not op.shape:
                shapeless.add(op.module)
    return {
        name: backward.get(name, 0) >= 2 * count
        for name, count in forward.items()
        if name not in shapeless and (model.types.get(name) == "Linear" or name in converted)
    }


def predict_mode(gpu: Gpu, model: Model, mode: PrecisionMode) -> ModeTime | None:
    """``mode``'s step on ``gpu``; None where it cannot be predicted (``why_not``)."""
    if why_not(gpu, model, mode):
        return None
    kind = math_kind(mode)
    converted = (model.fp8_layers or frozenset()) if mode.fp8 else frozenset()
    step = ModeTime(mode.name, {}, 0.0, 0)
    n = model.micro_batches

    def add(name: str, k: Kernel, flops: float = 0.0, times: int = n) -> None:
        key = name or LOSS
        if key not in step.layers:
            cls = model.types.get(name, "") if name else ""
            step.layers[key] = Layer(key, fp8=name in converted, type=cls)
        step.layers[key].add(k, flops, times)
        step.kernels += times
        if flops:
            step.math_s += k.seconds * times

    linears = linear_layers(model, converted)
    for op in model.ops:
        if op.kind == "matmul" and op.module in linears:
            if op.backward:
                continue  # counted with its forward: linear_times has the backward's matmuls
            rows, inner, outer = op.shape
            fmt = f"fp8_{mode.fp8}" if op.module in converted else kind
            linear = linear_times(gpu, rows, inner, outer, fmt, linears[op.module])
            for each in linear.kernels:
                add(op.module, each)
            per_matmul = op.flops * (1 + linears[op.module])  # each backward's as the forward's
            step.layers[op.module].flops += (op.flops + per_matmul) * n
            step.layers[op.module].math_s += linear.matmul_s * n
            step.math_s += linear.matmul_s * n
            continue
        half = mode.half and (mode.pure or not op.fp32_under_autocast)
        if op.kind == "matmul" and op.shape:  # by waves of tiles, as linear_times counts
            rows, inner, outer = op.shape
            width = 2 if half else 4
            add(op.module, matmul(gpu, rows, inner, outer, kind, width, width), op.flops)
            continue
        nbytes = op.float_bytes * (0.5 if half else 1.0) + op.other_bytes
        add(op.module, kernel(gpu, op.flops, nbytes, kind if op.flops else "fp32"), op.flops)
    if mode.autocast and mode.half:
        for name, numel in model.weights.items():
            if name not in converted:  # torchao casts its weights itself (linear_times)
                add(name, kernel(gpu, 0.0, 6.0 * numel))  # fp32 -> half, forward
                add(name, kernel(gpu, 0.0, 6.0 * numel))  # its gradient back, backward
    size = 2 if mode.pure else 4
    update = (3 + 2 * model.optimizer_states) * size * model.params
    add(OPTIMIZER, kernel(gpu, 0.0, update), times=1)
    if mode.scaler:
        add(SCALER, kernel(gpu, 0.0, 2 * size * model.params), times=1)
    return step


def against_measured(
    gpu: Gpu, model: Model, mode: PrecisionMode, measured_ms: float
) -> dict[str, float]:
    """What a run on ``gpu`` records of its own mode's prediction: ``predict/step_ms``, and
    ``predict/error_pct``, the prediction's error against the measured median step in percent
    of it (negative: predicted faster than measured); nothing where the mode cannot be
    predicted on this GPU."""
    step = predict_mode(gpu, model, mode)
    predicted_ms = step.step_s * 1e3 if step else None
    error = error_pct(predicted_ms, measured_ms)  # as capacity's batch check reads its own
    if predicted_ms is None or error is None:
        return {}
    return {"predict/step_ms": predicted_ms, "predict/error_pct": error}


@dataclass
class Prediction:
    """Every mode's predicted step on one GPU, and the verdict in words."""

    gpu: Gpu
    modes: dict[str, ModeTime]
    cannot: dict[str, str]  # the modes not predicted, and why

    def speedup(self, mode: str, against: str = BASELINE) -> float | None:
        base, this = self.modes.get(against), self.modes.get(mode)
        return base.step_s / this.step_s if base and this else None

    def shares(self, mode: str = BASELINE) -> dict[str, float]:
        """The step's share in math (matmuls, convolutions, attention) and per bound."""
        m = self.modes[mode]
        out = {"math": m.math_s / m.step_s}
        out.update({b: s / m.step_s for b, s in m.by_bound().items()})
        return out

    def verdict(self) -> str:
        """One sentence: the best mode and what it buys, or why none helps."""
        shares = self.shares()
        math = f"its GEMMs and convolutions are {shares['math']:.0%} of the fp32 step"
        gains = {m: self.speedup(m) or 0.0 for m in self.modes}
        best = max(gains, key=gains.__getitem__)
        if gains[best] < HELPS:
            launch, memory = shares.get("launch", 0.0), shares.get("memory", 0.0)
            what = "launch-bound" if launch >= memory else "memory-bound"
            return (
                f"no mode is predicted to help this model on an {self.gpu.label}: {math}; the "
                f"step is {what}: {launch:.0%} of it in kernels too short to leave the launch "
                f"floor, {memory:.0%} in memory-bound ones"
            )
        tf32 = self.speedup(best, tf32_mode())
        against_tf32 = f", {tf32:.2f}x TF32" if tf32 else ""
        return (
            f"{best} is predicted the fastest on an {self.gpu.label}: {gains[best]:.2f}x fp32"
            f"{against_tf32}; {math}"
        )


def tf32_mode() -> str:
    """The mode of fp32 on TF32 tensor cores: the other baseline speed-ups are quoted against."""
    return next(m.name for m in MODES.values() if m.tf32)


def predict(gpu: Gpu, model: Model) -> Prediction:
    modes: dict[str, ModeTime] = {}
    cannot: dict[str, str] = {}
    for mode in MODES.values():
        found = predict_mode(gpu, model, mode)
        if found is None:
            cannot[mode.name] = why_not(gpu, model, mode)
        else:
            modes[mode.name] = found
    return Prediction(gpu, modes, cannot)
