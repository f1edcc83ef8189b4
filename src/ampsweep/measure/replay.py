"""The replay of a non-finite step: its micro-batches again at the weights the step saw, in the
run's autocast and at its loss scale, with hooks on every module, on copies of the parameters
and buffers (``torch.func.functional_call``), so that the run's weights, gradients, BatchNorm
statistics and random state are untouched; it names where the value began (an ``Origin``:
the kinds are listed in ``measure.numerics``). Where the replay stays finite, the step's own
gradients may still name the parameter (``from_gradients``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampsweep.measure.origin import FORMAT_OF, Origin
from ampsweep.measure.probe import HookError, hook_forward
from ampsweep.precision.modes import FORMATS
from ampsweep.precision.policy import PrecisionPolicy


def from_gradients(module: torch.nn.Module, losses: list[torch.Tensor]) -> Origin | None:
    """The step's own gradients, where a replay stayed finite: the parameters whose gradient
    is not sound, the one nearest the output named (the last in the model's order, which is
    about the first the backward pass computes). None if the loss was not finite or no
    gradient is bad (nothing to tell)."""
    if not all(bool(torch.isfinite(loss.detach()).all()) for loss in losses):
        return None
    bad = [(n, p.grad) for n, p in module.named_parameters()
           if p.grad is not None and not _sound(p.grad)]  # fmt: skip
    if not bad:
        return None
    name, grad = bad[-1]
    owner = name.rpartition(".")[0]
    kind = type(module.get_submodule(owner)).__name__ if owner else type(module).__name__
    return Origin(0, "weight_grad", owner, kind, param=name, value=_absmax(grad),
                  dtype=FORMAT_OF.get(grad.dtype, ""), reproduced=False,
                  bad_params=[n for n, _ in bad])  # fmt: skip


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
    params = {n: p.detach().clone().requires_grad_(p.requires_grad)
              for n, p in module.named_parameters()}  # fmt: skip
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    calls: list[_Call] = []
    produced: dict[int, str] = {}  # id of an output tensor -> the module that made it
    keep: list[torch.Tensor] = []  # outputs kept alive, so that their ids stay unique
    # backward, in order: (kind, module, param, sound, largest magnitude)
    events: list[tuple[str, str, str, bool, float]] = []

    def forward_hook(mod, args, kwargs, out):
        name = names.get(id(mod), "")
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        call = _Call(name, mod, _finite(ins), _finite(outs), {id(t) for t in ins},
                     outs[0].dtype if outs else None)  # fmt: skip
        calls.append(call)
        for t in outs:
            produced.setdefault(id(t), name)
            keep.append(t)
            if t.requires_grad:
                t.register_hook(lambda g, name=name: events.append(
                    ("output", name, "", _sound(g), _absmax(g))))  # fmt: skip
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
            p.register_hook(lambda g, owner=owner, pname=pname: events.append(
                ("weight", owner, pname, _sound(g), _absmax(g))))  # fmt: skip
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
            cast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                    for a in args]  # fmt: skip
            out = mod(*cast, **kwargs)
        return max((float(t.abs().max()) for t in _tensors(out) if t.numel()), default=None)
    except Exception:  # a module that refuses fp32 inputs: the origin is named all the same
        return None


def _forward_origin(calls: list[_Call], loss: torch.Tensor) -> Origin | None:
    for call in calls:
        if call.inputs_finite and not call.output_finite:
            fmt = FORMAT_OF.get(call.output_dtype, str(call.output_dtype))
            limit = FORMATS[fmt].max if fmt in FORMATS else None
            return Origin(0, "forward", call.name, type(call.module).__name__, dtype=fmt,
                          value=call.value, limit=limit)  # fmt: skip
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
            return Origin(0, "weight_grad", name, types.get(name, ""), param=pname,
                          dtype=dtypes.get(pname, ""), value=top)  # fmt: skip
        # The gradient into ``name``'s output: made by the modules that consumed that output.
        made = {i for i, n in produced.items() if n == name}
        consumers = [c.name for c in calls if c.input_ids & made and c.name != name]
        consumers = [n for n in dict.fromkeys(consumers) if not _contains(n, name)]
        culprit = consumers[0] if consumers else name.rpartition(".")[0]
        dtype = next((FORMAT_OF.get(c.output_dtype, "") for c in calls if c.name == name), "")
        return Origin(0, "input_grad", culprit, types.get(culprit, ""), dtype=dtype,
                      consumers=consumers or [culprit])  # fmt: skip
    return None


def _contains(outer: str, inner: str) -> bool:
    """Whether module ``outer`` holds module ``inner`` (a container consumes what its own
    children make: the consumer that matters is the innermost)."""
    return outer == "" or inner.startswith(outer + ".")
