"""The config schema: every key ampsweep reads, its type, default and meaning.

The dataclasses are registered in Hydra's ConfigStore (``register_configs``) and the YAML
files under ``conf/`` are merged onto them, so a misspelt key, a wrong type or an unknown Enum
value fails when the config is composed. OmegaConf matches Enum members by *name*, so member
names are the spellings users type (``precision.name=fp16_static``).

Range and cross-field rules live in ``validate`` (one message listing every problem), which
``__post_init__`` of the root ``Config`` calls when ``OmegaConf.to_object`` builds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class ConfigError(ValueError):
    """A config problem a user can fix; the message names key, value and fix."""


# ---------------------------------------------------------------- precision


class Mode(Enum):
    """Precision modes. ``auto`` resolves at run time from the hardware."""

    auto = "auto"
    fp32 = "fp32"
    tf32 = "tf32"
    fp16 = "fp16"
    fp16_static = "fp16_static"
    fp16_noscale = "fp16_noscale"
    bf16 = "bf16"
    fp16_pure = "fp16_pure"
    bf16_pure = "bf16_pure"


class Dtype(Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


@dataclass(frozen=True)
class ModeSpec:
    """What a precision mode means; the table below is the single definition."""

    compute_dtype: Dtype  # dtype of matmuls/convs (autocast dtype, or the params' dtype if pure)
    autocast: bool  # forward + loss run under torch.autocast(compute_dtype)
    pure: bool  # parameters, activations and gradients are stored in compute_dtype
    tf32: bool  # TF32 tensor-core matmuls/convolutions for fp32 math (CUDA only)
    scaler: bool  # a GradScaler is on by default
    dynamic_scale: bool  # the loss scale grows/backs off (False: a fixed scale)
    cuda_only: bool = False


MODE_SPECS: dict[Mode, ModeSpec] = {
    Mode.fp32: ModeSpec(Dtype.fp32, False, False, False, False, True),
    Mode.tf32: ModeSpec(Dtype.fp32, False, False, True, False, True, cuda_only=True),
    Mode.fp16: ModeSpec(Dtype.fp16, True, False, False, True, True),
    Mode.fp16_static: ModeSpec(Dtype.fp16, True, False, False, True, False),
    Mode.fp16_noscale: ModeSpec(Dtype.fp16, True, False, False, False, True),
    Mode.bf16: ModeSpec(Dtype.bf16, True, False, False, False, True),
    # Pure fp16 on CPU: many CPU kernels (conv backward, fused optimizers) lack Half support.
    Mode.fp16_pure: ModeSpec(Dtype.fp16, False, True, False, False, True, cuda_only=True),
    Mode.bf16_pure: ModeSpec(Dtype.bf16, False, True, False, False, True),
}


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
class PrecisionConfig:
    """The precision mode; the derived fields are filled in when the mode is resolved."""

    name: Mode = Mode.auto
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    # Resolved from ``name`` (see MODE_SPECS); recorded so the logged config says what ran.
    dtype: Dtype | None = None
    autocast: bool | None = None
    pure: bool | None = None
    tf32: bool | None = None


# ---------------------------------------------------------------- model


class ModelName(Enum):
    mlp = "mlp"
    cnn = "cnn"
    resnet18 = "resnet18"
    resnet50 = "resnet50"
    vit = "vit"


@dataclass
class ModelConfig:
    name: ModelName = ModelName.cnn
    width: int = 32  # cnn: channels of the first conv block; mlp: hidden units / 4
    depth: int = 2  # mlp: hidden layers; cnn: conv blocks
    dropout: float = 0.0
    # vit (torchvision VisionTransformer)
    patch_size: int = 2
    hidden_dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    mlp_dim: int = 256
    # resnet: replace the 7x7/stride-2 stem and max-pool by a 3x3/stride-1 conv for images
    # of at most this many pixels a side (CIFAR-style), so small images are not pooled away.
    small_input_max_px: int = 64


# ---------------------------------------------------------------- dataset


class DatasetName(Enum):
    digits = "digits"
    synthetic = "synthetic"
    mnist = "mnist"
    fashion_mnist = "fashion_mnist"
    cifar10 = "cifar10"
    cifar100 = "cifar100"
    imagefolder = "imagefolder"


class Preload(Enum):
    auto = "auto"  # preload to the device when the data set is in memory anyway
    true = "true"
    false = "false"


@dataclass
class DatasetConfig:
    name: DatasetName = DatasetName.digits
    root: str = "data"  # where torchvision data sets / the image folder live
    download: bool = False  # torchvision data sets: fetch when absent (needs network)
    val_fraction: float = 0.2  # digits, synthetic, imagefolder: held-out share
    split_seed: int = 0  # the train/validation split is fixed by this seed
    # synthetic
    num_samples: int = 4096
    channels: int = 3
    image_size: int = 32  # synthetic size; imagefolder resize target
    num_classes: int = 10
    # normalisation: empty lists mean "the data set's own statistics"
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    # augmentation (train split only): random crop with padding and horizontal flip
    random_crop_padding: int = 0
    horizontal_flip: bool = False
    # auto | true | false (see Preload). A string, not the Enum: Hydra parses an unquoted
    # `dataset.preload=true` as a bool, which an Enum field refuses; __post_init__ normalises.
    preload: str = "auto"

    def __post_init__(self) -> None:
        value = self.preload.value if isinstance(self.preload, Enum) else self.preload
        self.preload = str(value).lower()  # True -> "true"; Preload.false -> "false"


# ---------------------------------------------------------------- optimizer


class OptimizerName(Enum):
    sgd = "sgd"
    adamw = "adamw"


class Schedule(Enum):
    none = "none"
    cosine = "cosine"


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw
    eps: float = 1e-8  # adamw
    fused: bool | None = None  # adamw: None = fused on CUDA where available
    schedule: Schedule = Schedule.none
    warmup_steps: int = 0  # cosine: linear warm-up steps
    min_lr_ratio: float = 0.0  # cosine: final lr / lr


# ---------------------------------------------------------------- trainer


class Device(Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


@dataclass
class TrainerConfig:
    device: Device = Device.auto
    epochs: int = 10
    max_steps: int = -1  # > 0 stops after this many optimizer steps
    batch_size: int = 64
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip: float = 0.0  # max global grad norm; 0 disables (with a scaler: after unscale_)
    # Multiplies the training loss before backward, so every gradient shrinks by the same
    # factor (train/loss is logged unmultiplied). 1.0 normally; experiment=underflow_demo uses
    # a small value to move gradients below fp16's range, as a tiny loss magnitude would.
    loss_multiplier: float = 1.0
    eval_every: int = 1  # epochs between evaluations (and always at the end)
    log_every: int = 10  # optimizer steps between train/loss logs
    timing_warmup_steps: int = 5  # steps excluded from perf/step_time_ms
    seed: int = 0
    deterministic: bool = False  # bit-for-bit repeatable runs (slower kernels)
    num_workers: int = 0  # DataLoader workers (only for data that is not preloaded)
    compile: bool = False  # torch.compile the model
    channels_last: bool = False  # NHWC memory format for image models
    progress: bool = True  # a progress bar per epoch at the console
    # checkpoints and resume
    checkpoint_every: int = 0  # optimizer steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept
    checkpoint_dir: str | None = None  # None: <run dir>/checkpoints
    resume: str | None = None  # auto | a checkpoint path | an MLflow run id
    # divergence: stop after this many consecutive non-finite losses (0 disables)
    max_nonfinite_steps: int = 20
    # processes for DistributedDataParallel (1: no DDP); >1 starts torchrun's elastic launcher
    nproc: int = 1


# ---------------------------------------------------------------- tracking


class Tracker(Enum):
    mlflow = "mlflow"
    none = "none"


@dataclass
class TrackingConfig:
    backend: Tracker = Tracker.mlflow
    # None: $MLFLOW_TRACKING_URI if set, else sqlite:///<cwd>/outputs/mlflow.db
    uri: str | None = None
    experiment: str = "ampsweep"
    run_name: str | None = None  # None: <precision>-<model>-<dataset>
    artifact_root: str = "outputs/mlartifacts"  # where new experiments store artifacts
    # Metrics are buffered and written in one asynchronous batch every metrics_flush_seconds
    # (and at the end of the run); metrics_flush_every > 0 also writes every N log calls.
    metrics_flush_seconds: float = 10.0
    metrics_flush_every: int = 0
    skip_finished: bool = True  # a sweep relaunch skips jobs whose identical config FINISHED


@dataclass
class DiagnosticsConfig:
    """Gradient-underflow diagnostics, measured on the true (unscaled) gradients."""

    every: int = 0  # optimizer steps between measurements (0: off; it costs a pass over grads)
    per_layer: bool = True  # write a per-layer table artifact at the end of the run


# ---------------------------------------------------------------- root


@dataclass
class Config:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise ConfigError("; ".join(problems))


def _positive(problems: list[str], key: str, value: Any, fix: str, strict: bool = True) -> None:
    bad = value <= 0 if strict else value < 0
    if bad or (isinstance(value, float) and not math.isfinite(value)):
        need = "> 0" if strict else ">= 0"
        problems.append(f"{key}={value} must be {need}: {fix}")


def validate(cfg: Config) -> list[str]:
    """Every range and cross-field problem in ``cfg``, each as 'key=value ...: fix'."""
    p: list[str] = []
    t, s, o, d, m = cfg.trainer, cfg.precision.scaler, cfg.optimizer, cfg.dataset, cfg.model
    _positive(p, "trainer.epochs", t.epochs, "set trainer.epochs=10")
    _positive(p, "trainer.batch_size", t.batch_size, "set e.g. trainer.batch_size=64")
    _positive(p, "trainer.grad_accum_steps", t.grad_accum_steps, "use 1 for no accumulation")
    _positive(p, "trainer.eval_every", t.eval_every, "set trainer.eval_every=1")
    _positive(p, "trainer.log_every", t.log_every, "set trainer.log_every=10")
    _positive(p, "trainer.grad_clip", t.grad_clip, "use 0 to disable clipping", strict=False)
    _positive(p, "trainer.loss_multiplier", t.loss_multiplier, "use 1.0 for the plain loss")
    _positive(p, "trainer.timing_warmup_steps", t.timing_warmup_steps, "use 0", strict=False)
    _positive(p, "trainer.num_workers", t.num_workers, "use 0", strict=False)
    _positive(p, "trainer.checkpoint_every", t.checkpoint_every, "use 0 for end only", strict=False)
    _positive(p, "trainer.keep_checkpoints", t.keep_checkpoints, "use e.g. 2")
    _positive(
        p, "trainer.max_nonfinite_steps", t.max_nonfinite_steps, "use 0 to disable", strict=False
    )
    _positive(p, "trainer.nproc", t.nproc, "use 1 for a single process")
    _positive(p, "diagnostics.every", cfg.diagnostics.every, "use 0 for off", strict=False)
    if t.max_steps == 0 or t.max_steps < -1:
        p.append(f"trainer.max_steps={t.max_steps} must be > 0, or -1 for no limit")
    _positive(p, "precision.scaler.init_scale", s.init_scale, "use e.g. 65536.0")
    _positive(p, "precision.scaler.growth_interval", s.growth_interval, "use e.g. 2000")
    _positive(p, "precision.scaler.min_scale", s.min_scale, "use e.g. 1.0")
    if not s.growth_factor > 1.0:
        p.append(
            f"precision.scaler.growth_factor={s.growth_factor} must be > 1.0: use e.g. 2.0, "
            "or precision.scaler.dynamic=false for a fixed scale"
        )
    if not 0.0 < s.backoff_factor < 1.0:
        p.append(f"precision.scaler.backoff_factor={s.backoff_factor} must be in (0, 1): use 0.5")
    _positive(p, "optimizer.lr", o.lr, "use e.g. optimizer.lr=1e-3")
    _positive(p, "optimizer.weight_decay", o.weight_decay, "use 0 for none", strict=False)
    _positive(p, "optimizer.eps", o.eps, "use e.g. 1e-8")
    _positive(p, "optimizer.warmup_steps", o.warmup_steps, "use 0", strict=False)
    if not 0.0 <= o.momentum < 1.0:
        p.append(f"optimizer.momentum={o.momentum} must be in [0, 1): use e.g. 0.9")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        p.append(f"optimizer.betas={list(o.betas)} must be two values in [0, 1): use [0.9,0.999]")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        p.append(f"optimizer.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if o.nesterov and (o.name != OptimizerName.sgd or o.momentum == 0):
        p.append("optimizer.nesterov=true needs optimizer=sgd with momentum > 0")
    if not 0.0 < d.val_fraction < 1.0:
        p.append(f"dataset.val_fraction={d.val_fraction} must be in (0, 1): use e.g. 0.2")
    _positive(p, "dataset.num_samples", d.num_samples, "use e.g. 4096")
    if d.preload not in {x.value for x in Preload}:
        p.append(f"dataset.preload={d.preload} must be one of auto, true, false")
    _positive(p, "dataset.channels", d.channels, "use 1 or 3")
    _positive(p, "dataset.image_size", d.image_size, "use e.g. 32")
    if d.num_classes < 2:
        p.append(f"dataset.num_classes={d.num_classes} must be >= 2")
    _positive(p, "dataset.random_crop_padding", d.random_crop_padding, "use 0", strict=False)
    if len(d.mean) != len(d.std) or any(x <= 0 for x in d.std):
        p.append(
            f"dataset.mean={list(d.mean)} / dataset.std={list(d.std)} need equal lengths and "
            "positive std (one value per channel, or both empty for the data set's own)"
        )
    for key in ("width", "depth", "patch_size", "hidden_dim", "num_layers", "num_heads", "mlp_dim"):
        _positive(p, f"model.{key}", getattr(m, key), f"use e.g. model.{key}=4")
    if not 0.0 <= m.dropout < 1.0:
        p.append(f"model.dropout={m.dropout} must be in [0, 1)")
    if m.num_heads > 0 and m.hidden_dim % m.num_heads:
        p.append(
            f"model.hidden_dim={m.hidden_dim} must be divisible by model.num_heads={m.num_heads}"
        )
    p.extend(_precision_problems(cfg.precision))
    if cfg.tracking.metrics_flush_every < 0:
        p.append(f"tracking.metrics_flush_every={cfg.tracking.metrics_flush_every} must be >= 0")
    if not cfg.tracking.metrics_flush_seconds >= 0:
        p.append(
            f"tracking.metrics_flush_seconds={cfg.tracking.metrics_flush_seconds} must be >= 0"
        )
    return p


def _precision_problems(pc: PrecisionConfig) -> list[str]:
    """The derived precision fields may be restated, never contradict the mode's definition."""
    if pc.name == Mode.auto:
        return []
    spec = MODE_SPECS[pc.name]
    p = []
    wanted = {
        "dtype": spec.compute_dtype,
        "autocast": spec.autocast,
        "pure": spec.pure,
        "tf32": spec.tf32,
    }
    for key, value in wanted.items():
        given = getattr(pc, key)
        if given is not None and given != value:
            shown = given.name if isinstance(given, Enum) else given
            p.append(
                f"precision.{key}={shown} contradicts precision={pc.name.name}, which means "
                f"{key}={value.name if isinstance(value, Enum) else value}: pick the mode with "
                f"precision=<mode> instead of setting precision.{key}"
            )
    if spec.pure and pc.scaler.enabled:
        p.append(
            f"precision.scaler.enabled=true cannot run with precision={pc.name.name}: "
            "GradScaler refuses fp16/bf16 gradients; use precision=fp16 for scaled fp16"
        )
    return p


def register_configs() -> None:
    """Register the schema so YAML files under conf/ are validated against it."""
    from hydra.core.config_store import ConfigStore

    # Only the root is stored: conf/config.yaml lists it first in its defaults, so every group
    # file merges onto a typed node. (Group-level schemas would show up as selectable options.)
    ConfigStore.instance().store(name="ampsweep_schema", node=Config)
