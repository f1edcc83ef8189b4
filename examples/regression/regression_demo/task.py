"""A task of one's own: the median absolute error as the score (lower is better), for targets
with outliers where the mean error misleads. It follows ampsweep's task protocol
(docs/your-task.md): a ``score``, ``loss`` and ``evaluation``; the model's output reaches it
as the model returned it."""

from __future__ import annotations

import torch


class MedianError:
    """Trains with the configured loss (loss=mse); scored by val/median_error."""

    score = {
        "name": "val/median_error",
        "label": "median error",
        "higher_is_better": False,
        "tolerance": 0.05,  # "held" within 5% of the baseline's
        "relative": True,
    }

    def loss(self, loss_fn, output, y):
        return loss_fn(output.float(), y)

    def evaluation(self, loss_fn):
        return MedianErrorEvaluation(loss_fn)

    def check(self, output, y, model, data):
        if output.shape != y.shape:
            raise ValueError(f"{model} outputs {tuple(output.shape)} for targets {tuple(y.shape)}")


class MedianErrorEvaluation:
    """Keeps every absolute error of the split (in fp32) and the loss's total."""

    def __init__(self, loss_fn):
        self.loss_fn, self.errors, self.loss_total, self.n = loss_fn, [], 0.0, 0

    def update(self, output, y):
        output = output.float()
        self.errors.append((output - y).abs().flatten())
        self.loss_total += self.loss_fn(output, y).item() * len(y)
        self.n += len(y)

    def compute(self):
        errors = torch.cat(self.errors)
        return {
            "val/loss": self.loss_total / self.n,
            "val/median_error": errors.median().item(),
            "val/max_error": errors.max().item(),
        }
