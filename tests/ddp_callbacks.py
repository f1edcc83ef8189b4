"""A per-step hook for DDP tests (``trainer.callbacks``): one rank fails on its own."""

from __future__ import annotations

import os

from ampsweep.engine.loop import Callback


class FailAtStep(Callback):
    """Raise after optimizer step ``step`` on rank ``rank`` only: that rank's job fails."""

    def __init__(self, step: int, rank: int):
        self.step, self.chosen = step, rank == int(os.environ.get("RANK", "0"))

    def after_step(self, state) -> None:
        if self.chosen and state.step == self.step:
            raise RuntimeError(f"rank {os.environ.get('RANK')} fails at step {self.step}")
