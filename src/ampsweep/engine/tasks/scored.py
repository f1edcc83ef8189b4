"""The tasks scored by torchmetrics: regression, binary, multi-label and segmentation.

Each one says how the configured loss sees the model's logits and the batch's targets, and
which torchmetrics metrics score a split; the metrics are updated in fp32 whatever the
precision mode (autocast's bf16 or fp16 logits are upcast first), on the logits' device.
Their losses (``loss=mse``, ``loss=bce_with_logits``) are registered here; a bundled data set
picks its task and loss (``conf/dataset/diabetes.yaml``), and the class-index cross-entropy
is refused, with the loss to use, where it cannot train the task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torchmetrics import classification as tmc

from ampsweep.config.schema import ConfigError
from ampsweep.config.score import AUROC, F1, MIOU, RMSE, Score
from ampsweep.engine import distributed
from ampsweep.engine.optim import LOSSES
from ampsweep.engine.tasks import TASKS, Evaluation, LossFn, Task, _score, logits_of

REGRESSION, BINARY, MULTILABEL, SEGMENTATION = "regression", "binary", "multilabel", "segmentation"


@LOSSES.register("mse")
def mse():
    """Mean squared error of the outputs against float targets of their shape."""
    return F.mse_loss


@LOSSES.register("bce_with_logits")
def bce_with_logits(*, pos_weight: float | None = None):
    """Binary cross-entropy on the logits (the sigmoid inside the loss: the form autocast
    keeps in fp32, safe in half precision). ``pos_weight``: weight of the positive class."""
    if pos_weight is None:
        return F.binary_cross_entropy_with_logits

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        weight = torch.tensor(pos_weight, device=logits.device)
        return F.binary_cross_entropy_with_logits(logits, y, pos_weight=weight)

    return loss


class Scored(Task):
    """A task whose split is scored by torchmetrics metrics (``metrics_for``) on the fp32
    logits; val/loss is the configured loss averaged over the batches' samples."""

    extra: tuple[str, ...] = ()  # the metrics reported besides val/loss and the score

    def __init__(self, score: Score) -> None:
        self.score = score

    @property
    def names(self) -> tuple[str, ...]:
        return ("val/loss", self.score.name, *self.extra)

    def targets(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` as the loss takes it beside these logits."""
        return y

    def loss(self, loss_fn, logits, y):
        logits = logits_of(logits).float()
        return loss_fn(logits, self.targets(logits, y))

    def metrics_for(self, logits: torch.Tensor) -> dict[str, torchmetrics.Metric]:
        """A fresh metric for each name after val/loss, for logits shaped like these."""
        raise NotImplementedError

    def scored(self, logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(predictions, targets) as the metrics take them."""
        raise NotImplementedError

    def evaluation(self, loss_fn: LossFn, sync: bool = False) -> Evaluation:
        return MetricEvaluation(self, loss_fn, sync)


class MetricEvaluation(Evaluation):
    """A split scored by torchmetrics: each batch's fp32 logits update the metrics (made on the
    first batch's device); torchmetrics adds the ranks' states together under DDP."""

    def __init__(self, task: Scored, loss_fn: LossFn, sync: bool) -> None:
        self.task, self.loss_fn, self.sync = task, loss_fn, sync
        self.metrics: dict[str, torchmetrics.Metric] = {}
        self.sums: torch.Tensor | None = None  # (loss total, samples), float64

    def update(self, output: Any, y: torch.Tensor) -> None:
        logits = logits_of(output).float()
        if not self.metrics:
            made = self.task.metrics_for(logits)
            self.metrics = {name: m.to(logits.device) for name, m in made.items()}
        n = y.shape[0]
        loss = self.loss_fn(logits, self.task.targets(logits, y)).double() * n
        batch = torch.stack([loss, torch.full_like(loss, float(n))])
        self.sums = batch if self.sums is None else self.sums + batch
        preds, target = self.task.scored(logits, y)
        for metric in self.metrics.values():
            metric.update(preds, target)

    def compute(self) -> tuple[float, ...]:
        assert self.sums is not None  # update() has added the split's batches
        if self.sync:
            distributed.all_reduce(self.sums)
        loss, n = self.sums.tolist()
        values = {name: float(m.compute()) for name, m in self.metrics.items()}
        return (loss / n, *(values[name] for name in self.task.names[1:]))


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


class Regression(Scored):
    """Numbers to predict: outputs and float targets of the same shape; val/rmse (lower is
    better), val/mae and val/r2 over every predicted number."""

    name, extra, default_loss = REGRESSION, ("val/mae", "val/r2"), "mse"

    def targets(self, logits, y):
        return y.float()

    def metrics_for(self, logits):
        return {
            "val/rmse": torchmetrics.MeanSquaredError(squared=False),
            "val/mae": torchmetrics.MeanAbsoluteError(),
            "val/r2": torchmetrics.R2Score(),
        }

    def scored(self, logits, y):
        return logits.flatten(), y.float().flatten()

    def check(self, logits, y, num_classes, model, data):
        logits = logits_of(logits)
        if logits.shape != y.shape:
            raise ConfigError(
                f"task=regression: {model} outputs {_shape(logits)} but {data} gives targets "
                f"of shape {_shape(y)}: make them the same shape (one output per target value)"
            )


class Binary(Scored):
    """One logit per input against targets 0/1 (float or integer), shapes (N,) or (N, 1);
    val/auroc, and val/acc at a probability of 0.5."""

    name, extra, default_loss = BINARY, ("val/acc",), "bce_with_logits"

    def targets(self, logits, y):
        return y.float().reshape(logits.shape)

    def metrics_for(self, logits):
        return {"val/auroc": tmc.BinaryAUROC(), "val/acc": tmc.BinaryAccuracy(threshold=0.5)}

    def scored(self, logits, y):
        return torch.sigmoid(logits.flatten()), y.flatten().long()

    def check(self, logits, y, num_classes, model, data):
        logits = logits_of(logits)
        n = y.shape[0]
        if logits.shape not in ((n,), (n, 1)) or y.shape not in ((n,), (n, 1)):
            raise ConfigError(
                f"task=binary: {model} outputs {_shape(logits)} for targets of shape "
                f"{_shape(y)} from {data}: give one logit per input (batch,) or (batch, 1) "
                "(several labels per input: task=multilabel; one of several classes: "
                "task=classification)"
            )
        _zero_one(y, "binary", data)


class Multilabel(Scored):
    """Several labels per input: logits (N, C) against multi-hot targets (N, C); micro
    val/f1 (at a probability of 0.5) and val/map (mean average precision over the labels)."""

    name, extra, default_loss = MULTILABEL, ("val/map",), "bce_with_logits"

    def targets(self, logits, y):
        return y.float()

    def metrics_for(self, logits):
        c = logits.shape[1]
        return {
            "val/f1": tmc.MultilabelF1Score(num_labels=c, average="micro"),
            "val/map": tmc.MultilabelAveragePrecision(num_labels=c, average="macro"),
        }

    def scored(self, logits, y):
        return torch.sigmoid(logits), y.long()

    def check(self, logits, y, num_classes, model, data):
        logits = logits_of(logits)
        if logits.dim() != 2 or logits.shape != y.shape:
            raise ConfigError(
                f"task=multilabel: {model} outputs {_shape(logits)} but {data} gives targets "
                f"of shape {_shape(y)}: give logits (batch, labels) against multi-hot targets "
                "of the same shape"
            )
        _zero_one(y, "multilabel", data)


def _zero_one(y: torch.Tensor, task: str, data: str) -> None:
    if not bool(((y == 0) | (y == 1)).all()):
        raise ConfigError(
            f"task={task}: {data} gives targets other than 0 and 1 (e.g. "
            f"{y[(y != 0) & (y != 1)][0].item():g}): give 0/1 targets (numbers to predict: "
            "task=regression; class indices: task=classification)"
        )


class Segmentation(Scored):
    """A class per pixel: logits (N, C, H, W) against integer masks (N, H, W); pixels marked
    ``ignore_index`` count in neither the loss nor the metrics. val/miou (mean intersection
    over union of the classes) and val/pixel_acc."""

    name, extra = SEGMENTATION, ("val/pixel_acc",)

    def __init__(self, score: Score, ignore_index: int | None = 255) -> None:
        super().__init__(score)
        self.ignore_index = ignore_index

    def targets(self, logits, y):
        # torch's cross-entropy skips -100 by default: the ignored pixels become that.
        y = y.long()
        return y if self.ignore_index is None else y.masked_fill(y == self.ignore_index, -100)

    def metrics_for(self, logits):
        c, ignore = logits.shape[1], self.ignore_index
        return {
            "val/miou": tmc.MulticlassJaccardIndex(c, ignore_index=ignore, average="macro"),
            "val/pixel_acc": tmc.MulticlassAccuracy(c, ignore_index=ignore, average="micro"),
        }

    def scored(self, logits, y):
        return logits.argmax(dim=1), y.long()

    def check(self, logits, y, num_classes, model, data):
        logits = logits_of(logits)
        if (
            y.is_floating_point()
            or logits.dim() != 4
            or y.shape != logits.shape[:1] + logits.shape[2:]
        ):
            raise ConfigError(
                f"task=segmentation: {model} outputs {_shape(logits)} for masks of shape "
                f"{_shape(y)} ({str(y.dtype)[6:]}) from {data}: give logits (batch, classes, "
                "height, width) against integer masks (batch, height, width)"
            )
        kept = y[y != self.ignore_index] if self.ignore_index is not None else y.flatten()
        top = int(kept.max()) if kept.numel() else 0
        if top >= logits.shape[1] or (kept.numel() and int(kept.min()) < 0):
            raise ConfigError(
                f"task=segmentation: a mask of {data} holds class {top} but {model} outputs "
                f"{logits.shape[1]} classes: build the model for {top + 1} classes, or set "
                f"task.ignore_index={top} if that value marks pixels to skip"
            )


def _registered(name: str, make: Callable[[Score], Task], score: Score, doc: str):
    def build(tolerance: float | None = None) -> Task:
        return make(_score(score, tolerance, name))

    build.__doc__ = doc
    TASKS.register(name)(build)


_registered(
    REGRESSION,
    Regression,
    RMSE,
    "Numbers to predict: val/rmse (lower is better; held within 5% of the baseline's unless "
    "``task.tolerance`` says otherwise), val/mae, val/r2.",
)
_registered(
    BINARY,
    Binary,
    AUROC,
    "One logit per input: val/auroc (held within 1.5 points unless ``task.tolerance`` says "
    "otherwise), val/acc at 0.5.",
)
_registered(
    MULTILABEL,
    Multilabel,
    F1,
    "Several labels per input: micro val/f1 (held within 1.5 points unless "
    "``task.tolerance`` says otherwise), val/map.",
)


@TASKS.register(SEGMENTATION)
def segmentation(tolerance: float | None = None, ignore_index: int | None = 255) -> Task:
    """A class per pixel: val/miou (held within 1.5 points unless ``task.tolerance`` says
    otherwise), val/pixel_acc; mask pixels of ``ignore_index`` are skipped."""
    return Segmentation(_score(MIOU, tolerance, SEGMENTATION), ignore_index)
