"""The replay of a non-finite step, and where its first non-finite value began (``Origin``).

The replay runs the step's micro-batches again at the weights the step saw, in the run's
autocast and at its loss scale, with hooks on every module, on copies of the parameters and
buffers (``torch.func.functional_call``), so that the run's weights, gradients, BatchNorm
statistics and random state are untouched; it names where the value began (an ``Origin``: the
kinds are listed in ``measure.numerics``, the training loop's locator, which calls it). Where
the replay stays finite, the step's own gradients may still name the parameter
(``measure.numerics.from_gradients``).

An ``Origin`` also says itself: the sentence and the fix the divergence message, the run's tags
and ``numerics/first_nonfinite.json`` carry.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ampsweep.measure import names
from ampsweep.measure.hooks import OpWatch, fp32_magnitude, hook_forward, op_name, tensors
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
    op: str = ""  # the op that made it, where known (``matmul`` inside ``attn.forward``)
    # Precision or not: whether the same step replayed in fp32 at the same weights failed too
    # (None: not replayed), and the growth before it ("the weights grew from 1e2 to 1e17 over
    # 10 steps"): a divergence, which no precision setting fixes
    fp32_too: bool | None = None
    growth: str = ""
    # Whether ``precision.keep_fp32=[module]`` could change anything: the mode has autocast to
    # leave and the module does not already run in fp32
    keepable: bool = True

    @property
    def cause(self) -> str:
        """``divergence`` (the values grew), ``computation`` (fails in fp32 too) or
        ``precision`` (the format: fp32 at the same weights stays finite); '' if unknown."""
        if self.growth:
            return "divergence"
        if self.fp32_too:
            return "computation"
        return "precision" if self.fp32_too is False else ""

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
        """The origin in one sentence, with what most likely caused it, and whether it is the
        format's doing."""
        said = self._where()
        if self.growth:
            return f"{said}; {self.growth}: a divergence, not the format"
        if self.fp32_too:
            return f"{said}; it fails in fp32 too, at the same weights: not the format"
        if self.fp32_too is False and self.kind != "loss":
            return f"{said}; in fp32 at the same weights the step is finite: the format"
        return said

    @property
    def _in(self) -> str:
        """`` (its matmul)``: the op inside the module, where known and not the module's own
        (a Linear's ``linear``)."""
        plain = self.op.replace("_", "") == self.module_type.lower()
        return f" (its {self.op})" if self.op and not plain else ""

    def _where(self) -> str:
        at = f"step {self.step}"
        scale = f" at loss scale {self.loss_scale:g}" if self.loss_scale else ""
        if self.kind == "forward":
            held = ""
            if self.value is not None and self.limit is not None and self.value > self.limit:
                held = (
                    f": it reaches {self.value:.4g} in fp32, beyond {self.dtype}'s "
                    f"largest value {self.limit:g} (a forward overflow)"
                )
            elif self.value is not None and math.isfinite(self.value):
                held = f" (in fp32 its output's largest magnitude is {self.value:.4g})"
            return (
                f"{at}: the first non-finite value was the {self.dtype} output of {self.label}"
                f"{self._in}, with finite inputs{held}"
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
                f"{at}: the first non-finite value was the gradient {self.label}{self._in} "
                f"passed back to its input{scale}, from a finite output gradient: {cause}"
            )
        if self.kind == "not_hookable":
            return f"{at}: the loss or a gradient was non-finite; not located: {self.reason}"
        return (
            f"{at}: the loss or a gradient was non-finite, but a replay of the step with the "
            "same weights and inputs stayed finite (random layers such as dropout draw anew): "
            "rerun with trainer.deterministic=true, or with model dropout off, to locate it"
        )

    def fix(self) -> str:
        """The config change that most likely fixes it ('' when none can be named): never a
        ``precision.keep_fp32`` that changes nothing."""
        if self.growth:
            return (
                "lower optimizer.lr, warm it up (optimizer.warmup_steps), or clip the "
                "gradients (trainer.grad_clip=1.0)"
            )
        if self.fp32_too and self.module and self.kind != "loss":
            part = "backward" if self.kind in ("weight_grad", "input_grad") else "forward"
            return f"fix the {part} of {self.module}{self._in} (no precision setting changes it)"
        if self.kind not in ("forward", "weight_grad", "input_grad") or not self.module:
            if self.kind == "loss":
                return "check the loss for log(0) or division by zero on these targets"
            return ""
        if not self.keepable:
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
            names.NONFINITE_CAUSE: self.cause,
        }

    def write(self, folder: Path) -> Path:
        path = folder / Path(ARTIFACT).name
        path.write_text(
            json.dumps(
                {**asdict(self), "sentence": self.sentence(), "fix": self.fix()}
                | {"cause": self.cause},
                indent=2,
            )
        )
        return path


# ---------------------------------------------------------------- the replay


def _finite(tensors) -> bool:
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def sound(g: torch.Tensor | None) -> bool:
    """A gradient that is finite and whose norm is too: what the step's own check reads (the
    gradients' total norm). A kernel that returns 1e31 is as broken as one that returns NaN,
    and the next update turns it into NaN."""
    return g is None or bool(torch.isfinite(torch.linalg.vector_norm(g.detach().float())))


def absmax(g: torch.Tensor) -> float:
    return float(g.detach().abs().max()) if g.numel() else 0.0


def _node_op(node) -> str:
    """``MmBackward0`` -> ``mm``; a custom ``autograd.Function`` keeps its class name."""
    name = re.sub(r"Backward\d*$", "", node.name())
    return name if name.startswith("_") or not name[:1].isupper() else name.lower()


@dataclass
class _Call:
    name: str
    module: torch.nn.Module
    inputs_finite: bool
    output_finite: bool
    output_dtype: torch.dtype | None
    value: float | None = None


@dataclass
class _FirstOp:
    """The first op whose output was non-finite from finite inputs, the innermost module
    running it, and its output's magnitude recomputed in fp32."""

    op: str
    module: str
    dtype: torch.dtype | None
    value: float | None


def replay(
    module: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    policy: PrecisionPolicy,
    objective,
    loss_weight: float,
    fp32: bool = False,
) -> Origin | None:
    """Run one micro-batch forward and backward as the step did, with hooks on every module;
    the origin of its first non-finite value, or None if it stayed finite. ``loss_weight``:
    what backward saw the loss multiplied by (the loss scale included). ``fp32``: the same
    step at the same weights in fp32, without autocast (is it the format?)."""
    names = {id(m): n for n, m in module.named_modules()}
    cast = (lambda t: t.float() if t.is_floating_point() else t) if fp32 else (lambda t: t)
    params = {
        n: cast(p.detach()).clone().requires_grad_(p.requires_grad)
        for n, p in module.named_parameters()
    }
    buffers = {n: cast(b.detach()).clone() for n, b in module.named_buffers()}
    x = cast(x)
    calls: list[_Call] = []
    owner: dict = {}  # autograd node -> the innermost module whose forward made it
    first_op: list[_FirstOp] = []
    device_type = x.device.type

    def on_op(name, func, args, kwargs, out):
        outs = tensors(out)
        if first_op or not outs or _finite(outs) or not _finite(tensors((args, kwargs))):
            return
        value = fp32_magnitude(func, args, kwargs, device_type)
        first_op.append(_FirstOp(op_name(func), name, outs[0].dtype, value))

    def forward_hook(mod, args, kwargs, out):
        name = names.get(id(mod), "")
        ins, outs = tensors((args, kwargs)), tensors(out)
        call = _Call(name, mod, _finite(ins), _finite(outs), outs[0].dtype if outs else None)
        calls.append(call)
        _claim(owner, name, outs, ins)
        if call.inputs_finite and not call.output_finite:
            ops.paused = True
            call.value = fp32_magnitude(mod, args, kwargs, device_type)
            ops.paused = False

    ops = OpWatch(module, on_op)
    handles = []
    try:
        for name, m in module.named_modules():
            handles.append(hook_forward(m, forward_hook, name))
        devices = [x.device] if device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            autocast = torch.autocast(device_type, enabled=False) if fp32 else policy.autocast()
            with autocast, ops:
                out = torch.func.functional_call(module, {**params, **buffers}, (x,))
                loss = objective(out, y)
            origin = _forward_origin(calls, loss, first_op[0] if first_op else None)
            if origin is not None:
                return origin
            wanted = [p for p in params.values() if p.requires_grad]
            if not wanted or not loss.requires_grad:
                return None
            first = _watch_backward(loss)
            torch.autograd.grad(loss * loss_weight, wanted, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return _backward_origin(first, owner, calls, params)


def _claim(owner: dict, name: str, outs, ins) -> None:
    """Give the autograd nodes a module's forward made (those between its inputs and its
    outputs not yet claimed by a module inside it) to that module. The module hooks finish
    innermost first, so each node goes to the innermost module that ran it; autocast's own
    casts, inline ``F.*`` calls and custom ``autograd.Function``s included."""
    stop = {t.grad_fn for t in ins if t.grad_fn is not None}
    todo, seen = [t.grad_fn for t in outs if t.grad_fn is not None], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop or not hasattr(node, "next_functions"):
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":
            continue
        owner.setdefault(node, name)  # through the children's nodes, to the inline ones
        todo.extend(n for n, _ in node.next_functions)


def _watch_backward(loss: torch.Tensor) -> list:
    """Hooks on every node of the loss's graph; the list they fill with the first node whose
    backward turned sound gradients into an unsound one (and which of its outputs)."""
    first: list = []
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":

            def hook(grad_inputs, grad_outputs, node=node):
                if first or not all(sound(g) for g in grad_outputs):
                    return
                bad = [i for i, g in enumerate(grad_inputs) if not sound(g)]
                if bad:
                    first.append((node, bad[0], grad_inputs[bad[0]]))

            node.register_hook(hook)
        todo.extend(n for n, _ in node.next_functions)
    return first


def _forward_origin(calls: list[_Call], loss: torch.Tensor, op: _FirstOp | None) -> Origin | None:
    for call in calls:
        if call.inputs_finite and not call.output_finite:
            inner = op  # the op that overflowed, where it ran inside this call
            if op is None or not (op.module == call.name or _contains(call.name, op.module)):
                inner = None
            name = inner.module if inner is not None else call.name
            dtype = inner.dtype if inner is not None else call.output_dtype
            fmt = FORMAT_OF[dtype] if dtype in FORMAT_OF else str(dtype)
            kind = next((type(c.module).__name__ for c in calls if c.name == name), "")
            return Origin(
                0,
                "forward",
                name,
                kind,
                dtype=fmt,
                value=inner.value if inner is not None else call.value,
                limit=FORMATS[fmt].max if fmt in FORMATS else None,
                op=inner.op if inner is not None else "",
            )
    if not bool(torch.isfinite(loss.detach()).all()):
        return Origin(0, "loss", dtype=FORMAT_OF.get(loss.dtype, str(loss.dtype)))
    return None


def _backward_origin(first: list, owner: dict, calls: list[_Call], params: dict) -> Origin | None:
    """The node whose backward first made an unsound gradient: a parameter's gradient (through
    casts and views) is the module's weight gradient, else the gradient it passed back."""
    if not first:
        return None
    node, index, grad = first[0]
    types = {c.name: type(c.module).__name__ for c in calls}
    by_id = {id(p): n for n, p in params.items()}
    dtype = FORMAT_OF.get(grad.dtype, "") if grad is not None else ""
    step, hops = node.next_functions[index][0], 0
    while step is not None and hops < 4 and type(step).__name__ != "AccumulateGrad":
        nexts = [n for n, _ in step.next_functions if n is not None]
        step, hops = (nexts[0] if len(nexts) == 1 else None), hops + 1
    pname = by_id.get(id(getattr(step, "variable", None)), "") if step is not None else ""
    if pname:
        name = pname.rpartition(".")[0]
        return Origin(
            0, "weight_grad", name, types.get(name, ""), param=pname, dtype=dtype,
            value=absmax(grad), op=_node_op(node),
        )  # fmt: skip
    name = owner.get(node, "")
    return Origin(
        0, "input_grad", name, types.get(name, ""), dtype=dtype, consumers=[name],
        op=_node_op(node),
    )  # fmt: skip


def _contains(outer: str, inner: str) -> bool:
    """Whether module ``outer`` holds module ``inner`` (a container consumes what its own
    children make: the consumer that matters is the innermost)."""
    return outer == "" or inner.startswith(outer + ".")
