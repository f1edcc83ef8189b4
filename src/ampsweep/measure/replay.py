"""The replay of a non-finite step, and where its first non-finite value began (``Origin``).

The replay runs the step's micro-batches again at the weights the step saw, in the run's
autocast and at its loss scale, with hooks on every module, on copies of the parameters and
buffers (``torch.func.functional_call``), so that the run's weights, gradients, BatchNorm
statistics and random state are untouched; it names where the value began (an ``Origin``: the
kinds are listed in ``measure.numerics``, the training loop's locator, which calls it). Where
the replay stays finite, the step's own gradients may still name the parameter
(``measure.numerics.from_gradients``).

An ``Origin`` also says itself (``measure.origin``): the sentence and the fix the divergence
message, the run's tags and ``numerics/first_nonfinite.json`` carry. The replay names the
model's head (the innermost module whose output is the model's output) and the size of a
regression's targets, which the origin blames where the value began at the head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ampsweep.measure.hooks import OpWatch, fp32_magnitude, hook_forward, op_name, tensors
from ampsweep.measure.origin import Origin
from ampsweep.precision.modes import FORMATS
from ampsweep.precision.policy import PrecisionPolicy

FORMAT_OF = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


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
    outputs: list[torch.Tensor]  # held while the replay runs: the head is told by identity
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
        dtype = outs[0].dtype if outs else None
        call = _Call(name, mod, _finite(ins), _finite(outs), dtype, outs)
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
            head = _head(calls, out)
            origin = _forward_origin(calls, loss, first_op[0] if first_op else None)
            if origin is None:
                wanted = [p for p in params.values() if p.requires_grad]
                if not wanted or not loss.requires_grad:
                    return None
                first = _watch_backward(loss)
                torch.autograd.grad(loss * loss_weight, wanted, allow_unused=True)
                origin = _backward_origin(first, owner, calls, params, head)
    finally:
        for h in handles:
            h.remove()
    if origin is not None:
        origin.head, origin.targets = head, _targets(y)
    return origin


def _head(calls: list[_Call], out) -> str:
    """The innermost module whose output is the model's output (its last layer: calls finish
    innermost first), '' when the model changes that output itself."""
    model_out = tensors(out)
    for call in calls:
        if call.name and any(o is t for o in call.outputs for t in model_out):
            return call.name
    return ""


def _targets(y) -> float | None:
    """The largest magnitude of float targets (a regression's), else None."""
    if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
        return float(y.detach().abs().max())
    return None


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


def _backward_origin(
    first: list, owner: dict, calls: list[_Call], params: dict, head: str
) -> Origin | None:
    """The node whose backward first made an unsound gradient: a parameter's gradient (through
    casts and views) is the module's weight gradient; a node no module made is the loss's, so
    the gradient it passed back is the model's output's (``output_grad``, at the head); else
    the gradient a module passed back to its input."""
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
    if node not in owner:  # the loss's own backward (or its cast of the model's output)
        return Origin(0, "output_grad", head, types.get(head, ""), dtype=dtype, op=_node_op(node))
    name = owner[node]
    return Origin(
        0, "input_grad", name, types.get(name, ""), dtype=dtype, consumers=[name],
        op=_node_op(node),
    )  # fmt: skip


def _contains(outer: str, inner: str) -> bool:
    """Whether module ``outer`` holds module ``inner`` (a container consumes what its own
    children make: the consumer that matters is the innermost)."""
    return outer == "" or inner.startswith(outer + ".")
