"""What the report's findings and its recommendation judge by: when a change of accuracy or
perplexity counts as held, when a language model counts as having learnt, and which modes a
finding speaks of (asked of the mode table, ``precision.modes``)."""

from __future__ import annotations

from ampsweep.precision import modes

ACC_TOLERANCE = 0.015  # accuracy "held" within 1.5 points of the baseline
# Perplexity "held" within 5% of the baseline's: a validation loss within about 0.05 nats.
# Short runs vary more than that with the seed alone (the CPU LM sweep's fp32 run: 9.3 to 12.2
# over four seeds), so a difference beyond it on a short run is a reason to repeat, not proof.
PPL_TOLERANCE = 0.05
# A language model "learnt" when its perplexity is well below the unigram baseline's (what
# predicting each token from its frequency alone gives): below three quarters of it.
LEARNT = 0.75
# A judgment, not a measurement: a few percent of updates rounded away are the smallest steps
# of weights that barely move; beyond one in 20 the weights stop following the optimizer.
UPDATE_TOLERANCE = 0.05


def is_mode(name: str, test) -> bool:
    """Whether the mode called ``name`` passes ``test`` (a mode the table lacks never does)."""
    mode = modes.get(name)
    return mode is not None and test(mode)


def scaled_fp16(m: modes.PrecisionMode) -> bool:
    return m.dtype == "fp16" and m.scaler
