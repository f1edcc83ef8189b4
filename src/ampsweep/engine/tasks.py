"""Tasks: what is learnt from a batch, which decides how the loss sees the logits and what
is reported.

A task is a small object registered by name (``task=classification``, the default, and
``task=language_modeling``). The training loop stays one loop: it calls the run's
``Objective`` (the task and the configured loss) on the model's output, and the task turns the
evaluation sums into metrics. The loss is always computed in fp32 on fp32 logits, whatever
the precision mode. FLOPs counting and the gradient-underflow diagnostics receive the same
``Objective``, so every number of a run is about the same loss.

Models and data sets say which task they serve (``@MODELS.register(..., task=...)``); a
``_target_`` component serves whatever task the config names, and the shapes it produces are
checked against the task when the run is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ampsweep.config.schema import Config, ConfigError
from ampsweep.config.score import ACCURACY, PERPLEXITY, Score
from ampsweep.engine.optim import build_loss
from ampsweep.engine.registry import Builder, Registry

TASKS = Registry("task", provided=())
CLASSIFICATION, LANGUAGE_MODELING = "classification", "language_modeling"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Task:
    """How a batch's logits and targets meet the loss, and what an evaluation reports."""

    name = ""
    score: Score  # the quality metric besides val/loss (val/acc) and how it is judged
    unit = "sample"  # what perf/<unit>s_per_s counts beside samples (tokens for text)

    def loss(self, loss_fn: LossFn, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def eval_sums(self, loss_fn: LossFn, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Sums over one batch, float64 on the device: (loss total, score total, count)."""
        raise NotImplementedError

    def finish(self, sums: list[float]) -> tuple[float, float]:
        """(val/loss, score) of a whole split from its summed ``eval_sums``."""
        raise NotImplementedError

    def metrics(self, evaluation: tuple[float, float]) -> dict[str, float]:
        return {"val/loss": evaluation[0], self.score.name: evaluation[1]}

    def throughput(self, samples_per_s: float, y: torch.Tensor) -> dict[str, float]:
        """Extra throughput metrics of a batch shaped like ``y`` (e.g. tokens per second)."""
        return {}

    def check(
        self, logits: torch.Tensor, y: torch.Tensor, num_classes: int, model: str, data: str
    ) -> None:
        """Refuse targets (from ``data``) or a model output (of ``model``) this task cannot
        use: one line, with the fix."""
        raise NotImplementedError


class Classification(Task):
    """One label per input: logits (N, C), targets (N,)."""

    name = CLASSIFICATION

    def __init__(self, score: Score = ACCURACY) -> None:
        self.score = score

    def loss(self, loss_fn, logits, y):
        return loss_fn(logits.float(), y)

    def eval_sums(self, loss_fn, logits, y):
        n = y.shape[0]
        total = loss_fn(logits.float(), y).double() * n
        correct = (logits.argmax(dim=1) == y).sum().double()
        count = torch.full((), float(n), dtype=torch.float64, device=y.device)
        return torch.stack([total, correct, count])

    def finish(self, sums):
        loss, correct, n = sums
        return loss / n, correct / n

    def check(self, logits, y, num_classes, model, data):
        if y.dim() != 1:
            raise ConfigError(
                f"task=classification: {data} gives targets of shape {tuple(y.shape)[1:]} per "
                "sample, not one integer label: use task=language_modeling for token sequences"
            )
        if logits.dim() != 2:
            raise ConfigError(
                f"task=classification: {model} outputs {tuple(logits.shape)} for a batch of "
                f"{y.shape[0]} from {data}: a classifier returns logits of shape (batch, "
                "classes)"
            )
        if logits.shape[1] < num_classes:
            raise ConfigError(
                f"{model} outputs {logits.shape[1]} classes but the labels of {data} go up to "
                f"{num_classes - 1}: build the model for {num_classes} classes (take "
                "num_classes in its signature, and ampsweep passes it)"
            )


class LanguageModeling(Task):
    """Next-token prediction: logits (N, T, V) and targets (N, T), the loss over every position.
    ``val/perplexity`` is exp of the mean next-token cross-entropy (whatever loss trains)."""

    name, unit = LANGUAGE_MODELING, "token"

    def __init__(self, score: Score = PERPLEXITY) -> None:
        self.score = score

    def loss(self, loss_fn, logits, y):
        return loss_fn(logits.float().flatten(0, -2), y.flatten())

    def eval_sums(self, loss_fn, logits, y):
        flat, targets = logits.float().flatten(0, -2), y.flatten()
        n = targets.numel()
        nll = F.cross_entropy(flat, targets, reduction="sum")
        total = loss_fn(flat, targets).double() * n
        count = torch.full((), float(n), dtype=torch.float64, device=y.device)
        return torch.stack([total, nll.double(), count])

    def finish(self, sums):
        loss, nll, n = sums
        return loss / n, math.exp(min(nll / n, 700.0))  # exp overflows past ~709

    def throughput(self, samples_per_s, y):
        return {"perf/tokens_per_s": samples_per_s * y[0].numel()}

    def check(self, logits, y, num_classes, model, data):
        if y.dim() != 2:
            raise ConfigError(
                f"task=language_modeling: {data} gives targets of shape {tuple(y.shape)[1:]} "
                "per sample, not a token sequence: use task=classification for labelled inputs"
            )
        if logits.dim() != 3 or logits.shape[:2] != y.shape:
            raise ConfigError(
                f"task=language_modeling: {model} outputs {tuple(logits.shape)} for token "
                f"sequences of shape {tuple(y.shape)} from {data}: a causal LM returns logits "
                "of shape (batch, sequence, vocabulary)"
            )
        if logits.shape[-1] < num_classes:
            raise ConfigError(
                f"{model} outputs a vocabulary of {logits.shape[-1]} but the tokens of {data} "
                f"go up to {num_classes - 1}: build the model for vocab_size={num_classes} (take"
                " vocab_size in its signature, and ampsweep passes it)"
            )


def _score(score: Score, tolerance: float | None, task: str) -> Score:
    """The task's score, with ``task.tolerance`` (the change against the baseline that still
    counts as quality held) where the config sets one."""
    if tolerance is None:
        return score
    if not isinstance(tolerance, int | float) or isinstance(tolerance, bool) or tolerance < 0:
        raise ConfigError(
            f"task.tolerance={tolerance!r} (task={task}): give a number >= 0 in the unit of "
            f"{score.name} ({score.within()} by default), or null for the default"
        )
    return replace(score, tolerance=float(tolerance))


@TASKS.register(CLASSIFICATION)
def classification(tolerance: float | None = None) -> Task:
    """One label per input (images): metrics val/loss and val/acc (held within 1.5 points of
    the baseline's unless ``task.tolerance`` says otherwise, e.g. 0.005)."""
    return Classification(_score(ACCURACY, tolerance, CLASSIFICATION))


@TASKS.register(LANGUAGE_MODELING)
def language_modeling(tolerance: float | None = None) -> Task:
    """Next-token prediction on text: metrics val/loss, val/perplexity, perf/tokens_per_s
    (perplexity held within 5% of the baseline's unless ``task.tolerance`` says otherwise)."""
    return LanguageModeling(_score(PERPLEXITY, tolerance, LANGUAGE_MODELING))


# ---------------------------------------------------------------- the run's objective


@dataclass(frozen=True)
class Objective:
    """The run's task and loss: ``objective(logits, y)`` is the loss the loop backpropagates
    (fp32, on fp32 logits); FLOPs and the underflow diagnostics call the same object."""

    task: Task
    loss_fn: LossFn

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.task.loss(self.loss_fn, logits, y)


def build_objective(cfg: Config, device: torch.device) -> Objective:
    task = TASKS.builder(cfg.task).fn(**cfg.task.args)
    return Objective(task, build_loss(cfg.loss, device))


def default_objective() -> Objective:
    """Classification with plain cross-entropy (the default config's objective)."""
    return build_objective(Config(), torch.device("cpu"))


# ---------------------------------------------------------------- which task a component serves


def task_of(builder: Builder) -> str | None:
    """The task a registered model or data set serves (classification unless it says
    otherwise); None for a ``_target_`` callable, which serves the task the config names."""
    if builder.target:
        return None
    return builder.info.get("task", CLASSIFICATION)
