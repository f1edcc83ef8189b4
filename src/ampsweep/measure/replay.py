"""The replay of a non-finite step, and where its first non-finite value began (``Origin``).

The replay runs the step's micro-batches again at the weights the step saw, in the run's
autocast and at its loss scale, with hooks on every module, on copies of the parameters and
buffers (``torch.func.functional_call``), so that the run's weights, gradients, BatchNorm
statistics and random state are untouched; it names where the value began (an ``Origin``: the
kinds are listed in ``measure.numerics``, the training loop's locator, which calls it). Where
the replay stays finite, the step's own gradients may still name the parameter
(``from_gradients``).

An ``Origin`` also says itself: the sentence and the fix the divergence message, the run's tags
and ``numerics/first_nonfinite.json`` carry.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ampsweep.measure import names
from ampsweep.measure.probe import HookError, hook_forward
from ampsweep.precision.modes import FORMATS
from ampsweep.precision.policy import PrecisionPolicy

ARTIFACT = names.FIRST_NONFINITE_ARTIFACT
FORMAT_OF = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass
class Origin:
    """Where the first non-finite value of a run began (the kinds: ``measure.numerics``)."""

    step: int  # the optimizer step (1-based)
    kind: str  # forward | loss | weight_grad | input_grad | not_reproduced
    module: str = ""  # the module's name in model.named_modules() ("" for the model itself)
    module_type: str = ""
    param: str = ""  # weight_grad: the parameter (e.g. layer4.0.conv1.weight)
    dtype: str = ""  # the format the non-finite value was in (fp16, bf16, fp32)
    value: float | None = None  # forward: the output's largest magnitude, recomputed in fp32
    limit: float | None = None  # forward: the format's largest finite value
    loss_scale: float | None = None  # the GradScaler's scale at that step (None: no scaler)
    micro_batch: int = 0  # which micro-batch of the step (grad accumulation)
    mode: str = ""
    nonfinite_steps: int = 0  # non-finite steps seen in the run so far
    consumers: list[str] = field(default_factory=list)  # input_grad: modules that took it
    reason: str = ""  # not_hookable: why the model could not be hooked
    # With a loss scale above 1: whether the same step was non-finite unscaled too (True: not
    # the scale's doing, a kernel or the values themselves; None: not checked)
    unscaled_too: bool | None = None
    # False: a replay of the step stayed finite, so the origin was read off the step's own
    # gradients (a kernel that is not deterministic); the parameters whose gradient was bad:
    reproduced: bool = True
    bad_params: list[str] = field(default_factory=list)

    @property
    def scaled_overflow(self) -> bool:
        """Non-finite only because of the loss scale: unscaled, the step was finite."""
        return bool(self.loss_scale and self.loss_scale > 1 and self.unscaled_too is False)

    @property
    def label(self) -> str:
        """``layer4.0.conv1 (Conv2d)``."""
        name = self.module or "(the model)"
        return f"{name} ({self.module_type})" if self.module_type else name

    def sentence(self) -> str:
        """The origin in one sentence, with what most likely caused it."""
        at = f"step {self.step}"
        scale = f" at loss scale {self.loss_scale:g}" if self.loss_scale else ""
        if self.kind == "forward":
            held = ""
            if self.value is not None and self.limit is not None and self.value > self.limit:
                held = (
                    f": its output reaches {self.value:.4g} in fp32, beyond {self.dtype}'s "
                    f"largest value {self.limit:g} (a forward overflow)"
                )
            elif self.value is not None and math.isfinite(self.value):
                held = f" (in fp32 its output's largest magnitude is {self.value:.4g})"
            return (
                f"{at}: the first non-finite value was the {self.dtype} output of {self.label}, "
                f"with finite inputs{held}"
            )
        if self.kind == "loss":
            return (
                f"{at}: every module's output was finite but the loss was not: the loss "
                "function itself overflowed or took a log of zero"
            )
        if self.kind == "weight_grad":
            cause = (
                "the scaled gradient overflowed (the scaler backs off and skips the step)"
                if self.scaled_overflow
                else "a backward kernel of this device produced it"
            )
            size = ""
            if self.value is not None and math.isfinite(self.value):  # finite, norm overflows
                size = f" (finite values up to {self.value:.3g}, too large for its norm)"
            if not self.reproduced:
                others = len(self.bad_params) - 1
                also = f" ({others} more parameter(s) too)" if others > 0 else ""
                return (
                    f"{at}: the weight gradient of {self.label} ({self.param}){size}{scale} "
                    f"was non-finite{also} while the loss was finite; a replay of the step at "
                    "the same weights stayed finite, so a backward kernel of this device "
                    "produced it, and not every time"
                )
            return (
                f"{at}: the first non-finite value was the weight gradient of {self.label} "
                f"({self.param}){size}{scale}, with finite input and output gradient: {cause}"
            )
        if self.kind == "input_grad":
            cause = (
                "the scaled gradient overflowed (the scaler backs off and skips the step)"
                if self.scaled_overflow
                else f"its backward overflowed {self.dtype} or failed"
            )
            return (
                f"{at}: the first non-finite value was the gradient {self.label} passed back "
                f"to its input{scale}, from a finite output gradient: {cause}"
            )
        if self.kind == "not_hookable":
            return f"{at}: the loss or a gradient was non-finite; not located: {self.reason}"
        return (
            f"{at}: the loss or a gradient was non-finite, but a replay of the step with the "
            "same weights and inputs stayed finite (random layers such as dropout draw anew): "
            "rerun with trainer.deterministic=true, or with model dropout off, to locate it"
        )

    def fix(self) -> str:
        """The config change that most likely fixes it ('' when none can be named)."""
        if self.kind not in ("forward", "weight_grad", "input_grad") or not self.module:
            if self.kind == "loss":
                return "check the loss for log(0) or division by zero on these targets"
            return ""
        target = self.consumers[0] if self.kind == "input_grad" and self.consumers else self.module
        keep = f"precision.keep_fp32=[{target}]"
        if self.kind == "forward" and self.dtype == "fp16":
            return f"{keep}, or precision=bf16 (fp32's range)"
        if self.kind in ("weight_grad", "input_grad") and self.scaled_overflow:
            return f"{keep} if it keeps happening (the scaler backs off from occasional ones)"
        return keep

    def tags(self) -> dict[str, str]:
        """What the run records of it (MLflow tags)."""
        return {
            names.NONFINITE_STEP: str(self.step),
            names.NONFINITE_KIND: self.kind,
            names.NONFINITE_MODULE: self.module,
            names.NONFINITE_WHERE: self.sentence()[:4000],
            names.NONFINITE_FIX: self.fix(),
        }

    def write(self, folder: Path) -> Path:
        path = folder / Path(ARTIFACT).name
        path.write_text(
            json.dumps({**asdict(self), "sentence": self.sentence(), "fix": self.fix()}, indent=2)
        )
        return path


# ---------------------------------------------------------------- the replay


def from_gradients(module: torch.nn.Module, losses: list[torch.Tensor]) -> Origin | None:
    """The step's own gradients, where a replay stayed finite: the parameters whose gradient
    is not sound, the one nearest the output named (the last in the model's order, which is
    about the first the backward pass computes). None if the loss was not finite or no
    gradient is bad (nothing to tell)."""
    if not all(bool(torch.isfinite(loss.detach()).all()) for loss in losses):
        return None
    bad = [
        (n, p.grad)
        for n, p in module.named_parameters()
        if p.grad is not None and not _sound(p.grad)
    ]
    if not bad:
        return None
    name, grad = bad[-1]
    owner = name.rpartition(".")[0]
    kind = type(module.get_submodule(owner)).__name__ if owner else type(module).__name__
    return Origin(
        0,
        "weight_grad",
        owner,
        kind,
        param=name,
        value=_absmax(grad),
        dtype=FORMAT_OF.get(grad.dtype, ""),
        reproduced=False,
        bad_params=[n for n, _ in bad],
    )


def _tensors(value) -> list[torch.Tensor]:
    """The floating tensors in a module's inputs or outputs (nested in tuples, lists, dicts,
    and Hugging Face's output objects)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict) or hasattr(value, "values") and hasattr(value, "keys"):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _sound(g: torch.Tensor) -> bool:
    """A gradient that is finite and whose norm is too: what the step's own check reads (the
    gradients' total norm). A kernel that returns 1e31 is as broken as one that returns NaN,
    and the next update turns it into NaN."""
    return bool(torch.isfinite(torch.linalg.vector_norm(g.detach().float())))


def _absmax(g: torch.Tensor) -> float:
    return float(g.detach().abs().max()) if g.numel() else 0.0


@dataclass
class _Call:
    name: str
    module: torch.nn.Module
    inputs_finite: bool
    output_finite: bool
    input_ids: set[int]
    output_dtype: torch.dtype | None
    value: float | None = None


def replay(
    module: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    policy: PrecisionPolicy,
    objective,
    loss_weight: float,
) -> Origin | None:
    """Run one micro-batch forward and backward as the step did, with hooks on every module;
    the origin of its first non-finite value, or None if it stayed finite. ``loss_weight``:
    what backward saw the loss multiplied by (the loss scale included)."""
    names = {id(m): n for n, m in module.named_modules()}
    params = {
        n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in module.named_parameters()
    }
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    calls: list[_Call] = []
    produced: dict[int, str] = {}  # id of an output tensor -> the module that made it
    keep: list[torch.Tensor] = []  # outputs kept alive, so that their ids stay unique
    # backward, in order: (kind, module, param, sound, largest magnitude)
    events: list[tuple[str, str, str, bool, float]] = []

    def forward_hook(mod, args, kwargs, out):
        name = names.get(id(mod), "")
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        call = _Call(
            name,
            mod,
            _finite(ins),
            _finite(outs),
            {id(t) for t in ins},
            outs[0].dtype if outs else None,
        )
        calls.append(call)
        for t in outs:
            produced.setdefault(id(t), name)
            keep.append(t)
            if t.requires_grad:
                t.register_hook(
                    lambda g, name=name: events.append(("output", name, "", _sound(g), _absmax(g)))
                )
        if call.inputs_finite and not call.output_finite and call.value is None:
            call.value = _fp32_magnitude(mod, args, kwargs, x.device.type)

    handles = []
    for name, m in module.named_modules():
        try:
            handles.append(hook_forward(m, forward_hook, name))
        except HookError:
            for h in handles:
                h.remove()
            raise
    for pname, p in params.items():
        if p.requires_grad:
            owner = pname.rpartition(".")[0]
            p.register_hook(
                lambda g, owner=owner, pname=pname: events.append(
                    ("weight", owner, pname, _sound(g), _absmax(g))
                )
            )
    devices = [x.device] if x.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            with policy.autocast():
                out = torch.func.functional_call(module, {**params, **buffers}, (x,))
                loss = objective(out, y)
            origin = _forward_origin(calls, loss)
            if origin is not None:
                return origin
            wanted = [p for p in params.values() if p.requires_grad]
            if not wanted or not loss.requires_grad:
                return None
            torch.autograd.grad(loss * loss_weight, wanted, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return _backward_origin(events, calls, produced, module)


def _fp32_magnitude(mod, args, kwargs, device_type: str) -> float | None:
    """The largest magnitude of ``mod``'s output recomputed in fp32 (what the format had to
    hold); None if that fails."""
    try:
        with torch.no_grad(), torch.autocast(device_type=device_type, enabled=False):
            cast = [
                a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args
            ]
            out = mod(*cast, **kwargs)
        return max((float(t.abs().max()) for t in _tensors(out) if t.numel()), default=None)
    except Exception:  # a module that refuses fp32 inputs: the origin is named all the same
        return None


def _forward_origin(calls: list[_Call], loss: torch.Tensor) -> Origin | None:
    for call in calls:
        if call.inputs_finite and not call.output_finite:
            fmt = FORMAT_OF.get(call.output_dtype, str(call.output_dtype))
            limit = FORMATS[fmt].max if fmt in FORMATS else None
            return Origin(
                0,
                "forward",
                call.name,
                type(call.module).__name__,
                dtype=fmt,
                value=call.value,
                limit=limit,
            )
    if not bool(torch.isfinite(loss.detach()).all()):
        return Origin(0, "loss", dtype=FORMAT_OF.get(loss.dtype, str(loss.dtype)))
    return None


def _backward_origin(events, calls: list[_Call], produced: dict[int, str], module) -> Origin | None:
    types = {c.name: type(c.module).__name__ for c in calls}
    dtypes = {n: FORMAT_OF.get(p.dtype, "") for n, p in module.named_parameters()}
    for kind, name, pname, sound, top in events:
        if sound:
            continue
        if kind == "weight":
            return Origin(
                0,
                "weight_grad",
                name,
                types.get(name, ""),
                param=pname,
                dtype=dtypes.get(pname, ""),
                value=top,
            )
        # The gradient into ``name``'s output: made by the modules that consumed that output.
        made = {i for i, n in produced.items() if n == name}
        consumers = [c.name for c in calls if c.input_ids & made and c.name != name]
        consumers = [n for n in dict.fromkeys(consumers) if not _contains(n, name)]
        culprit = consumers[0] if consumers else name.rpartition(".")[0]
        dtype = next((FORMAT_OF.get(c.output_dtype, "") for c in calls if c.name == name), "")
        return Origin(
            0,
            "input_grad",
            culprit,
            types.get(culprit, ""),
            dtype=dtype,
            consumers=consumers or [culprit],
        )
    return None


def _contains(outer: str, inner: str) -> bool:
    """Whether module ``outer`` holds module ``inner`` (a container consumes what its own
    children make: the consumer that matters is the innermost)."""
    return outer == "" or inner.startswith(outer + ".")
