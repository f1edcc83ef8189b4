"""The names under which a run records its numerics: the one place they are written.

``measure.numerics`` and ``measure.probe`` produce them, the job records them, the report
(``report.numerics``) reads them back. No torch here: the report imports this module.
"""

from __future__ import annotations

# Where the first non-finite value began (tags present only on a run that had one)
NONFINITE_STEP, NONFINITE_KIND = "numerics.nonfinite_step", "numerics.nonfinite_kind"
NONFINITE_MODULE, NONFINITE_WHERE = "numerics.nonfinite_module", "numerics.nonfinite_where"
NONFINITE_FIX = "numerics.nonfinite_fix"
# precision | computation (fails in fp32 too) | divergence (the values grew first)
NONFINITE_CAUSE = "numerics.nonfinite_cause"
NONFINITE_STEPS = "numerics/nonfinite_steps"  # metric: how many steps were non-finite
# The numerics probe: metrics, and two tags of ``name=value`` pairs
HEADROOM = "numerics/fp16_forward_headroom_log2"  # log2(65504 / largest forward magnitude)
UNDERFLOW = "numerics/fp16_grad_underflow_frac"  # share fp16 flushes to zero without a scaler
INIT_SCALE = "numerics/suggested_init_scale"  # the power of two that keeps them
UNDERFLOW_AT_SCALE = "numerics/fp16_grad_underflow_frac_at_scale"
UPDATE_LOST = {"bf16": "numerics/bf16_update_lost_frac", "fp16": "numerics/fp16_update_lost_frac"}
PROBE = (HEADROOM, UNDERFLOW, INIT_SCALE, UNDERFLOW_AT_SCALE, *UPDATE_LOST.values())
FP16_OVERFLOW = "numerics.fp16_overflow"  # "amplify=1.83e+05,blocks.1.attn=7.1e+04"
UPDATE_LOST_LAYERS = "numerics.update_lost_layers"  # bf16: "fc1.weight=1.00,fc2.weight=0.42"
FP8_SATURATING = "numerics.fp8_saturating"  # Linear layers an unscaled fp8 cast saturates
RUN_UPDATE_LOST = "amp/update_lost_frac"  # a pure mode's run, on its own steps
# Artifacts
FIRST_NONFINITE_ARTIFACT = "numerics/first_nonfinite.json"
PROBE_JSON, PROBE_MD = "numerics/probe.json", "numerics/probe.md"


def pairs(values: list[tuple[str, float]], spec: str) -> str:
    """``name=value,...``: how the tags above list modules or parameters with a number."""
    return ",".join(f"{name}={value:{spec}}" for name, value in values)
