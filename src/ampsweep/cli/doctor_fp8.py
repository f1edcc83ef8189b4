"""The doctor's numerics gate for an fp8 mode (``engine.fp8_gate``): each layer the mode
converts, its output and gradients against bf16's on a few batches of the model's own data at
its initial weights; the layers under the threshold are prescribed
``precision.fp8.keep_bf16=[...]``, whose own gate and trial show the layers left pass.

What ``Doctor`` lends it: how it composes a config, the precision overrides of a mode (the
user's ``precision.*`` settings included: ``precision.fp8.emulate=true`` on a CPU) and how it
trains a trial. Torch and the engine are imported where they are used, as the doctor's are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ampsweep.cli.prescription import Prescription, Trial
from ampsweep.config.compose import override_key
from ampsweep.precision import modes

if TYPE_CHECKING:  # named only: the gate imports torch where it runs
    from ampsweep.engine.fp8_gate import Gate

GATE_BATCHES = 4  # training batches the gate compares layers on
KEEP_BF16 = "precision.fp8.keep_bf16"


class Fp8Gatekeeper:
    def __init__(
        self,
        load: Callable[[list[str]], Any],
        precision: Callable[..., list[str]],
        trial: Callable[[str, list[str]], Trial],
        say: Callable[[str], None],
    ):
        self.load, self.precision, self.trial, self.say = load, precision, trial, say

    def gate(self, mode: str, *more: str) -> Gate:
        """The gate of ``mode`` with the user's precision settings and ``more`` overrides, on
        the fp32 model as the doctor's trials build it (the same seed: the same weights)."""
        from ampsweep.engine.build import build
        from ampsweep.engine.distributed import unwrap
        from ampsweep.engine.fp8_gate import measure
        from ampsweep.precision.policy import build_policy

        cfg = self.load(self.precision(mode, *more))
        setup = build(self.load(["precision=fp32"]))
        batches = itertools.islice(setup.train_batches.epoch(0), GATE_BATCHES)
        kept = build_policy(cfg.precision, setup.device).kept  # precision.keep_fp32's layers
        model = unwrap(setup.model)
        return measure(model, batches, setup.objective, modes.MODES[mode], cfg.precision.fp8, kept)

    def prescribe(self, mode: str, t: Trial, base: Trial) -> Prescription | None:
        """``precision.fp8.keep_bf16`` for the layers under the gate's threshold (None: every
        converted layer passed), with its own gate and trial."""
        found = self.gate(mode)
        self.say(f"    {found.summary()}")
        if found.passed:
            return None
        keep = found.keep_bf16()
        override = found.override()
        after = self.gate(mode, override)
        worst = ", ".join(f"{la.name}'s {la.least[0]} {la.least[1]:.1f} dB" for la in found.failing)
        problem = (
            f"{t.result(base)}; fp8 loses too much of {worst} (SQNR against bf16, under "
            f"{found.threshold:g} dB)"
        )
        rx = Prescription(mode, problem, {"name": mode, "fp8": {"keep_bf16": keep}})
        rx.gate = f"with {override}: {after.summary()}"
        rx.trial = self.trial(mode, self.precision(mode, override))
        return rx


def launch_settings(tuning: list[str]) -> list[str]:
    """The user's ``precision.fp8.*`` settings a verifying sweep is launched with (its fp8
    runs need them, e.g. the emulation on a CPU; every other mode ignores them), less
    ``keep_bf16``, which the prescription's option sets."""
    keys = [override_key(o) for o in tuning]
    return [
        o
        for o, key in zip(tuning, keys, strict=True)
        if key.startswith("precision.fp8.") and key != KEEP_BF16
    ]
