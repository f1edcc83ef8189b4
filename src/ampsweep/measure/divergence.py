"""Divergence: stop a run whose loss stays non-finite, without a sync per step.

A step counts as non-finite when its loss is inf/NaN or the scaler skipped it for inf/NaN
gradients. A dynamic GradScaler that is still lowering its scale is doing its job (an fp16
overflow is expected to clear after a few back-offs), so its skipped steps count only once the
scale has fallen below ``precision.scaler.min_scale``.

Cost: ``observe`` only keeps references to the step's loss (and, with a dynamic scaler, its
skip flag and a copy of the scale): no kernel on the CPU path, nothing read back. ``check``
settles the window in one pass at log steps, right after the ``.item()`` that reads the loss,
when the device queue is already drained, so it adds no stall of its own. The price is that a
run stops up to ``log_every - 1`` steps after it crossed the limit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampsweep.precision.policy import StaticGradScaler


class Diverged(RuntimeError):
    """The loss stayed non-finite for ``trainer.max_nonfinite_steps`` consecutive steps."""

    tags = {"diverged": "true"}  # recorded on the run besides the `error` reason


class NonfiniteWatch:
    def __init__(
        self,
        limit: int,
        min_scale: float,
        scaler: torch.amp.GradScaler,
        start: int = 0,
        explain: Callable[[], str] = lambda: "",
    ):
        """``explain``: where the run's first non-finite value began and its fix ('' when
        unknown), said instead of the generic advice (``measure.numerics``)."""
        self.limit, self.min_scale, self.explain = limit, min_scale, explain
        # Only a dynamic scaler lowers its scale; a static one skips without ever recovering.
        self.lowering = scaler.is_enabled() and not isinstance(scaler, StaticGradScaler)
        self.scaled = scaler.is_enabled()
        self.run = self.longest = start  # consecutive non-finite steps, and the most seen
        self._window: list[tuple] = []  # the steps not yet settled (since the last check)

    def observe(self, loss: torch.Tensor, skipped: torch.Tensor, scaler) -> None:
        """After ``scaler.update()``: remember this step (no device work, no sync). ``loss``:
        detached (kept until the next check; the loop's running totals detach it once)."""
        if not self.limit:
            return
        # Private: the public get_scale() is a float, read with a sync each step; the scale
        # stays on the device here (checked on torch 2.14.1; tests/unit/measure/
        # test_divergence.py fails if it moves).
        scale = scaler._scale.clone() if self.lowering else None  # noqa: SLF001
        self._window.append((loss, skipped if self.scaled else None, scale))

    def _settle(self) -> None:
        if not self._window:
            return
        losses, skips, scales = zip(*self._window, strict=True)
        self._window.clear()
        finite = torch.isfinite(torch.stack(losses))
        if not self.scaled and bool(finite.all()):  # the usual window: one read, no list
            self.run = 0
            return
        bad = (~finite).tolist()
        if self.scaled:
            skipped = torch.stack([x.float() for x in skips]).cpu().gt(0).tolist()
            bad = [b or s for b, s in zip(bad, skipped, strict=True)]
        if self.lowering:
            low = torch.stack(list(scales)).float().cpu().lt(self.min_scale).tolist()
            bad = [b and below for b, below in zip(bad, low, strict=True)]
        for b in bad:
            self.run = self.run + 1 if b else 0
            self.longest = max(self.longest, self.run)

    def count(self) -> int:
        """Consecutive non-finite steps up to now (for checkpoints)."""
        self._settle()
        return self.run

    def check(self, step: int) -> None:
        """Raise Diverged once the limit was reached (call at log steps)."""
        self._settle()
        if self.limit and self.longest >= self.limit:
            below = f" with the loss scale below {self.min_scale:g}" if self.lowering else ""
            where = self.explain()
            advice = (
                where
                if where
                else "lower optimizer.lr, clip gradients (trainer.grad_clip), or raise "
                "trainer.max_nonfinite_steps"
            )
            raise Diverged(
                f"loss non-finite for {self.limit} consecutive steps{below} "
                f"(stopped at step {step}): {advice}"
            )
