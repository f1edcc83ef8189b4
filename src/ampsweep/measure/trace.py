"""One training step's kernels, from a trace on the meta device: what ``ampsweep predict`` times.

``trace_step`` runs the model's forward, the loss and the backward once on the meta device
(shapes only: no memory, no compute, any model size on any machine) and records every ATen
operation that launches a kernel: its name, the module it runs in (forward or backward), its
FLOPs (``torch.utils.flop_counter``'s formulas: matmuls, convolutions, attention) and the
bytes it reads and writes. A module that cannot run on the meta device is traced on the CPU
instead, with real tensors (slower, same record; zeros where the model lives on meta).

Operations that only re-describe memory (views, transposes, detach) launch no kernel and are
left out. Bytes are counted at the traced dtypes (fp32): the roofline rescales the floating
point ones for a mode's dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.module_tracker import ModuleTracker

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
ATTENTION = "scaled_dot_product_attention"
CONVOLUTIONS = {"convolution", "convolution_backward", "_convolution"}
# What autocast runs in fp32 whatever the mode (CUDA autocast's fp32 list: reductions, norms,
# softmax, losses, transcendental functions), forward and backward; every other op follows
# its inputs, which autocast's matmuls and convolutions leave in the half dtype.
FP32_UNDER_AUTOCAST = (
    "_softmax", "_log_softmax", "softmax", "log_softmax", "native_layer_norm", "layer_norm",
    "native_group_norm", "group_norm", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
    "binary_cross_entropy", "cross_entropy", "exp", "log", "pow", "rsqrt", "reciprocal",
    "sum", "prod", "cumsum", "norm", "_fused_rms_norm", "rms_norm",
)  # fmt: skip
FREE = {"detach", "empty", "empty_like", "empty_strided", "lift_fresh", "_unsafe_view"}


@dataclass(frozen=True)
class Op:
    """One kernel of the step, as traced in fp32."""

    name: str  # the ATen op (``mm``, ``convolution_backward``, ``relu``, ...)
    module: str  # the module it runs in ("" for the loss and the step's own ops)
    backward: bool
    flops: float  # 0 for the memory-bound ops
    float_bytes: float  # floating-point bytes read and written
    other_bytes: float  # integer and boolean bytes (indices, masks)
    shape: tuple[int, ...] = ()  # a 2-D matmul's (m, k, n)

    @property
    def kind(self) -> str:
        """ "matmul", "conv", "attention" (any other op with FLOPs) or "memory"."""
        if self.name in MATMULS:
            return "matmul"
        if self.name in CONVOLUTIONS:
            return "conv"
        return "attention" if self.flops else "memory"

    @property
    def fp32_under_autocast(self) -> bool:
        base = self.name.removesuffix("_backward").removesuffix("_backward_data")
        return base.removesuffix("_forward") in FP32_UNDER_AUTOCAST


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    """What a kernel touches of ``t``: its elements, or its storage where it is expanded."""
    size = t.numel() * t.element_size()
    try:
        return min(size, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return size


def _matmul_shape(name: str, args) -> tuple[int, ...]:
    """(m, k, n) of a 2-D matmul: ``mm(a, b)``, ``addmm(bias, a, b)``."""
    a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
    if not (isinstance(a, torch.Tensor) and a.dim() == 2 and b.dim() == 2):
        return ()
    return (a.shape[0], a.shape[1], b.shape[1])


class _Recorder(TorchDispatchMode):
    """Sees every ATen op as it dispatches. A dispatch mode is the one public hook below
    autograd that sees the backward's ops too (module and tensor hooks see only modules and
    tensors, not the kernels between them); ``FlopCounterMode`` is one, but keeps FLOPs only."""

    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker = tracker
        self.ops: list[Op] = []
        self.backward = False
        self.backward_module = ""  # set by each autograd node as it runs (``_Attribution``)
        self.fused = False  # inside fused attention: its kernels are recorded as one

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if func.is_view or name in FREE or self.fused:
            return out
        counter = flop_registry.get(func._overloadpacket)
        flops = counter(*args, **kwargs, out_val=out) if counter else 0
        floating = other = 0
        for t in _tensors(args) + _tensors(kwargs) + _tensors(out):
            if t.is_floating_point():
                floating += _nbytes(t)
            else:
                other += _nbytes(t)
        shape = _matmul_shape(name, args) if name in ("mm", "addmm") else ()
        module = self.backward_module if self.backward else self.module()
        self.ops.append(Op(name, module, self.backward, flops, floating, other, shape))
        return out

    def module(self) -> str:
        """The innermost module running forward, without the root's class name."""
        names = [n for n in self.tracker.parents if n != "Global"]
        if not names:
            return ""
        inner = max(names, key=lambda n: n.count("."))
        return inner.split(".", 1)[1] if "." in inner else ""


class _Attribution(TorchFunctionMode):
    """Marks each autograd node made in forward with the module that made it, so that its
    backward kernels are counted to that module: the node's pre-hook (public autograd API)
    runs just before them. A node made inside a composite op (cross-entropy's log-softmax)
    is unmarked and runs right after its marked consumer, whose module it keeps."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder
        self.seen: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recorder.backward:
            return func(*args, **kwargs)
        module = self.recorder.module()
        fused = func is F.scaled_dot_product_attention
        if fused:
            self.recorder.fused = True
        try:
            out = func(*args, **kwargs)
        finally:
            self.recorder.fused = False
        if fused:
            self._attention(module, args, kwargs, out)
        for t in _tensors(out):
            node = t.grad_fn
            if node is not None and id(node) not in self.seen:
                self.seen.add(id(node))
                node.register_prehook(self._enter(module, fused))
        return out

    def _enter(self, module: str, fused: bool):
        def hook(grad_outputs):
            self.recorder.backward_module = module
            self.recorder.fused = fused

        return hook

    def _attention(self, module: str, args, kwargs, out: torch.Tensor) -> None:
        """Attention as a GPU runs it in training: one fused kernel forward (flash or
        memory-efficient attention: reads q, k and v, writes the output; the attention matrix
        never reaches memory) and one backward, whatever the traced device decomposed it into."""
        q, k, v = (args + tuple(kwargs.get(n) for n in ("query", "key", "value")))[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        shapes = (q.shape, k.shape, v.shape)
        qkvo = sum(_nbytes(t) for t in (q, k, v, out))
        extra = _nbytes(mask) if isinstance(mask, torch.Tensor) else 0
        ops = self.recorder.ops
        ops.append(Op(ATTENTION, module, False, sdpa_flop_count(*shapes), qkvo, extra))
        grads = sdpa_backward_flop_count(out.shape, *shapes)
        ops.append(Op(ATTENTION + "_backward", module, True, grads, 2 * qkvo, extra))


Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def trace_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss) -> list[Op]:
    """Every kernel of one training step's forward, loss and backward on batch ``(x, y)``, on
    the meta device; on the CPU (a copy of ``x``, ``y``; ``model``'s own tensors) where the
    model cannot run on meta. ``model`` is left as it was: its parameters and buffers are
    stand-ins, its mode restored."""
    try:
        return _trace(model, x, y, loss, torch.device("meta"))
    except (NotImplementedError, RuntimeError):
        return _trace(model, x, y, loss, torch.device("cpu"))


def _trace(model, x, y, loss, device: torch.device) -> list[Op]:
    def stand_in(t: torch.Tensor) -> torch.Tensor:
        if device.type == "meta":
            copy = torch.empty_like(t, device="meta")
        else:  # zeros for a model that lives on the meta device: only shapes matter
            copy = torch.zeros_like(t, device=device) if t.is_meta else t.detach().to(device)
        return copy.requires_grad_(t.requires_grad)

    params = {n: stand_in(p) for n, p in model.named_parameters()}
    buffers = {n: stand_in(b).clone() for n, b in model.named_buffers()}
    if x.is_floating_point():
        x = x.float()  # the step is traced in fp32 (a pure mode's run feeds its half dtype)
    leaves = [p for p in params.values() if p.requires_grad]
    with ModuleTracker() as tracker, _Recorder(tracker) as recorder:
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            with _Attribution(recorder):
                logits = torch.func.functional_call(model, {**params, **buffers}, (x.to(device),))
                value = loss(logits, y.to(device))
            recorder.backward = True
            torch.autograd.grad(value, leaves, allow_unused=True)
    return recorder.ops
