"""The precision modes: one table, the only place a mode's properties are written down.

Everything that depends on a mode (the training loop's policy, config validation, the report
and its findings, the charts, the underflow diagnostics, ``reproduce``, FLOPs/MFU) asks this
table rather than naming modes. A new mode that fits these fields is one row here and one
YAML file under ``conf/precision/``. No torch here: the config layer and the report (which
must answer without importing torch) read it too. The precision section of the config
(``PrecisionConfig``) is defined and checked here as well, beside the table it refers to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

AUTO = "auto"  # resolved at run time from the hardware (see ``auto_mode``)
BASELINE = "fp32"  # what the report compares every mode with, unless told otherwise


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    # dtype of matmuls and convolutions: autocast's dtype, or the parameters' dtype if pure
    dtype: str  # "fp32" | "fp16" | "bf16"
    autocast: bool  # forward + loss run under torch.autocast(dtype)
    color: str  # its colour in the report's charts
    pure: bool = False  # parameters, activations and gradients are stored in dtype
    tf32: bool = False  # TF32 tensor-core math for fp32 matmuls/convolutions (CUDA only)
    scaler: bool = False  # a GradScaler is on by default
    dynamic_scale: bool = True  # the loss scale grows and backs off (False: a fixed scale)
    devices: tuple[str, ...] = ("cpu", "cuda")  # where it can run
    fallback: str = ""  # what to use instead where it cannot run (the error's fix)
    # fp8 training: torchao's float8 recipe ("tensorwise" | "rowwise") for the eligible
    # nn.Linear layers (both dimensions divisible by 16); every other op runs in ``dtype``
    # under autocast. "": no layer is converted.
    fp8: str = ""
    min_capability: tuple[int, int] | None = None  # the CUDA compute capability it needs
    extra: str = ""  # the ampsweep extra that installs what it needs: pip install 'ampsweep[extra]'
    package: str = ""  # the module that extra provides (checked before a run)
    # Under FSDP (trainer.strategy=fsdp), its mixed-precision policy by default: the dtype the
    # sharded parameters are gathered in for forward and backward, and the dtype gradients
    # are reduce-scattered in. Half-precision gathers halve the traffic and the unsharded
    # weights; an fp32 reduction keeps the sum over many ranks' gradients exact. Overridden
    # by precision.fsdp.param_dtype / precision.fsdp.reduce_dtype.
    fsdp_param_dtype: str = "fp32"
    fsdp_reduce_dtype: str = "fp32"

    @property
    def half(self) -> bool:
        """Whether any math runs in a 16-bit float (everything but fp32 and tf32)."""
        return self.dtype != "fp32"

    @property
    def flop_kind(self) -> str:
        """The column of a GPU's peak-throughput table this mode's math is measured against."""
        if self.fp8:
            return "fp8"
        return "tf32" if self.tf32 else self.dtype

    @property
    def unscaled_fp16(self) -> bool:
        """fp16 math with no loss scaler by default: small gradients underflow to zero."""
        return self.dtype == "fp16" and not self.scaler and not self.pure

    @property
    def full_range(self) -> bool:
        """Gradients keep fp32's exponent range (fp32, tf32, bf16): nothing underflows as in
        fp16, so these modes give the reference for gradient-underflow measurements."""
        return self.dtype != "fp16"


MODES: dict[str, PrecisionMode] = {
    m.name: m
    for m in (
        PrecisionMode("fp32", "fp32", autocast=False, color="#4c72b0"),
        PrecisionMode(
            "tf32", "fp32", autocast=False, tf32=True, color="#64b5cd",
            devices=("cuda",), fallback="fp32",
        ),
        PrecisionMode(
            "fp16", "fp16", autocast=True, scaler=True, color="#dd8452",
            fsdp_param_dtype="fp16",
        ),
        PrecisionMode(
            "fp16_static", "fp16", autocast=True, scaler=True, dynamic_scale=False,
            color="#c44e52", fsdp_param_dtype="fp16",
        ),
        PrecisionMode(
            "fp16_noscale", "fp16", autocast=True, color="#8c564b", fsdp_param_dtype="fp16"
        ),
        PrecisionMode("bf16", "bf16", autocast=True, color="#55a868", fsdp_param_dtype="bf16"),
        # Pure fp16 on a CPU: many CPU kernels (convolution backward, fused optimizers) lack
        # Half support. Pure modes have no fp32 copy to gather or reduce in.
        PrecisionMode(
            "fp16_pure", "fp16", autocast=False, pure=True, color="#da8bc3",
            devices=("cuda",), fallback="bf16_pure or fp16", fsdp_param_dtype="fp16",
            fsdp_reduce_dtype="fp16",
        ),
        PrecisionMode(
            "bf16_pure", "bf16", autocast=False, pure=True, color="#8172b3",
            fsdp_param_dtype="bf16", fsdp_reduce_dtype="bf16",
        ),
        # fp8 (torchao float8 training): bf16 autocast for everything else, and no GradScaler:
        # torchao scales each fp8 cast itself (per tensor, or per row), and bf16 has fp32's
        # exponent range. fp8 tensor cores arrived with Ada and Hopper (compute capability 8.9);
        # on a CPU, only torchao's emulation runs (precision.fp8.emulate=true).
        PrecisionMode(
            "fp8_tensorwise", "bf16", autocast=True, fp8="tensorwise", color="#ccb974",
            min_capability=(8, 9), fallback="bf16", extra="fp8", package="torchao",
            fsdp_param_dtype="bf16",
        ),
        PrecisionMode(
            "fp8_rowwise", "bf16", autocast=True, fp8="rowwise", color="#937860",
            min_capability=(8, 9), fallback="bf16", extra="fp8", package="torchao",
            fsdp_param_dtype="bf16",
        ),
    )
}  # fmt: skip

NAMES = (AUTO, *MODES)  # every value precision.name accepts


@dataclass(frozen=True)
class NumberFormat:
    """A floating-point format's range: what a value must fit to be held (the numerics
    probe's headroom, the underflow diagnostics, the update-rounding check)."""

    name: str
    max: float  # the largest finite value: beyond it, inf
    min_normal: float  # below it, subnormal: fewer significant bits
    min_subnormal: float  # the smallest non-zero value; half of it and less round to zero
    mantissa_bits: int  # explicit fraction bits: a unit in the last place is 2^(e - bits)


FORMATS: dict[str, NumberFormat] = {
    f.name: f
    for f in (
        NumberFormat("fp32", 3.4028234663852886e38, 2.0**-126, 2.0**-149, 23),
        NumberFormat("fp16", 65504.0, 2.0**-14, 2.0**-24, 10),
        NumberFormat("bf16", 3.3895313892515355e38, 2.0**-126, 2.0**-133, 7),
        # fp8 as torchao's float8 training casts to it: e4m3 forward, e5m2 for gradients
        NumberFormat("fp8_e4m3", 448.0, 2.0**-6, 2.0**-9, 3),
        NumberFormat("fp8_e5m2", 57344.0, 2.0**-14, 2.0**-16, 2),
    )
}


# Which CPUs do a 16-bit float's arithmetic natively: the /proc/cpuinfo flags of the
# instructions (x86: AVX512-FP16 and AMX-FP16, AVX512-BF16 and AMX-BF16; Arm: FP16 arithmetic,
# the BF16 extension). Without them, autocast to that dtype on a CPU converts to fp32 and back
# around each op in software, and a model of convolutions slows down by about EMULATED_SLOWDOWN
# (the range runs of fp16 against fp32 on a CPU without avx512_fp16 gave: docs/benchmarks.md).
# bf16 has no such range: the CPU measured had its instructions; on a GPU both are native.
NATIVE_CPU_FLAGS = {
    "fp16": ("avx512_fp16", "amx_fp16", "asimdhp", "fphp"),
    "bf16": ("avx512_bf16", "amx_bf16", "bf16"),
}
EMULATED_SLOWDOWN = {"fp16": (3.0, 60.0)}  # (low, high): times slower than fp32


def cpu_slowdown(mode: PrecisionMode, cpu_flags: set[str] | None) -> tuple[float, float] | None:
    """How much slower than fp32 ``mode`` is expected to train on a CPU with ``cpu_flags``
    (its /proc/cpuinfo flags): (low, high) where the CPU lacks the mode's native arithmetic
    and that is known to cost (fp16); None where it runs at about fp32's speed, or where the
    flags are not known (None: not Linux), since a guess would be no fact."""
    if cpu_flags is None or mode.dtype not in EMULATED_SLOWDOWN:
        return None
    if cpu_flags & set(NATIVE_CPU_FLAGS.get(mode.dtype, ())):
        return None
    return EMULATED_SLOWDOWN[mode.dtype]


def get(name: str) -> PrecisionMode | None:
    """The mode called ``name`` (a report may meet names it does not know: None)."""
    return MODES.get(name)


def auto_mode(device_type: str, bf16_supported: bool) -> str:
    """``auto``: bf16 on a CUDA GPU with bf16, fp16 with a scaler on an older GPU, fp32 on a
    CPU (where half precision is rarely faster)."""
    if device_type == "cuda":
        return "bf16" if bf16_supported else "fp16"
    return "fp32"


def color(name: str) -> str:
    mode = MODES.get(name)
    return mode.color if mode else "#777777"


# ---------------------------------------------------------------- the precision config section


class Dtype(Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


@dataclass
class ScalerConfig:
    """torch.amp.GradScaler options. ``None`` means "the mode's default"."""

    enabled: bool | None = None  # fp16, fp16_static: on; every other mode: off
    dynamic: bool | None = None  # False keeps the scale fixed at init_scale (fp16_static)
    init_scale: float = 65536.0  # GradScaler default 2**16
    growth_factor: float = 2.0  # multiply the scale after growth_interval clean steps (> 1)
    backoff_factor: float = 0.5  # multiply the scale on an inf/NaN step (0 < x < 1)
    growth_interval: int = 2000  # clean steps between growths
    min_scale: float = 1.0  # below this, skipped steps count towards divergence


@dataclass
class Fp8Config:
    """fp8 modes (the table's rows with ``fp8``); every other mode ignores these."""

    # Run torchao's emulation (the fp8 matmuls computed in higher precision): for a CPU or a
    # GPU without fp8 tensor cores, to test a model's conversion. Its speed means nothing.
    emulate: bool = False
    # Keep the model's first and last layers out of fp8 (in bf16 under autocast): the input
    # and the logits are the most sensitive to fp8's 3-bit mantissa.
    keep_first_last: bool = True
    # Linear layers left out of fp8 (in bf16 under autocast): glob patterns on the names of
    # ``model.named_modules()``, as precision.keep_fp32's; a pattern naming a block keeps its
    # Linear layers. For the layers that fp8 slows down, or whose fp8 error is too large.
    keep_bf16: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        """An empty pattern names no layer (a stray comma in the list)."""
        if any(not str(x).strip() for x in self.keep_bf16):
            return [
                f"precision.fp8.keep_bf16=[{','.join(self.keep_bf16)}]: an empty pattern matches "
                "no Linear layer: give layer names, e.g. [fc1] or [blocks.*.mlp]"
            ]
        return []


@dataclass
class FsdpPrecisionConfig:
    """FSDP's mixed-precision policy (``trainer.strategy=fsdp`` only). ``None``: the mode's
    default from the table (``fsdp_param_dtype``, ``fsdp_reduce_dtype``)."""

    param_dtype: Dtype | None = None  # the dtype parameters are all-gathered in
    reduce_dtype: Dtype | None = None  # the dtype gradients are reduce-scattered in


@dataclass
class PrecisionConfig:
    """The precision mode; the derived fields are filled in when the mode is resolved."""

    name: str = AUTO  # a mode of the table above, or auto
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    fsdp: FsdpPrecisionConfig = field(default_factory=FsdpPrecisionConfig)
    # Modules (glob patterns on the names of ``model.named_modules()``, e.g. ``layer4.0.conv1``
    # or ``blocks.*.attn``) that run outside autocast, their inputs cast to fp32: the fix for
    # a module that overflows, or whose half-precision kernel fails, in an autocast mode.
    keep_fp32: list[str] = field(default_factory=list)
    # A pure mode's optimizer steps fp32 copies of its 16-bit parameters (with fp32 state)
    # and rounds them back after each step: updates below the 16-bit weight's resolution
    # accumulate in the copy instead of being lost. Pure modes only.
    master_weights: bool = False
    # Resolved from ``name`` (see the table); recorded so the logged config says what ran.
    dtype: Dtype | None = None
    autocast: bool | None = None  # forward + loss under torch.autocast
    pure: bool | None = None  # parameters and gradients in dtype
    tf32: bool | None = None  # TF32 matmuls and convolutions (CUDA)


# The fields above that a mode decides (cleared when another mode is picked).
DERIVED_PRECISION = ("dtype", "autocast", "pure", "tf32")


def problems(pc: PrecisionConfig) -> list[str]:
    """A known mode; the derived fields may be restated, never contradict the mode."""
    if pc.name not in NAMES:
        return [f"precision.name={pc.name}: invalid value: choose one of {', '.join(NAMES)}"]
    if pc.name == AUTO:
        problem = master_weights_problem(None, pc.master_weights)
        return [problem] if problem else []
    mode = MODES[pc.name]
    p = []
    wanted = {
        "dtype": Dtype[mode.dtype],
        "autocast": mode.autocast,
        "pure": mode.pure,
        "tf32": mode.tf32,
    }
    for key, value in wanted.items():
        given = getattr(pc, key)
        if given is not None and given != value:
            shown = given.name if isinstance(given, Enum) else given
            p.append(
                f"precision.{key}={shown} contradicts precision={pc.name}, which means "
                f"{key}={value.name if isinstance(value, Enum) else value}: pick the mode with "
                f"precision=<mode> instead of setting precision.{key}"
            )
    problem = scaler_problem(mode, pc.scaler.enabled)
    if problem:
        p.append(problem)
    problem = keep_fp32_problem(mode, list(pc.keep_fp32))
    if problem:
        p.append(problem)
    problem = master_weights_problem(mode, pc.master_weights)
    if problem:
        p.append(problem)
    return p


def master_weights_problem(mode: PrecisionMode | None, master_weights: bool) -> str | None:
    """fp32 master weights are a pure mode's: every other mode updates fp32 weights already
    (``None``: auto, which never resolves to a pure mode)."""
    if not master_weights or (mode is not None and mode.pure):
        return None
    name = mode.name if mode else AUTO
    pure = ", ".join(m.name for m in MODES.values() if m.pure)
    return (
        f"precision.master_weights=true needs a pure mode ({pure}), and precision={name} "
        "updates fp32 weights already: drop precision.master_weights, or pick "
        "precision=bf16_pure"
    )


def keep_fp32_problem(mode: PrecisionMode, patterns: list[str]) -> str | None:
    """``precision.keep_fp32`` leaves autocast for some modules: a mode without autocast has
    nothing to leave."""
    shown = f"precision.keep_fp32=[{','.join(patterns)}]"
    if any(not str(x).strip() for x in patterns):
        return f"{shown}: an empty pattern matches no module: give module names, e.g. [fc1]"
    if not patterns or mode.autocast:
        return None
    if mode.pure:
        return (
            f"{shown} cannot run with precision={mode.name}, which stores every parameter in "
            f"{mode.dtype} with no autocast to leave: use precision={mode.dtype} (autocast, "
            f"fp32 weights) with {shown}"
        )
    return (
        f"{shown} changes nothing with precision={mode.name}, which has no autocast (every "
        "module already runs in fp32): drop it, or pick an autocast mode (fp16, bf16, ...)"
    )


def scaler_problem(mode: PrecisionMode, enabled: bool | None) -> str | None:
    """GradScaler refuses half-precision gradients: a pure mode cannot take one."""
    if mode.pure and enabled:
        return (
            f"precision.scaler.enabled=true cannot run with precision={mode.name}: "
            "GradScaler refuses fp16/bf16 gradients; use precision=fp16 for scaled fp16"
        )
    return None
