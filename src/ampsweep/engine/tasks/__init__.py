"""Tasks: what is learnt from a batch, which decides how the loss sees the model's output and
what an evaluation reports.

A task is a small object registered by name: ``task=classification`` (the default),
``language_modeling``, and in ``engine.tasks.scored`` ``regression``, ``binary``, ``multilabel``
and ``segmentation``; or any class named by ``task._target_`` that follows the protocol of
``Task`` (``engine.tasks.custom`` checks it). The training loop stays one loop: it calls the
run's ``Objective`` (the task and the configured loss) on the model's output as the model
returns it (a tensor, a dict, a tuple, a Hugging Face ``ModelOutput``), and asks the task for a
fresh ``Evaluation`` to score a split. The loss is computed in fp32 on fp32 logits, whatever the
precision mode. FLOPs counting and the gradient-underflow diagnostics receive the same
``Objective``, so every number of a run is about the same loss.

Models and data sets say which task they serve (``@MODELS.register(..., task=...)``); a
``_target_`` component serves whatever task the config names, and the shapes it produces are
checked against the task when the run is built.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from ampsweep.config.schema import Config, ConfigError
from ampsweep.config.score import ACCURACY, PERPLEXITY, Score
from ampsweep.engine import distributed
from ampsweep.engine.optim import build_loss
from ampsweep.engine.registry import Builder, Registry

TASKS = Registry("task", provided=())
CLASSIFICATION, LANGUAGE_MODELING = "classification", "language_modeling"

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Evaluation:
    """One evaluation of a split: ``update`` on every batch (under the run's autocast, the
    model's output as it returned it), then ``compute`` once."""

    def update(self, output: Any, y: torch.Tensor) -> None:
        raise NotImplementedError

    def compute(self) -> tuple[float, ...]:
        """The split's numbers in the order of the task's ``names``: val/loss, the score,
        then any others."""
        raise NotImplementedError


class Task:
    """What a task is: how the loss sees the model's output and the batch's targets, what an
    evaluation reports, and the score the run is judged by.

    ``loss(loss_fn, output, y)``: the training loss, one fp32 number (``loss_fn`` is the
    configured loss; ``output`` what the model returned). ``evaluation(loss_fn, sync)``: a fresh
    ``Evaluation`` of a split (``sync``: add the ranks' shards together under DDP). ``score``:
    the metric the run is judged by and its direction (``config.score.Score``). ``check``:
    refuse, in one line, targets or an output the task cannot use (before anything runs).

    A task that sums per batch (classification, language modeling) gives ``eval_sums`` and
    ``finish`` and keeps the default ``evaluation``."""

    name = ""
    score: Score  # the quality metric besides val/loss (val/acc) and how it is judged
    unit = "sample"  # what perf/<unit>s_per_s counts beside samples (tokens for text)

    @property
    def names(self) -> tuple[str, ...]:
        """The metrics an evaluation reports, in its order."""
        return ("val/loss", self.score.name)

    def loss(self, loss_fn: LossFn, logits: Any, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evaluation(self, loss_fn: LossFn, sync: bool = False) -> Evaluation:
        return Summed(self, loss_fn, sync)

    def eval_sums(self, loss_fn: LossFn, logits: Any, y: torch.Tensor) -> torch.Tensor:
        """Sums over one batch, float64 on the device: (loss total, score total, count)."""
        raise NotImplementedError

    def finish(self, sums: list[float]) -> tuple[float, float]:
        """(val/loss, score) of a whole split from its summed ``eval_sums``."""
        raise NotImplementedError

    def metrics(self, evaluation: tuple[float, ...]) -> dict[str, float]:
        """An evaluation's numbers by name (an evaluation not yet made: val/loss and the
        score, both NaN)."""
        return dict(zip(self.names, evaluation, strict=False))

    def throughput(self, samples_per_s: float, y: torch.Tensor) -> dict[str, float]:
        """Extra throughput metrics of a batch shaped like ``y`` (e.g. tokens per second)."""
        return {}

    def check(self, logits: Any, y: torch.Tensor, num_classes: int, model: str, data: str) -> None:
        """Refuse targets (from ``data``) or a model output (of ``model``) this task cannot
        use: one line, with the fix."""


class Summed(Evaluation):
    """The evaluation of a task that sums per batch (``Task.eval_sums``): one tensor of sums on
    the device, synchronised once at the end."""

    def __init__(self, task: Task, loss_fn: LossFn, sync: bool) -> None:
        self.task, self.loss_fn, self.sync = task, loss_fn, sync
        self.sums: torch.Tensor | None = None

    def update(self, output, y) -> None:
        batch = self.task.eval_sums(self.loss_fn, output, y)
        self.sums = batch if self.sums is None else self.sums + batch

    def compute(self) -> tuple[float, ...]:
        assert self.sums is not None  # update() has added the split's batches
        if self.sync:  # the whole split: every rank's shard together
            distributed.all_reduce(self.sums)
        return self.task.finish(self.sums.tolist())  # one sync per evaluation


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the output itself when it is a tensor, its ``logits``
    entry (a dict, a Hugging Face ``ModelOutput``), or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        logits = output.get("logits")
    else:
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, tuple | list) and output:
            logits = output[0]
    if isinstance(logits, torch.Tensor):
        return logits
    raise ConfigError(
        f"the model returned a {type(output).__name__} with no logits tensor: return the "
        "logits, a dict or ModelOutput with a 'logits' entry, or a tuple of the logits first "
        "(or write a task that reads it: task._target_)"
    )


class Classification(Task):
    """One label per input: logits (N, C), targets (N,)."""

    name = CLASSIFICATION

    def __init__(self, score: Score = ACCURACY) -> None:
        self.score = score

    def loss(self, loss_fn, logits, y):
        return loss_fn(logits_of(logits).float(), y)

    def eval_sums(self, loss_fn, logits, y):
        logits, n = logits_of(logits), y.shape[0]
        total = loss_fn(logits.float(), y).double() * n
        correct = (logits.argmax(dim=1) == y).sum().double()
        count = torch.full((), float(n), dtype=torch.float64, device=y.device)
        return torch.stack([total, correct, count])

    def finish(self, sums):
        loss, correct, n = sums
        return loss / n, correct / n

    def check(self, logits, y, num_classes, model, data):
        logits = logits_of(logits)
        if y.is_floating_point():
            raise ConfigError(
                f"task=classification: {data} gives float targets ({str(y.dtype)[6:]}), not "
                "class indices: use task=regression to predict numbers (task=binary for 0/1)"
            )
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
        return loss_fn(logits_of(logits).float().flatten(0, -2), y.flatten())

    def eval_sums(self, loss_fn, logits, y):
        flat, targets = logits_of(logits).float().flatten(0, -2), y.flatten()
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
        logits = logits_of(logits)
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


# ---------------------------------------------------------------- a task of your own

PROTOCOL = "the protocol: docs/your-task.md"


class OwnTask(Task):
    """A ``task._target_`` object that follows the protocol without subclassing ``Task``:

    - ``score``: a ``config.score.Score``, or a dict with at least ``name`` (the metric, e.g.
      ``val/rmsle``) and ``higher_is_better``;
    - ``loss(loss_fn, output, y)``: the training loss, one number; ``output`` is what the model
      returned (a tensor, dict, tuple or ``ModelOutput``), ``loss_fn`` the configured loss;
    - ``evaluation(loss_fn)``: a fresh object with ``update(output, y)`` for every batch of a
      split and ``compute()``, a dict of metrics that holds ``val/loss`` and the score's;
    - optional ``check(output, y, model, data)``: raise to refuse a batch (one line).
    """

    def __init__(self, task: Any, label: str) -> None:
        self.task, self.label, self.name = task, label, type(task).__name__
        self.score = _own_score(getattr(task, "score", None), label)
        self.unit = getattr(task, "unit", "sample")
        self.reported: tuple[str, ...] = ()  # the names its evaluation gave, after the first

    @property
    def names(self) -> tuple[str, ...]:
        return ("val/loss", self.score.name, *self.reported)

    def loss(self, loss_fn, logits, y):
        return self.task.loss(loss_fn, logits, y)

    def evaluation(self, loss_fn, sync=False):
        return _OwnEvaluation(self, self.task.evaluation(loss_fn))

    def check(self, logits, y, num_classes, model, data):
        if callable(getattr(self.task, "check", None)):
            try:
                self.task.check(logits, y, model, data)
            except ConfigError:
                raise
            except Exception as err:  # the task's own refusal, as one line
                raise ConfigError(f"{self.label}: {' '.join(str(err).split())}") from None
        trial = self.evaluation(_no_loss)  # the metrics it reports: val/loss and the score
        trial.update(logits, y)
        trial.compute()


def _no_loss(*_) -> torch.Tensor:
    return torch.zeros(())


class _OwnEvaluation(Evaluation):
    def __init__(self, own: OwnTask, evaluation: Any) -> None:
        self.own, self.evaluation = own, evaluation

    def update(self, output, y):
        self.evaluation.update(output, y)

    def compute(self):
        values = self.evaluation.compute()
        first = ("val/loss", self.own.score.name)
        missing = [n for n in first if not isinstance(values, Mapping) or n not in values]
        if missing:
            got = sorted(values) if isinstance(values, Mapping) else type(values).__name__
            raise ConfigError(
                f"{self.own.label}: its evaluation's compute() gave {got}, without "
                f"{' and '.join(missing)}: return a dict of metrics holding both ({PROTOCOL})"
            )
        self.own.reported = tuple(n for n in values if n not in first)
        return tuple(float(values[n]) for n in self.own.names)


def own_task(task: Any, label: str) -> Task:
    """A ``task._target_`` object as the run's task, once it is checked against the protocol
    (a ``Task`` subclass is used as it is)."""
    for method, how in (
        ("loss", "loss(loss_fn, output, y) returning the training loss"),
        (
            "evaluation",
            "evaluation(loss_fn) returning an object with update(output, y) and compute()",
        ),
    ):
        if not callable(getattr(task, method, None)):
            raise ConfigError(
                f"{label}: {type(task).__name__} has no {method}: add {how} ({PROTOCOL})"
            )
    return task if isinstance(task, Task) else OwnTask(task, label)


def _own_score(score: Any, label: str) -> Score:
    if isinstance(score, Score):
        return score
    if not isinstance(score, Mapping) or not score.get("name"):
        raise ConfigError(
            f"{label}: its score is {score!r}, not a Score or a dict naming the metric: give "
            f"score = {{'name': 'val/<metric>', 'higher_is_better': True or False}} ({PROTOCOL})"
        )
    if not isinstance(score.get("higher_is_better"), bool):
        raise ConfigError(
            f"{label}: the score {score['name']} has no direction (higher_is_better="
            f"{score.get('higher_is_better')!r}): add 'higher_is_better': True or False "
            f"({PROTOCOL})"
        )
    known = {f: score[f] for f in Score.__dataclass_fields__ if f in score}
    return Score(**{"label": str(score["name"]).rsplit("/", 1)[-1], **known})


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
    """The task a config names (a ``task._target_`` class checked against the protocol) and
    its loss; binary cross-entropy on probabilities is refused in one line."""
    builder = TASKS.builder(cfg.task)
    task = builder.fn(**cfg.task.args)
    if builder.target:
        task = own_task(task, builder.label)
    loss_fn = build_loss(cfg.loss, device)
    _refuse_probability_bce(loss_fn, cfg)
    wanted = getattr(task, "default_loss", None)  # a task the class-index loss cannot train
    if wanted and cfg.loss.name == "cross_entropy" and not cfg.loss.target:
        raise ConfigError(
            f"loss=cross_entropy (task={task.name}): cross-entropy takes class indices, not "
            f"the targets of task={task.name}: use loss={wanted}"
        )
    return Objective(task, loss_fn)


def _refuse_probability_bce(loss_fn, cfg: Config) -> None:
    """Autocast refuses binary cross-entropy on probabilities (and in fp16 a probability
    rounds to exactly 0 or 1, where its log is infinite): the logits form is the fix."""
    fn = loss_fn.func if isinstance(loss_fn, functools.partial) else loss_fn
    if isinstance(fn, torch.nn.BCELoss) or fn is F.binary_cross_entropy:
        label = f"loss._target_={cfg.loss.target}" if cfg.loss.target else f"loss={cfg.loss.name}"
        raise ConfigError(
            f"{label}: binary cross-entropy on probabilities is refused by autocast and unsafe "
            "in half precision: use loss=bce_with_logits (or torch.nn.BCEWithLogitsLoss) on the "
            "model's logits, without a final sigmoid"
        )


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


# A model of one output vector per input (an image classifier, an MLP) serves each task on such
# vectors: its num_classes is the vector's length (1 for regression's one number).
VECTOR_TASKS = (CLASSIFICATION, "regression", "binary", "multilabel")


def serves(builder: Builder, task: str, section: str) -> bool:
    """Whether a model or data set (``section``) serves ``task``; any does a task of your own
    (``task._target_``), which says nothing of its components."""
    own = task_of(builder)
    if own is None or own == task or task not in TASKS:
        return True
    return section == "model" and own == CLASSIFICATION and task in VECTOR_TASKS


# Every module of this package registers its tasks on import (scored: torchmetrics' tasks).
from ampsweep.engine.tasks import scored  # noqa: E402,F401
