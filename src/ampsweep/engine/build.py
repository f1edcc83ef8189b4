"""Build everything a run needs from its config: ``build`` turns a validated Config into a
``Setup`` (device, precision policy, data, model, optimizer, schedule, scaler), which the
training loop (``engine.loop.fit``) runs.

Everything that can refuse the config (hardware, data, shapes) fails here, before a run is
recorded.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ampsweep.config.schema import Config, ConfigError, Device, Tracker
from ampsweep.engine import components, data, distributed, fingerprint, models, optim, sharded
from ampsweep.engine.data.batches import Augment, Batches
from ampsweep.engine.fp8 import Conversion, check_fp8, convert_fp8
from ampsweep.engine.optim import check_loss
from ampsweep.engine.tasks import Objective, build_objective, default_objective
from ampsweep.measure.diagnostics import Diagnostics
from ampsweep.measure.memory import reset_peak_memory
from ampsweep.measure.numerics import NoLocator, NonfiniteLocator
from ampsweep.measure.probe import LostUpdates
from ampsweep.precision import modes
from ampsweep.precision.policy import PrecisionPolicy, build_policy


def select_device(choice: Device) -> torch.device:
    if choice == Device.cuda and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda: no CUDA GPU is visible to PyTorch here: use "
            "trainer.device=cpu (or auto), or run on a machine with a GPU"
        )
    if choice == Device.cpu or (choice == Device.auto and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed every generator and set the determinism flags both ways (sweeps share a process)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic


@dataclass
class Setup:
    cfg: Config  # with the precision mode resolved (what actually runs)
    device: torch.device
    policy: PrecisionPolicy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler | optim.ConstantSchedule
    scaler: torch.amp.GradScaler
    train_batches: Batches
    val_batches: Batches
    steps_per_epoch: int
    total_steps: int
    num_params: int
    dataset_info: dict = field(default_factory=dict)
    diagnostics: Diagnostics = field(default_factory=Diagnostics)  # off unless configured
    objective: Objective = field(default_factory=default_objective)  # the task and its loss
    reference: dict[str, float] = field(default_factory=dict)  # numbers about the data
    fp8: Conversion = field(default_factory=Conversion)  # the layers an fp8 mode converted
    data_inputs: list = field(default_factory=list)  # fingerprint.DataInput: what is recorded
    # Where the first non-finite value began (diagnostics.locate_nonfinite), and the run's
    # per-step callbacks (engine.loop.Callback), the locator among them.
    locator: NonfiniteLocator | NoLocator = field(default_factory=NoLocator)
    callbacks: list = field(default_factory=list)
    # Under FSDP: the model's unsharded structure on the meta device (engine.sharded.template)
    skeleton: torch.nn.Module | None = None
    # The modules holding most of what a step saves for backward (the loop's measurement:
    # memory/activations_by_module.json)
    activations_by_module: list[dict] = field(default_factory=list)


def resolve(cfg: Config) -> Config:
    """The config as it will run here: components checked and completed, and the precision
    mode resolved for this machine (``auto`` decided, derived fields filled in). Cheap: no
    data is loaded, so a sweep can decide up front whether a job is already done."""
    return resolve_precision(components.resolve(cfg))


def resolve_precision(cfg: Config) -> Config:
    """A config whose components are resolved, with its precision mode resolved for this
    machine. Raises ConfigError where this machine cannot run the mode."""
    policy = build_policy(cfg.precision, select_device(cfg.trainer.device))
    return _resolved(cfg, policy)


def _resolved(cfg: Config, policy: PrecisionPolicy) -> Config:
    """The precision section as it runs: the mode's fields, and FSDP's dtypes under FSDP."""
    precision = policy.resolved_config(cfg.precision)
    if sharded.wanted(cfg):
        precision = sharded.resolved_precision(precision, policy.mode)
    return replace(cfg, precision=precision)


def build(cfg: Config) -> Setup:
    """Everything a config as composed needs to run (``resolve``, then ``build_planned``)."""
    return build_planned(resolve(cfg))


def build_planned(cfg: Config) -> Setup:
    """Everything a planned config (``resolve``d: what a command's plan holds) needs to run;
    it is not resolved again."""
    t = cfg.trainer
    rank = distributed.current()  # the process group is joined before build (the job)
    device = select_device(t.device)
    policy = build_policy(cfg.precision, device)  # the resolved mode's policy
    fsdp = sharded.wanted(cfg) and rank.enabled  # one process runs the model unsharded
    if fsdp:
        sharded.check(cfg, policy, device)
    seed_everything(t.seed, t.deterministic)
    policy.set_global_state()
    reset_peak_memory(device)

    objective = build_objective(cfg, device)
    splits = data.load(cfg.dataset, cfg.task.name)
    recorded = cfg.tracking.backend == Tracker.mlflow and rank.is_main
    data_inputs = fingerprint.describe(cfg.dataset, splits) if recorded else []
    train_batches, val_batches, preload = _batches(cfg, splits, policy, device, fsdp)
    steps_per_epoch = len(train_batches) // t.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"trainer.grad_accum_steps={t.grad_accum_steps} needs more micro-batches than the "
            f"{len(train_batches)} an epoch has: lower it or trainer.batch_size"
        )
    total = steps_per_epoch * t.epochs
    total = min(total, t.max_steps) if t.max_steps > 0 else total

    model = models.build_model(cfg.model, splits.input_shape, splits.num_classes).to(device)
    check_fit(model, objective, splits, cfg, device)  # also gives lazy layers their shapes
    num_params = models.count_parameters(model)
    model, conversion, skeleton = _prepared(model, cfg, policy, device, train_batches, fsdp)
    optimizer = optim.build_optimizer(cfg.optimizer, model, device, policy.master_weights)
    schedule = optim.build_schedule(cfg.optimizer, optimizer, total)
    if t.compile:
        # torch's stub types compile() as returning a Callable; a Module gives an OptimizedModule
        model = torch.compile(model)  # type: ignore[assignment]
    diagnostics, locator, callbacks = _callbacks(cfg, policy, objective, model, fsdp)
    return Setup(
        cfg=cfg,
        device=device,
        policy=policy,
        model=model,
        optimizer=optimizer,
        schedule=schedule,
        scaler=policy.make_scaler(),  # GradScaler: DTensor reduces FSDP's inf checks over ranks
        train_batches=train_batches,
        val_batches=val_batches,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        num_params=num_params,
        dataset_info={
            "train_samples": train_batches.n,
            "val_samples": val_batches.n,
            "input_shape": "x".join(map(str, splits.input_shape)),
            "num_classes": splits.num_classes,
            "preload": preload,
            **splits.info,
        },
        diagnostics=diagnostics,
        objective=objective,
        reference=splits.reference,
        fp8=conversion,
        data_inputs=data_inputs,
        locator=locator,
        callbacks=callbacks,
        skeleton=skeleton,
    )


def _batches(cfg: Config, splits, policy, device, fsdp: bool) -> tuple[Batches, Batches, bool]:
    """The training and validation batches of ``splits`` on ``device``, and whether they were
    preloaded there (data that fits in memory is)."""
    t, rank = cfg.trainer, distributed.current()
    preload = data.should_preload(cfg.dataset, splits)
    train_split, val_split = splits.train, splits.val
    if preload and not splits.in_memory:
        train_split, val_split = data.materialise(train_split), data.materialise(val_split)
    common = dict(
        device=device,
        dtype=policy.param_dtype,
        seed=t.seed,
        preload=preload,
        num_workers=t.num_workers,
        channels_last=t.channels_last,
        rank=rank.rank,
        world_size=rank.world_size,
    )
    augment = Augment(cfg.dataset.random_crop_padding, cfg.dataset.horizontal_flip)
    train_batches = Batches(
        train_split, t.batch_size, shuffle=True, drop_last=True, augment=augment, **common
    )
    if fsdp:  # every rank scores the whole split: FSDP's forward needs every rank in step
        common.update(rank=0, world_size=1)
    val_batches = Batches(val_split, t.batch_size, shuffle=False, drop_last=False, **common)
    return train_batches, val_batches, preload


def _prepared(model, cfg: Config, policy: PrecisionPolicy, device, batches: Batches, fsdp: bool):
    """The model as the run trains it: in the policy's dtype, its eligible Linear layers in fp8
    (an fp8 mode; before the optimizer is built: converted layers are new modules), the modules
    ``precision.keep_fp32`` names out of autocast, channels-last, sharded or wrapped by DDP.
    Returns it, the fp8 conversion, and the unsharded skeleton under FSDP (else None)."""
    t = cfg.trainer
    model = policy.prepare_model(model)
    conversion = Conversion()
    if policy.mode.fp8:
        x, _ = next(iter(batches.epoch(0)))
        conversion = convert_fp8(
            model, policy.mode, policy.fp8, x, cfg.model.name, policy.kept, fsdp=fsdp
        )
    policy.keep_modules_fp32(model)  # precision.keep_fp32: out of autocast (and of fp8)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    skeleton = None
    if fsdp:  # each rank keeps a shard of every block; FSDP averages the gradients
        skeleton = sharded.template(model)
        model = sharded.shard(model, cfg)
    else:
        model = distributed.wrap(model, device)  # DDP averages gradients over the ranks
    return model, conversion, skeleton


def _callbacks(cfg: Config, policy: PrecisionPolicy, objective: Objective, model, fsdp: bool):
    """The run's own per-step callbacks (``engine.loop.Callback``): gradient-underflow
    diagnostics (``diagnostics.every``), the locator of the first non-finite value
    (``diagnostics.locate_nonfinite``), fp8 scales under FSDP, a pure mode's lost updates.
    Returns the diagnostics, the locator (null objects when off) and the list."""
    t, d = cfg.trainer, cfg.diagnostics
    loss_weight = t.loss_multiplier / t.grad_accum_steps
    diagnostics = Diagnostics(d, loss_weight, objective)
    locator: NonfiniteLocator | NoLocator = NoLocator()
    if d.locate_nonfinite:
        locator = NonfiniteLocator(policy, objective, loss_weight)
    # Diagnostics first: it measures the step's gradients before anything reacts to them.
    callbacks: list = [diagnostics, locator] if d.every > 0 else [locator]  # as Setup.callbacks
    if fsdp and policy.mode.fp8:  # each fp8 weight's scale for the next all-gather
        callbacks.append(sharded.Float8Scales(model))
    if policy.rounds_updates and (d.every or d.numerics):  # the updates rounding throws away
        callbacks.append(LostUpdates(policy.mode.dtype, d.every or t.log_every))
    return diagnostics, locator, callbacks


def check_fit(
    model: torch.nn.Module, objective: Objective, splits: data.Splits, cfg: Config, device
) -> None:
    """One forward pass and the loss on two training samples, before anything is recorded
    about the model: lazy layers get their shapes, and a model whose output the task cannot
    use, or a loss that does not give one number, is refused in one line."""
    x, y = data.sample_inputs(splits.train)
    x = x.to(device, torch.float32) if x.is_floating_point() else x.to(device)
    y = y.to(device)
    label = models.MODELS.builder(cfg.model).label
    logits = models.dry_run(model, x, label)
    data_label = data.DATASETS.builder(cfg.dataset).label
    objective.task.check(logits, y, splits.num_classes, label, data_label)
    try:
        value = objective(logits, y)
    except Exception as err:
        raise ConfigError(
            f"loss={cfg.loss.name}: computing it on the model's output failed "
            f"({type(err).__name__}: {' '.join(str(err).split())[:300]}): make the loss take "
            "(logits, targets)"
        ) from None
    check_loss(value, f"loss={cfg.loss.name}")


def preflight(configs: list[Config]) -> None:
    """Refuse, before anything runs or is recorded, the configs that would fail only once
    built: an fp8 mode this machine or installation cannot run (an fp8 mode's refusal is the
    command's mistake, fixed by a flag or an install, not one job's hardware), a model with
    no Linear layer fp8 can take, or a ``precision.keep_fp32`` pattern that names no module.
    The model is built on the meta device: no memory, no compute. ``configs``: with their
    components resolved (``components.resolve``, as a command's plan has them).
    Raises ConfigError."""
    # dataset -> (two samples, the input shape, the number of classes)
    samples_of: dict[str, tuple[torch.Tensor, tuple[int, ...], int]] = {}
    for cfg in configs:
        mode = modes.get(cfg.precision.name)
        if mode is None or not (mode.fp8 or cfg.precision.keep_fp32):
            continue
        policy = build_policy(cfg.precision, select_device(cfg.trainer.device))
        key = repr(cfg.dataset)
        if key not in samples_of:
            splits = data.load(cfg.dataset, cfg.task.name)
            samples_of[key] = (_two_samples(splits), splits.input_shape, splits.num_classes)
        samples, shape, classes = samples_of[key]
        with torch.device("meta"):
            model = models.build_model(cfg.model, shape, classes)
        if mode.fp8 and models.has_lazy_parameters(model):  # fp8 needs the layers' shapes
            model = _shaped(model, cfg, samples, shape, classes)
        if mode.fp8:
            check_fp8(model, samples, mode, cfg, policy.kept)
        policy.keep_modules_fp32(model)  # every keep_fp32 pattern names a module


def _shaped(model, cfg: Config, samples: torch.Tensor, shape, classes) -> torch.nn.Module:
    """A model with lazy layers after one forward pass, which gives them their shapes: on the
    meta device where the model runs there (no memory), else on the CPU (a model that asks
    autocast about its device, say, cannot run on meta)."""
    label = models.MODELS.builder(cfg.model).label
    with torch.no_grad():
        try:
            models.dry_run(model, samples.to("meta"), label)
            return model
        except ConfigError:
            model = models.build_model(cfg.model, shape, classes)
            models.dry_run(model, samples, label)
            return model


def _two_samples(splits) -> torch.Tensor:
    """Two training inputs, as a batch (their values do not matter: only shapes are traced)."""
    if splits.in_memory:
        x = splits.train[0][:2]
    else:
        x = torch.stack([torch.as_tensor(splits.train[i][0]) for i in range(2)])
    return x.float() if x.dtype == torch.uint8 else x
