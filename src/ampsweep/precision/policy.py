"""The precision policy: everything a precision mode changes in a run, in one object.

The training loop never branches on the mode. It asks the policy for an autocast context
(a real one or a disabled one), a GradScaler (``enabled=False`` makes every call a no-op),
the dtype its inputs and parameters live in, and the global TF32 flags, which every mode sets
both ways because Hydra runs the jobs of a sweep in one process. What a mode *is* comes from
the mode table (``precision.modes``); ``resolve_mode`` is the one place a configured mode
becomes the mode that runs on a device.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import importlib.util
from dataclasses import dataclass, field, replace

import torch

from ampsweep.errors import ConfigError
from ampsweep.precision import modes
from ampsweep.precision.modes import (
    Dtype,
    Fp8Config,
    PrecisionConfig,
    PrecisionMode,
    ScalerConfig,
    keep_fp32_problem,
    master_weights_problem,
    scaler_problem,
)

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_mode(name: str, device: torch.device, emulate: bool = False) -> PrecisionMode:
    """The mode that runs for ``precision.name`` on ``device`` (``auto`` decided by the
    hardware), refused with the fix where this hardware (or this installation) cannot run it.
    ``emulate``: ``precision.fp8.emulate``, an fp8 mode's emulation where fp8 cannot run."""
    if name == modes.AUTO:
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        name = modes.auto_mode(device.type, bf16)
    mode = modes.MODES[name]
    if mode.package and importlib.util.find_spec(mode.package) is None:
        raise ConfigError(
            f"precision={mode.name} needs {mode.package}, which is not installed: "
            f"pip install 'ampsweep[{mode.extra}]' (or use precision={mode.fallback})"
        )
    if device.type not in mode.devices:
        raise ConfigError(
            f"precision={mode.name} needs a CUDA GPU, but this run is on {device.type}: "
            f"use precision={mode.fallback} here, or run on a CUDA machine"
        )
    if mode.fp8 and not emulate:
        _check_fp8_hardware(mode, device)
    if (
        device.type == "cuda"
        and mode.dtype == "bf16"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError(
            f"precision={mode.name} needs a GPU with native bf16 (compute capability 8.0+), "
            f"and {torch.cuda.get_device_name(device)} has none: use precision=fp16"
        )
    return mode


def _check_fp8_hardware(mode: PrecisionMode, device: torch.device) -> None:
    """fp8 matmuls need fp8 tensor cores; elsewhere only the (slow) emulation runs."""
    need = ".".join(map(str, mode.min_capability or ()))
    if device.type != "cuda":
        raise ConfigError(
            f"precision={mode.name} on {device.type} runs only in torchao's emulation (for "
            "testing a model's conversion; its speed means nothing): add "
            f"precision.fp8.emulate=true, or run on a GPU with compute capability {need}+ "
            "(Ada, Hopper or later)"
        )
    have = torch.cuda.get_device_capability(device)
    if mode.min_capability and have < mode.min_capability:
        raise ConfigError(
            f"precision={mode.name} needs fp8 tensor cores (compute capability {need}+: L4, "
            f"L40S, H100, H200 or later), and {torch.cuda.get_device_name(device)} has "
            f"{have[0]}.{have[1]}: use precision={mode.fallback}, or precision.fp8.emulate=true "
            "to test the conversion (slowly)"
        )


def keep_fp32_unmatched(patterns: list[str], names: list[str]) -> str:
    """The one-line refusal of keep_fp32 patterns that match no module of the model."""
    parts = []
    for pattern in patterns:
        close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
        near = f" (closest: {', '.join(close)})" if close else ""
        parts.append(f"{pattern}{near}")
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return (
        f"precision.keep_fp32: no module of the model is called {'; '.join(parts)}: use names "
        f"from model.named_modules() ({shown}), or glob patterns such as 'layer4.*'"
    )


class Fp32Forward:
    """A module's forward outside autocast, its floating inputs cast to fp32.

    Set as the module's own ``forward`` attribute (``nn.Module.__call__`` looks it up on the
    instance first), so the module keeps its class, its parameter names and its hooks:
    checkpoints, DDP, ``torch.compile`` and deep copies see the same module. A class, not a
    closure, so that the module still pickles (the logged model, spawned processes).
    """

    def __init__(self, module: torch.nn.Module, device_type: str):
        self.module, self.device_type = module, device_type

    def __call__(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, enabled=False):
            args = tuple(_to_fp32(a) for a in args)
            kwargs = {k: _to_fp32(v) for k, v in kwargs.items()}
            return type(self.module).forward(self.module, *args, **kwargs)


def _to_fp32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


class StaticGradScaler(torch.amp.GradScaler):
    """A GradScaler whose scale never changes.

    ``step`` still skips an optimizer step whose gradients hold inf/NaN (the skip is counted by
    the loop); ``update`` resets the scale to the fixed value instead of backing off or growing.
    """

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(self._init_scale if new_scale is None else new_scale)


@dataclass(frozen=True)
class PrecisionPolicy:
    mode: PrecisionMode
    device: torch.device
    scaler: ScalerConfig  # enabled/dynamic resolved to booleans
    fp8: Fp8Config = field(default_factory=Fp8Config)  # fp8: emulation, first/last layers
    keep_fp32: tuple[str, ...] = ()  # module-name patterns that run outside autocast
    # A pure mode's optimizer steps fp32 copies of the parameters (engine.optim.MasterWeights)
    master_weights: bool = False

    @property
    def emulated(self) -> bool:
        """fp8 run in torchao's emulation: its speed says nothing about fp8 hardware."""
        return bool(self.mode.fp8) and self.fp8.emulate

    @property
    def compute_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.mode.dtype]

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of parameters, gradients and inputs: half in pure modes, else fp32."""
        return self.compute_dtype if self.mode.pure else torch.float32

    @property
    def rounds_updates(self) -> bool:
        """Whether each update is added to 16-bit weights, which round away an update below
        half a unit in their last place: a pure mode without fp32 master weights."""
        return self.mode.pure and not self.master_weights

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around the forward pass and the loss only; disabled (not absent) when off, so an
        outer autocast cannot leak in."""
        return torch.autocast(
            device_type=self.device.type, dtype=self.compute_dtype, enabled=self.mode.autocast
        )

    def make_scaler(self) -> torch.amp.GradScaler:
        s = self.scaler
        cls = torch.amp.GradScaler if s.dynamic else StaticGradScaler
        return cls(
            self.device.type,
            init_scale=s.init_scale,
            growth_factor=s.growth_factor,
            backoff_factor=s.backoff_factor,
            growth_interval=s.growth_interval,
            enabled=bool(s.enabled),
        )

    def set_global_state(self) -> None:
        """Set the process-wide flags this mode depends on, both ways."""
        set_tf32(self.mode.tf32)
        torch.clear_autocast_cache()

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(dtype=self.param_dtype)

    def kept(self, name: str) -> bool:
        """Whether the module called ``name`` runs in fp32 (``precision.keep_fp32``)."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.keep_fp32)

    def keep_modules_fp32(self, model: torch.nn.Module) -> list[str]:
        """Make the modules ``precision.keep_fp32`` names run outside autocast, their inputs
        cast to fp32; the names of the modules it changed. A pattern that matches no module
        is refused, with the closest names (the model is unchanged then)."""
        names = [n for n, _ in model.named_modules() if n]
        unmatched = [p for p in self.keep_fp32 if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unmatched:
            raise ConfigError(keep_fp32_unmatched(unmatched, names))
        chosen = [n for n in names if self.kept(n)]
        for name in chosen:
            module = model.get_submodule(name)
            if not isinstance(module.__dict__.get("forward"), Fp32Forward):
                module.forward = Fp32Forward(module, self.device.type)
        return chosen

    def resolved_config(self, pc: PrecisionConfig) -> PrecisionConfig:
        """The config as it ran: the concrete mode and its derived fields filled in."""
        m = self.mode
        return replace(
            pc,
            name=m.name,
            scaler=self.scaler,
            dtype=Dtype[m.dtype],
            autocast=m.autocast,
            pure=m.pure,
            tf32=m.tf32,
        )


def set_tf32(enabled: bool) -> None:
    """TF32 for fp32 matmuls and cuDNN convolutions. Set explicitly in every run: PyTorch's
    defaults differ between matmul (off) and cuDNN (on), and a sweep must not inherit them."""
    # The fp32_precision API (PyTorch 2.9+): mixing it with the legacy allow_tf32 flags is an
    # error when the flags are read, so only the new one is used where it exists.
    value = "tf32" if enabled else "ieee"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = value
        # torch's stubs lack cudnn.conv (a module attribute set at import in PyTorch 2.9+)
        torch.backends.cudnn.conv.fp32_precision = value  # type: ignore[attr-defined]
    else:  # older PyTorch
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def tf32_enabled() -> tuple[bool, bool]:
    """(matmul, cuDNN convolution) TF32 state."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return (
            torch.backends.cuda.matmul.fp32_precision == "tf32",
            torch.backends.cudnn.conv.fp32_precision == "tf32",  # type: ignore[attr-defined]
        )
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def build_policy(pc: PrecisionConfig, device: torch.device) -> PrecisionPolicy:
    mode = resolve_mode(pc.name, device, emulate=pc.fp8.emulate)
    enabled = mode.scaler if pc.scaler.enabled is None else pc.scaler.enabled
    dynamic = mode.dynamic_scale if pc.scaler.dynamic is None else pc.scaler.dynamic
    # auto may resolve to a mode that refuses these
    problem = (
        scaler_problem(mode, enabled)
        or keep_fp32_problem(mode, list(pc.keep_fp32))
        or master_weights_problem(mode, pc.master_weights)
    )
    if problem:
        raise ConfigError(problem)
    scaler = replace(pc.scaler, enabled=enabled, dynamic=dynamic)
    return PrecisionPolicy(
        mode, device, scaler, pc.fp8, tuple(pc.keep_fp32), bool(pc.master_weights)
    )


_NO_SKIP = torch.zeros(())


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """1.0 if this step's gradients held inf/NaN (so ``scaler.step`` will skip it), else 0.0.

    Read from the inf checks ``unscale_`` recorded for this optimizer (GradScaler keeps them
    per optimizer until ``update``); stays on the device, so it adds no synchronisation.
    Only valid between ``scaler.unscale_(optimizer)`` and ``scaler.update()``.
    """
    if not scaler.is_enabled():
        return _NO_SKIP  # shared: nothing is allocated per step without a scaler
    # Private: GradScaler has no public way to read its inf checks without a sync (checked
    # on torch 2.14.1; tests/unit/precision/test_policy.py fails if it moves).
    per_device = scaler._found_inf_per_device(optimizer)  # noqa: SLF001
    return sum(v.float() for v in per_device.values()).clamp(max=1.0)
