"""What a run measures once, after training: the FLOPs of a step and the speed they give, the
memory of the model and of one sample (what capacity predicts from), the breakdown of the
measured step's peak (``measure.step_peak``), and on a GPU of the table the step time
``ampsweep predict`` gives its mode, against the measured one (``predict/...``)."""

from __future__ import annotations

import torch
from torch import nn

from ampsweep.config.schema import Config, ConfigError, Tracker
from ampsweep.engine import distributed, models, sharded
from ampsweep.engine.build import Setup
from ampsweep.measure import cost, memory, roofline
from ampsweep.measure.memory import SavedTensorMeter
from ampsweep.measure.prediction import Model, against_measured
from ampsweep.measure.roofline import Gpu
from ampsweep.measure.step_peak import StepPeak, breakdown
from ampsweep.measure.trace import Loss, trace_step


def measured(
    s: Setup, median_ms: float | None, meter: SavedTensorMeter, peak: StepPeak
) -> dict[str, float]:
    """FLOPs of one step (per rank: perf/tflops and perf/mfu are per GPU), what one sample
    and the model cost in memory and the largest batch that would fit, counted once after
    training (untimed; after the memory peaks); the breakdown of the measured step's peak
    (``peak``, with what ``meter`` saw saved for backward). Under FSDP they are counted on the
    whole model gathered to rank 0, with the memory a rank holds of it (its shards)."""
    t = s.cfg.trainer
    module, held = distributed.unwrap(s.model), None
    if sharded.is_sharded(s.model):
        held = sharded.held_memory(s.model, s.optimizer, s.cfg)
        assert s.skeleton is not None  # a sharded model's setup keeps its skeleton
        module = sharded.full_module(s.model, s.skeleton, distributed.current().is_main)
        if module is None:  # ranks other than 0 record nothing
            return {}
        module = module.to(s.device)
    x, y = next(iter(s.train_batches.epoch(0)))
    out = {}
    if median_ms:
        step_flops = cost.train_step_flops(module, x, y, s.policy, t.grad_accum_steps, s.objective)
        out.update(cost.speed_metrics(step_flops, median_ms, s.device, s.policy))
    out.update(memory.capacity_metrics(module, s.optimizer, x, y, s.policy, s.objective, held))
    if peak.bytes is not None:  # measured (a resumed run measures its own step)
        held = held if held is not None else memory.model_memory(module, s.optimizer)
        out.update(breakdown(peak, held))
    s.activations_by_module = meter.by_module_rows()
    out.update(predicted(s, median_ms))
    return out


def gpu_of(device: torch.device) -> Gpu | None:
    """The GPU table's entry for the CUDA device a run trains on; None off CUDA or for a GPU
    the table does not know."""
    if device.type != "cuda":
        return None
    found = roofline.lookup_peak(torch.cuda.get_device_name(device))
    return None if found is None else found[1]


def predicted(s: Setup, median_ms: float | None) -> dict[str, float]:
    """``predict/step_ms`` and ``predict/error_pct``: the step ``ampsweep predict`` gives the
    run's mode, model and batch on its GPU, against the measured median step; nothing for a
    run that records nothing, is not on a GPU of the table, or whose model cannot be traced.
    The step is traced as ``ampsweep predict`` traces it, from the model built anew in fp32 on
    the meta device (a compiled, fp8-converted or pure run is predicted from its mode's row,
    not from its converted modules; ``torch.compile`` is not modelled)."""
    if not median_ms or s.cfg.tracking.backend != Tracker.mlflow:
        return {}
    if not distributed.current().is_main:
        return {}
    gpu = gpu_of(s.device)
    if gpu is None:
        return {}
    x, y = next(iter(s.train_batches.epoch(0)))
    fp8 = frozenset(s.fp8.converted)
    try:
        model = fp32_model(s.cfg, s.dataset_info, x)
        traced = traced_model(model, x, y, s.objective, s.optimizer, fp8, s.cfg)
    except (ConfigError, RuntimeError, NotImplementedError):  # a model that cannot be traced
        return {}
    return against_measured(gpu, traced, s.policy.mode, median_ms)


def fp32_model(cfg: Config, info: dict, x: torch.Tensor) -> nn.Module:
    """The run's model as its config builds it, in fp32 on the meta device (no memory), lazy
    layers shaped by a forward pass of two samples there."""
    shape = tuple(int(side) for side in str(info["input_shape"]).split("x"))
    with torch.device("meta"):
        model = models.build_model(cfg.model, shape, info["num_classes"])
    if models.has_lazy_parameters(model):
        models.dry_run(model, x[:2].float().to("meta"), cfg.model.name)
    return model


def traced_model(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: Loss,
    optimizer: torch.optim.Optimizer,
    fp8_layers: frozenset[str] | None,
    cfg: Config,
) -> Model:
    """What ``measure.prediction`` needs of a model: one step on ``(x, y)`` traced, the
    weights autocast casts, the parameters and the optimizer's state per parameter.
    ``fp8_layers``: the Linear layers an fp8 mode converts (None: not known)."""
    ops = trace_step(model, x, y, loss)
    weights = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() >= 2:
            if not isinstance(module, nn.Embedding):  # a lookup: autocast casts no table
                weights[name] = weight.numel()
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kind = type(optimizer).__name__.lower()
    momentum = optimizer.defaults.get("momentum", 0)
    states = 2 if "adam" in kind else 1 if momentum else 0
    types = {name: type(module).__name__ for name, module in model.named_modules()}
    micro = cfg.trainer.grad_accum_steps
    return Model(ops, weights, params, states, fp8_layers, micro, types)
