"""What a run measures once, after training: the FLOPs of a step and the speed they give, the
memory of the model and of one sample (what capacity predicts from), and the breakdown of the
measured step's peak (``measure.step_peak``)."""

from __future__ import annotations

from ampsweep.engine import distributed, sharded
from ampsweep.engine.build import Setup
from ampsweep.measure import cost, memory
from ampsweep.measure.memory import SavedTensorMeter
from ampsweep.measure.step_peak import StepPeak, breakdown


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
        out.update(breakdown(peak, held, meter))
    s.activations_by_module = meter.by_module_rows()
    return out
