"""Seeing inside a model's forward: a forward hook on each module (refused in words where a
module takes none, ``HookError``), and each op its forward runs, named with the innermost
module running it (``OpWatch``, a ``TorchFunctionMode``: the ops inside a ``forward``, an
``F.*`` call or ``q @ k.T * c``, that no module hook sees).

The probe (``measure.probe``) measures every module and op with them; the replay of a
non-finite step (``measure.replay``) locates with them. Neither runs on a training step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class HookError(RuntimeError):
    """A module the probe or the locator cannot hook (e.g. a TorchScript module)."""


def hook_forward(
    module: torch.nn.Module, hook, name: str = ""
) -> torch.utils.hooks.RemovableHandle:
    """``register_forward_hook(hook, with_kwargs=True)``, refused in words where a module does
    not take hooks."""
    try:
        return module.register_forward_hook(hook, with_kwargs=True)
    except Exception as err:
        raise HookError(
            f"module {name or '(the model)'} ({type(module).__name__}) takes no forward hook "
            f"({type(err).__name__}: {' '.join(str(err).split())[:200]}): the numerics "
            "diagnostics need a plain nn.Module (not TorchScript): pass the eager model"
        ) from None


def tensors(value) -> list[torch.Tensor]:
    """The floating tensors in a module's or an op's inputs or outputs (nested in tuples,
    lists, dicts, and Hugging Face's output objects)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict) or hasattr(value, "values") and hasattr(value, "keys"):
        return [t for v in value.values() for t in tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors(v)]
    return []


def to_fp32(value):
    """``value`` with its floating tensors cast to fp32 (nested as ``tensors`` reads them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().float() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: to_fp32(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_fp32(v) for v in value)
    return value


def fp32_magnitude(func, args, kwargs, device_type: str) -> float | None:
    """The largest magnitude of ``func``'s output (a module or an op) recomputed in fp32,
    outside autocast: what the format had to hold. None if that fails (one that refuses fp32
    inputs is named all the same)."""
    try:
        with torch.no_grad(), torch.autocast(device_type=device_type, enabled=False):
            out = func(*to_fp32(tuple(args)), **to_fp32(dict(kwargs)))
        return max((float(t.abs().max()) for t in tensors(out) if t.numel()), default=None)
    except Exception:
        return None


def op_name(func) -> str:
    """``matmul``, ``mul``, ``softmax``: what a reader calls the op."""
    return getattr(func, "__name__", str(func)).strip("_")


class OpWatch(torch.overrides.TorchFunctionMode):
    """While active, ``on_op(module, func, args, kwargs, out)`` after each op a forward of
    ``model`` runs, ``module`` the name of the innermost module running it (a module stack
    kept by pre- and post-forward hooks, removed on exit). ``paused``: ops not reported
    (a recomputation of the caller's own)."""

    def __init__(self, model: torch.nn.Module, on_op: Callable):
        super().__init__()
        self.model, self.on_op = model, on_op
        self.stack: list[str] = []  # the modules running now, innermost last
        self.paused = False
        self._handles: list = []

    def __enter__(self):
        for name, m in self.model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._push(name)))
            self._handles.append(m.register_forward_hook(self._pop, always_call=True))
        return super().__enter__()

    def _push(self, name: str) -> Callable:
        def push(module, args) -> None:  # None: the inputs stay as they are
            self.stack.append(name)

        return push

    def _pop(self, module, args, out) -> None:  # None: the output stays as it is
        self.stack.pop()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.stack and not self.paused and op_name(func) != "get":  # not a property's read
            self.on_op(self.stack[-1], func, args, kwargs, out)
        return out
