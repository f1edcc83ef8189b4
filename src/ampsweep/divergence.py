"""Divergence: stop a run whose loss stays non-finite, without a sync per step.

A step counts as non-finite when its loss is inf/NaN or the scaler skipped it for inf/NaN
gradients. A dynamic GradScaler that is still lowering its scale is doing its job (an fp16
overflow is expected to clear after a few back-offs), so its skipped steps count only once the
scale has fallen below ``precision.scaler.min_scale``.

Cost: ``observe`` runs a few tiny tensor ops on the device per optimizer step (a running
count of consecutive non-finite steps and its maximum) and never reads them back. ``check``
reads the maximum with one ``.item()``; the loop calls it at log steps, right after the
``.item()`` that reads the loss, when the device queue is already drained, so it adds no
stall of its own. The price is that a run stops up to ``log_every - 1`` steps after it
crossed the limit.
"""

from __future__ import annotations

import torch

from ampsweep.precision import StaticGradScaler


class Diverged(RuntimeError):
    """The loss stayed non-finite for ``trainer.max_nonfinite_steps`` consecutive steps."""

    tags = {"diverged": "true"}  # recorded on the run besides the `error` reason


class NonfiniteWatch:
    def __init__(
        self,
        limit: int,
        min_scale: float,
        scaler: torch.amp.GradScaler,
        device: torch.device,
        start: int = 0,
    ):
        self.limit, self.min_scale = limit, min_scale
        # Only a dynamic scaler lowers its scale; a static one skips without ever recovering.
        self.lowering = scaler.is_enabled() and not isinstance(scaler, StaticGradScaler)
        self.run = torch.full((), start, dtype=torch.int64, device=device)
        self.longest = self.run.clone()

    def observe(self, loss: torch.Tensor, skipped: torch.Tensor, scaler) -> None:
        """After ``scaler.update()``: count this step if it was non-finite (device-side)."""
        if not self.limit:
            return
        bad = ~torch.isfinite(loss.detach()) | (skipped.to(self.run.device) > 0)
        if self.lowering:
            bad &= scaler._scale < self.min_scale  # noqa: SLF001 - the device-side scale
        self.run = torch.where(bad, self.run + 1, torch.zeros_like(self.run))
        self.longest = torch.maximum(self.longest, self.run)

    def count(self) -> int:
        """Consecutive non-finite steps up to now (a sync: for checkpoints)."""
        return int(self.run.item())

    def check(self, step: int) -> None:
        """Raise Diverged once the limit was reached (one sync: call at log steps)."""
        if self.limit and self.longest.item() >= self.limit:
            below = f" with the loss scale below {self.min_scale:g}" if self.lowering else ""
            raise Diverged(
                f"loss non-finite for {self.limit} consecutive steps{below} "
                f"(stopped at step {step}): lower optimizer.lr, clip gradients "
                "(trainer.grad_clip), or raise trainer.max_nonfinite_steps"
            )
