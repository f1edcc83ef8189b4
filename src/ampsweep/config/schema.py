"""The config schema: every key ampsweep reads, its type, default and meaning.

Two views of one config:

* ``Schema`` is what Hydra composes. It is registered in Hydra's ConfigStore
  (``register_configs``) and the YAML files under ``conf/`` merge onto it, so a misspelt key or
  a wrong type in the fixed sections (precision, trainer, tracking, diagnostics) fails when
  the config is composed. The model, data set, optimizer, task and loss are open: each is a
  mapping whose ``name`` picks a registered builder and whose other keys are that builder's
  own settings (``model.width`` for the cnn, ``dataset.root`` for MNIST), so adding a builder
  never means editing this file. A model, data set or loss may instead name any callable with
  ``_target_`` (Hydra's instantiate form), its arguments as the other keys.
* ``Config`` is what runs: the same sections, typed, with each component split into the keys
  every builder of its kind shares (``dataset.val_fraction``, ``optimizer.lr``) and ``args``,
  the builder's own. ``compose.to_config`` makes it; the engine checks ``args`` against the
  builder's signature (``engine.components``).

OmegaConf matches Enum members by *name*, so member names are the spellings users type. Enums
are kept for closed sets that never grow (a device kind, a schedule); precision modes, models,
data sets and optimizers are strings checked against their table or registry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from ampsweep.errors import ConfigError  # noqa: F401 - re-exported: the config layer's error
from ampsweep.precision import modes
from ampsweep.precision.modes import PrecisionConfig

# ---------------------------------------------------------------- components


# A component may name a callable instead of a registered builder, in the form Hydra's
# ``instantiate`` reads: ``_target_: mypkg.nets.make_net`` with its arguments as sibling keys.
# The YAML keys and the typed fields they become:
TARGET_KEYS = {"_target_": "target", "_partial_": "partial"}


@dataclass
class ModelConfig:
    """``model=<name>``: a registered model builder and its own settings, or ``_target_``: any
    callable returning an ``nn.Module`` (``name`` is then only a label)."""

    name: str = "cnn"  # a registered builder (conf/model/), or a label with _target_
    args: dict[str, Any] = field(default_factory=dict)  # model.<key>: the builder's settings
    target: str | None = None  # _target_: the dotted path of a class or factory


class Preload(Enum):
    auto = "auto"  # preload to the device when the data set is in memory anyway
    true = "true"
    false = "false"


@dataclass
class DatasetConfig:
    """``dataset=<name>``: a registered loader, the keys every data set shares, and its own."""

    name: str = "digits"  # a registered loader (conf/dataset/), or a label with _target_
    args: dict[str, Any] = field(default_factory=dict)  # dataset.<key>: the loader's settings
    target: str | None = None  # _target_: a callable returning a torch Dataset (or two)
    val_fraction: float = 0.2  # data sets without a test split: held-out share
    split_seed: int = 0  # the train/validation split (and generated data) is fixed by this seed
    # normalisation: empty lists mean "the data set's own statistics"
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)  # per channel, as many as mean
    # augmentation (train split only): random crop with padding and horizontal flip
    random_crop_padding: int = 0
    horizontal_flip: bool = False  # flip training images left-right at random
    # auto | true | false (see Preload). A string, not the Enum: Hydra parses an unquoted
    # `dataset.preload=true` as a bool, which an Enum field refuses; __post_init__ normalises.
    preload: str = "auto"

    def __post_init__(self) -> None:
        value = self.preload.value if isinstance(self.preload, Enum) else self.preload
        self.preload = str(value).lower()  # True -> "true"; Preload.false -> "false"


class Schedule(Enum):
    none = "none"
    cosine = "cosine"


@dataclass
class OptimizerConfig:
    """``optimizer=<name>``: a registered optimizer, the keys all share, and its own."""

    name: str = "adamw"  # a registered optimizer (conf/optimizer/): adamw, sgd
    args: dict[str, Any] = field(default_factory=dict)  # optimizer.<key>: e.g. betas, momentum
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.0  # decoupled (AdamW) or L2 (SGD) weight decay
    schedule: Schedule = Schedule.none  # none (constant) or cosine
    warmup_steps: int = 0  # cosine: linear warm-up steps
    min_lr_ratio: float = 0.0  # cosine: final lr / lr


@dataclass
class TaskConfig:
    """``task=<name>``: what is learnt from the data, which decides how the loss is applied to
    a batch and which metrics are reported (``classification``, ``language_modeling``,
    ``regression``, ``binary``, ``multilabel``, ``segmentation``), or ``_target_``: a class of
    your own following the task protocol (docs/your-task.md)."""

    name: str = "classification"  # chosen by the text data sets themselves
    args: dict[str, Any] = field(default_factory=dict)
    target: str | None = None  # _target_: the dotted path of a task class of your own


@dataclass
class LossConfig:
    """``loss=<name>``: a registered loss and its settings, or ``_target_``: a callable that
    makes the loss function (``torch.nn.CrossEntropyLoss``), or with ``_partial_: true`` the
    loss function itself, its arguments bound by name. It receives fp32 logits and targets."""

    name: str = "cross_entropy"  # a registered loss (conf/loss/)
    args: dict[str, Any] = field(default_factory=dict)
    target: str | None = None  # _target_: the dotted path of the loss class or function
    partial: bool = False  # _partial_: true: the target is the loss function itself


# Which typed config each open section becomes (the rest of its keys go to ``args``).
COMPONENTS: dict[str, type] = {
    "model": ModelConfig,
    "dataset": DatasetConfig,
    "optimizer": OptimizerConfig,
    "task": TaskConfig,
    "loss": LossConfig,
}
# Fields of a component config that are not keys its kind shares.
COMPONENT_META = ("name", "args", *TARGET_KEYS.values())


# ---------------------------------------------------------------- trainer


class Device(Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class Strategy(Enum):
    """How ``trainer.nproc > 1`` processes share the training."""

    ddp = "ddp"  # DistributedDataParallel: every rank holds the whole model
    fsdp = "fsdp"  # FSDP2 (fully_shard): parameters, gradients, optimizer state sharded


@dataclass
class FsdpConfig:
    """``trainer.strategy=fsdp``: what is sharded as one unit, and when it is gathered."""

    # Glob patterns on the names of ``model.named_modules()`` (e.g. ``blocks.*``): each module
    # they match is one FSDP unit, gathered for its own forward and backward. Empty: the
    # model's transformer blocks (the GPT's, a Hugging Face model's), else each top-level
    # child that holds parameters. The root module always takes what is left.
    shard: list[str] = field(default_factory=list)
    # Free each unit's gathered parameters after its forward (gathered again for backward):
    # less memory, one more all-gather per unit and step.
    reshard_after_forward: bool = True


@dataclass
class TrainerConfig:
    device: Device = Device.auto  # auto: a CUDA GPU when there is one, else the CPU
    epochs: int = 10  # passes over the training split
    max_steps: int = -1  # > 0 stops after this many optimizer steps
    batch_size: int = 64  # samples per micro-batch (per process under DDP)
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip: float = 0.0  # max global grad norm; 0 disables (with a scaler: after unscale_)
    # Multiplies the training loss before backward, so every gradient shrinks by the same
    # factor (train/loss is logged unmultiplied). 1.0 normally; experiment=underflow_demo uses
    # a small value to move gradients below fp16's range, as a tiny loss magnitude would.
    loss_multiplier: float = 1.0
    eval_every: int = 1  # epochs between evaluations (and always at the end)
    log_every: int = 10  # optimizer steps between train/loss logs
    timing_warmup_steps: int = 5  # steps excluded from perf/step_time_ms
    seed: int = 0  # weights, data order, dropout, augmentation (not the split)
    deterministic: bool = False  # bit-for-bit repeatable runs (slower kernels)
    num_workers: int = 0  # DataLoader workers (only for data that is not preloaded)
    compile: bool = False  # torch.compile the model
    channels_last: bool = False  # NHWC memory format for image models
    progress: bool = True  # a progress bar per epoch at the console
    # checkpoints and resume
    checkpoint_every: int = 0  # optimizer steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept
    checkpoint_dir: str | None = None  # None: outputs/checkpoints
    resume: str | None = None  # auto | a checkpoint path | an MLflow run id
    # divergence: stop after this many consecutive non-finite losses (0 disables)
    max_nonfinite_steps: int = 20
    # processes for DistributedDataParallel (1: no DDP); >1 starts torchrun's elastic launcher
    nproc: int = 1
    # how the processes share the model (with nproc > 1, or under torchrun / SLURM tasks)
    strategy: Strategy = Strategy.ddp
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    # Per-step hooks, each in Hydra's instantiate form ({_target_: pkg.mod.Class, arg: value}):
    # a class with before_update(view) and after_step(state) (engine.loop.Callback). They are
    # meant to watch or stop a run, so they are not part of its identity (the config hash): a
    # callback that edits the gradients it is shown changes the result, not the hash.
    callbacks: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------- tracking


class Tracker(Enum):
    mlflow = "mlflow"
    none = "none"


class OnStoreFailure(Enum):
    """What training does when the MLflow store stops answering (its records wait in the
    run's journal either way): go on, or write a checkpoint and stop."""

    train_on = "train_on"
    stop = "stop"


@dataclass
class TrackingConfig:
    backend: Tracker = Tracker.mlflow  # none: record nothing
    # None: $MLFLOW_TRACKING_URI if set, else sqlite:///<cwd>/outputs/mlflow.db
    uri: str | None = None
    experiment: str = "ampsweep"  # the MLflow experiment runs are recorded in
    run_name: str | None = None  # None: <precision>-<model>-<dataset>
    artifact_root: str = "outputs/mlartifacts"  # where new experiments store artifacts
    # Metrics are buffered and written in one asynchronous batch every metrics_flush_seconds
    # (and at the end of the run); metrics_flush_every > 0 also writes every N log calls.
    metrics_flush_seconds: float = 10.0
    metrics_flush_every: int = 0  # > 0: also write the buffered metrics every N log calls
    skip_finished: bool = True  # a sweep relaunch skips jobs whose identical config FINISHED
    # The trained model as an MLflow model of the run (runs:/<run id>/model), and, when
    # register_model names one, a new version of that registered model per run.
    log_model: bool = True
    register_model: str | None = None  # a registered model name: each run adds a version of it
    # The machine's load (CPU, memory, disk, network; GPUs through NVML) as MLflow's system/
    # metrics, sampled every system_metrics_interval seconds on a background thread.
    system_metrics: bool = True
    system_metrics_interval: float = 2.0  # seconds between system metric samples
    # The store failing for longer than MLflow retries: train on (metrics, tags and the run's
    # end wait in the run's journal, written when the store answers again) or stop.
    on_store_failure: OnStoreFailure = OnStoreFailure.train_on


@dataclass
class DiagnosticsConfig:
    """Numerics diagnostics: gradient underflow on the true (unscaled) gradients, where a
    non-finite value first appears, and the numerics probe (``ampsweep doctor``)."""

    every: int = 0  # optimizer steps between measurements (0: off; it costs a pass over grads)
    per_layer: bool = True  # write a per-layer table artifact at the end of the run
    # Replay the first inf/NaN step with hooks on every module and record where it began
    # (numerics/first_nonfinite.json). Costs a flag read per step; finite steps nothing more.
    locate_nonfinite: bool = True
    # Before training: every module's value ranges at fp32 on a few batches, against each
    # format's range (numerics/probe.json): headroom, fp16 overflow and underflow, the loss
    # scale that keeps the gradients, updates a pure half-precision mode would lose.
    numerics: bool = False
    numerics_batches: int = 2  # micro-batches the probe measures


@dataclass
class SweepConfig:
    """How a sweep (``-m``) runs each of its configurations. The command reads it, when it
    expands the sweep into jobs; a job is one run and records the seed it ran with, so this
    section is not part of a run's ``Config``."""

    # Runs of every configuration, with seeds trainer.seed, trainer.seed + 1, ...: the report
    # then gives each mode's mean with a 95% confidence interval, paired by seed with fp32.
    repeats: int = 1


# ---------------------------------------------------------------- root


def shared_defaults(cls: type) -> dict[str, Any]:
    """The keys every builder of a component kind shares, with their defaults: present in the
    composed section whatever option is picked, so ``dataset.preload=true`` needs no ``+``."""
    obj = cls()
    out = {}
    for f in fields(cls):
        if f.name not in COMPONENT_META:
            value = getattr(obj, f.name)
            out[f.name] = value.name if isinstance(value, Enum) else value
    return out


@dataclass
class Schema:
    """What Hydra composes: the fixed sections typed, the components open (see module doc)."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: dict[str, Any] = field(default_factory=lambda: shared_defaults(ModelConfig))
    dataset: dict[str, Any] = field(default_factory=lambda: shared_defaults(DatasetConfig))
    optimizer: dict[str, Any] = field(default_factory=lambda: shared_defaults(OptimizerConfig))
    task: dict[str, Any] = field(default_factory=lambda: shared_defaults(TaskConfig))
    loss: dict[str, Any] = field(default_factory=lambda: shared_defaults(LossConfig))
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)  # the command's, not a run's


@dataclass
class Config:
    """What runs: ``Schema`` with each component typed (made by ``compose.to_config``)."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)


def _positive(problems: list[str], key: str, value: Any, fix: str, strict: bool = True) -> None:
    bad = value <= 0 if strict else value < 0
    if bad or (isinstance(value, float) and not math.isfinite(value)):
        need = "> 0" if strict else ">= 0"
        problems.append(f"{key}={value} must be {need}: {fix}")


def validate(cfg: Config) -> list[str]:
    """Every range and cross-field problem of the shared keys, each as 'key=value ...: fix'.
    (A builder's own settings are checked by the engine, where the builder lives.)"""
    p: list[str] = []
    t, s, o, d = cfg.trainer, cfg.precision.scaler, cfg.optimizer, cfg.dataset
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
    _positive(p, "diagnostics.numerics_batches", cfg.diagnostics.numerics_batches, "use e.g. 2")
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
    _positive(p, "optimizer.warmup_steps", o.warmup_steps, "use 0", strict=False)
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        p.append(f"optimizer.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if not 0.0 < d.val_fraction < 1.0:
        p.append(f"dataset.val_fraction={d.val_fraction} must be in (0, 1): use e.g. 0.2")
    if d.preload not in {x.value for x in Preload}:
        p.append(f"dataset.preload={d.preload} must be one of auto, true, false")
    _positive(p, "dataset.random_crop_padding", d.random_crop_padding, "use 0", strict=False)
    if len(d.mean) != len(d.std) or any(x <= 0 for x in d.std):
        p.append(
            f"dataset.mean={list(d.mean)} / dataset.std={list(d.std)} need equal lengths and "
            "positive std (one value per channel, or both empty for the data set's own)"
        )
    p.extend(modes.problems(cfg.precision))
    p.extend(cfg.precision.fp8.problems())
    p.extend(_fsdp_problems(cfg))
    mode = modes.get(cfg.precision.name)
    if mode is not None and mode.fp8 and cfg.precision.fp8.emulate and t.compile:
        p.append(
            f"precision.fp8.emulate=true cannot run with trainer.compile=true "
            f"(precision={mode.name}): torchao's fp8 emulation does not compile: drop "
            "trainer.compile for an emulated run (compile is for real fp8 on a GPU)"
        )
    if cfg.tracking.metrics_flush_every < 0:
        p.append(f"tracking.metrics_flush_every={cfg.tracking.metrics_flush_every} must be >= 0")
    if not cfg.tracking.metrics_flush_seconds >= 0:
        p.append(
            f"tracking.metrics_flush_seconds={cfg.tracking.metrics_flush_seconds} must be >= 0"
        )
    tr = cfg.tracking
    _positive(p, "tracking.system_metrics_interval", tr.system_metrics_interval, "use e.g. 2.0")
    if tr.register_model is not None and not str(tr.register_model).strip():
        p.append("tracking.register_model='' is empty: give the registered model's name")
    elif tr.register_model and not tr.log_model:
        p.append(
            f"tracking.register_model={tr.register_model} needs the model logged: drop "
            "tracking.log_model=false, or tracking.register_model"
        )
    return p


def _fsdp_problems(cfg: Config) -> list[str]:
    """FSDP's own settings mean something only under trainer.strategy=fsdp."""
    t, f = cfg.trainer, cfg.precision.fsdp
    p = []
    if t.strategy == Strategy.fsdp:
        if any(not str(x).strip() for x in t.fsdp.shard):
            p.append(
                f"trainer.fsdp.shard=[{','.join(t.fsdp.shard)}]: an empty pattern matches no "
                "module: give module names, e.g. [blocks.*]"
            )
        if cfg.precision.master_weights:  # the masters would need sharding as the state is
            p.append(
                "precision.master_weights=true cannot run with trainer.strategy=fsdp: FSDP "
                "keeps fp32 sharded weights itself: use precision=bf16 (FSDP gathers bf16 "
                "weights), or trainer.strategy=ddp"
            )
        return p
    for key, value in (("param_dtype", f.param_dtype), ("reduce_dtype", f.reduce_dtype)):
        if value is not None:
            p.append(
                f"precision.fsdp.{key}={value.name} is FSDP's and changes nothing under "
                f"trainer.strategy={t.strategy.name}: add trainer.strategy=fsdp, or drop it"
            )
    if t.fsdp.shard:
        p.append(
            f"trainer.fsdp.shard=[{','.join(t.fsdp.shard)}] changes nothing under "
            f"trainer.strategy={t.strategy.name}: add trainer.strategy=fsdp, or drop it"
        )
    return p


def register_configs() -> None:
    """Register the schema so YAML files under conf/ are validated against it (once: storing
    it again converts the whole schema again, and every composition asks for it)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if "ampsweep_schema.yaml" in store.repo:  # (gone again when Hydra's singletons are reset)
        return
    # Only the root is stored: conf/config.yaml lists it first in its defaults, so every group
    # file merges onto a typed node. (Group-level schemas would show up as selectable options.)
    store.store(name="ampsweep_schema", node=Schema)
