"""The tasks scored by torchmetrics (regression, binary, multi-label, segmentation) and a task
of one's own: their losses, their metrics (in fp32 whatever the logits' dtype), and the one-line
refusals of targets or outputs they cannot use."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn import metrics as skm

from ampsweep.config import compose
from ampsweep.config.schema import Config, ConfigError, LossConfig, TaskConfig
from ampsweep.config.score import Score
from ampsweep.engine import loop
from ampsweep.engine.data.batches import Batches
from ampsweep.engine.models import MODELS
from ampsweep.engine.tasks import TASKS, OwnTask, build_objective, logits_of, own_task, serves
from ampsweep.precision.policy import build_policy

CPU = torch.device("cpu")


def task(name: str, **args):
    return TASKS.lookup(name).fn(**args)


def evaluated(t, loss_fn, batches):
    """An evaluation of ``batches`` (pairs of output and targets), by name."""
    ev = t.evaluation(loss_fn)
    for out, y in batches:
        ev.update(out, y)
    return t.metrics(ev.compute())


def test_regression_reports_rmse_mae_and_r2_over_every_batch():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(40, 1, generator=g)
    out = y + 0.3 * torch.randn(40, 1, generator=g)
    t = task("regression")
    got = evaluated(t, F.mse_loss, [(out[:25], y[:25]), (out[25:], y[25:])])
    p, a = out.flatten().numpy(), y.flatten().numpy()
    assert got["val/rmse"] == pytest.approx(np.sqrt(skm.mean_squared_error(a, p)), rel=1e-5)
    assert got["val/mae"] == pytest.approx(skm.mean_absolute_error(a, p), rel=1e-5)
    assert got["val/r2"] == pytest.approx(skm.r2_score(a, p), rel=1e-4)
    assert got["val/loss"] == pytest.approx(skm.mean_squared_error(a, p), rel=1e-5)
    assert list(got) == ["val/loss", "val/rmse", "val/mae", "val/r2"]
    assert t.score.name == "val/rmse" and not t.score.higher_is_better


def test_the_metrics_are_computed_in_fp32_from_half_precision_logits():
    y = torch.tensor([[100.0], [200.0], [300.0]])
    half = (y + 1).half()  # what an fp16 model returns (each value exact in fp16)
    got = evaluated(task("regression"), F.mse_loss, [(half, y)])
    assert got["val/rmse"] == pytest.approx(1.0) and got["val/loss"] == pytest.approx(1.0)
    # R2 sums the squared targets (140,000): past fp16's largest value, 65,504
    assert got["val/r2"] == pytest.approx(1 - 3 / 20000)


def test_binary_reports_auroc_and_accuracy_at_one_half():
    logits = torch.tensor([[2.0], [-1.0], [0.5], [-3.0], [0.1], [-0.2]])
    y = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    t = task("binary")
    got = evaluated(t, F.binary_cross_entropy_with_logits, [(logits.bfloat16(), y)])
    probs = torch.sigmoid(logits.flatten()).numpy()
    assert got["val/auroc"] == pytest.approx(skm.roc_auc_score(y, probs))
    assert got["val/acc"] == pytest.approx(skm.accuracy_score(y, probs > 0.5))
    loss = F.binary_cross_entropy_with_logits(logits.bfloat16().float().flatten(), y)
    assert got["val/loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_multilabel_reports_micro_f1_and_mean_average_precision():
    g = torch.Generator().manual_seed(1)
    y = (torch.rand(30, 4, generator=g) > 0.5).float()
    logits = 2 * (y - 0.5) + torch.randn(30, 4, generator=g)
    got = evaluated(task("multilabel"), F.binary_cross_entropy_with_logits, [(logits, y)])
    probs = torch.sigmoid(logits).numpy()
    assert got["val/f1"] == pytest.approx(skm.f1_score(y, probs > 0.5, average="micro"))
    assert got["val/map"] == pytest.approx(skm.average_precision_score(y, probs), rel=1e-4)


def test_segmentation_skips_ignored_pixels_in_the_loss_and_the_metrics():
    y = torch.tensor([[[0, 1], [2, 255]]])
    logits = F.one_hot(torch.tensor([[[0, 1], [1, 0]]]), 3).permute(0, 3, 1, 2).float() * 5
    t = task("segmentation")
    got = evaluated(t, F.cross_entropy, [(logits, y)])
    assert got["val/pixel_acc"] == pytest.approx(2 / 3)  # the ignored pixel counts nowhere
    # IoU per class: 0 -> 1/1, 1 -> 1/2, 2 -> 0/1
    assert got["val/miou"] == pytest.approx((1 + 0.5 + 0) / 3)
    kept = F.cross_entropy(logits, y.masked_fill(y == 255, -100))
    assert t.loss(F.cross_entropy, logits, y).item() == pytest.approx(kept.item())


def test_the_loop_evaluates_a_scored_task_under_autocast():
    x = torch.randn(20, 3)
    y = x.sum(dim=1, keepdim=True)
    batches = Batches((x, y), 8, CPU, torch.float32, shuffle=False, drop_last=False, seed=0,
                      preload=True)  # fmt: skip
    model = torch.nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.fill_(1.0), model.bias.zero_()
    cfg = compose.load(["dataset=diabetes", "model=mlp", "precision=bf16"])
    assert (cfg.task.name, cfg.loss.name) == ("regression", "mse")  # the data set picks both
    policy = build_policy(cfg.precision, CPU)
    objective = build_objective(cfg, CPU)
    loss, rmse, mae, r2 = loop.evaluate(model, batches, policy, objective)
    assert rmse < 0.05 and r2 > 0.99  # bf16's rounding only


@pytest.mark.parametrize(
    "name,args,out,y,words",
    [
        ("classification", {}, (4, 3), torch.rand(4), "gives float targets (float32), not class"),
        ("regression", {}, (4, 1), torch.rand(4), "outputs (4, 1) but d gives targets of shape"),
        ("binary", {}, (4, 2), torch.ones(4), "task=binary: m outputs (4, 2) for targets"),
        ("binary", {}, (4, 1), torch.full((4,), 3.0), "targets other than 0 and 1 (e.g. 3)"),
        ("multilabel", {}, (4, 3), torch.ones(4, 2), "task=multilabel: m outputs (4, 3) but"),
        ("segmentation", {}, (2, 3, 4, 4), torch.ones(2, 5, 4).long(), "for masks of shape"),
        (
            "segmentation",
            {},
            (2, 3, 4, 4),
            torch.full((2, 4, 4), 7),
            "a mask of d holds class 7 but m outputs 3 classes: build the model for 8 classes,"
            " or set task.ignore_index=7",
        ),
    ],
)
def test_targets_or_outputs_a_task_cannot_use_are_one_line_with_the_fix(name, args, out, y, words):
    with pytest.raises(ConfigError) as err:
        task(name, **args).check(torch.zeros(out), y, 3, "m", "d")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_binary_cross_entropy_on_probabilities_is_refused_with_the_logits_form():
    cfg = Config(task=TaskConfig("binary"), loss=LossConfig("BCELoss", target="torch.nn.BCELoss"))
    with pytest.raises(ConfigError, match="loss._target_=torch.nn.BCELoss: binary cross-entr"):
        build_objective(cfg, CPU)
    with pytest.raises(ConfigError, match="use loss=bce_with_logits"):
        build_objective(cfg, CPU)


def test_cross_entropy_is_refused_where_the_targets_are_not_class_indices():
    with pytest.raises(ConfigError, match=r"loss=cross_entropy \(task=regression\).*loss=mse$"):
        build_objective(Config(task=TaskConfig("regression")), CPU)


def test_a_models_dict_tuple_or_model_output_reaches_the_task_as_it_is():
    logits = torch.randn(2, 3)
    assert logits_of(logits) is logits
    assert logits_of({"logits": logits, "aux": 1}) is logits
    assert logits_of((logits, torch.zeros(1))) is logits
    assert logits_of(OrderedDict(logits=logits)) is logits  # what a ModelOutput is
    with pytest.raises(ConfigError, match="returned a dict with no logits tensor"):
        logits_of({"out": logits})
    y = torch.tensor([0, 2])
    t = task("classification")
    assert t.loss(F.cross_entropy, {"logits": logits}, y) == F.cross_entropy(logits, y)


def test_a_vector_model_serves_every_task_on_vectors_a_data_set_only_its_own():
    mlp, unet = MODELS.lookup("mlp"), MODELS.lookup("unet")
    for name in ("classification", "regression", "binary", "multilabel"):
        assert serves(mlp, name, "model")
    assert not serves(mlp, "segmentation", "model") and serves(unet, "segmentation", "model")
    assert serves(mlp, "MyTask", "model")  # a task of one's own says nothing of its parts


# ---------------------------------------------------------------- a task of one's own


class MeanError:
    """A user's task: the model returns a dict; the score is lower-is-better."""

    score = {"name": "val/mean_error", "higher_is_better": False, "tolerance": 0.1}

    def loss(self, loss_fn, output, y):
        return loss_fn(output["pred"].float(), y)

    def evaluation(self, loss_fn):
        return MeanErrorEvaluation(loss_fn)


class MeanErrorEvaluation:
    def __init__(self, loss_fn):
        self.loss_fn, self.total, self.error, self.n = loss_fn, 0.0, 0.0, 0

    def update(self, output, y):
        pred = output["pred"].float()
        self.total += self.loss_fn(pred, y).item() * len(y)
        self.error += (pred - y).abs().sum().item()
        self.n += len(y)

    def compute(self):
        return {"val/loss": self.total / self.n, "val/mean_error": self.error / self.n, "n": self.n}


def test_a_task_of_ones_own_is_scored_by_its_own_evaluation():
    t = own_task(MeanError(), "task._target_=pkg.MeanError")
    assert isinstance(t, OwnTask) and t.name == "MeanError"
    assert t.score == Score("val/mean_error", "mean_error", higher_is_better=False, tolerance=0.1)
    y = torch.tensor([1.0, 2.0])
    out = {"pred": torch.tensor([1.5, 2.0]).half()}
    assert t.loss(F.mse_loss, out, y).item() == pytest.approx(0.125)
    t.check(out, y, 1, "m", "d")
    got = evaluated(t, F.mse_loss, [(out, y)])
    assert got == {"val/loss": 0.125, "val/mean_error": 0.25, "n": 2.0}


class NoEvaluation:
    score = {"name": "val/x", "higher_is_better": True}

    def loss(self, loss_fn, output, y):
        return output.sum()


class NoDirection(MeanError):
    score = {"name": "val/x"}


class WrongKeys(MeanError):
    score = {"name": "val/other", "higher_is_better": True}


@pytest.mark.parametrize(
    "obj,words",
    [
        (NoEvaluation(), "NoEvaluation has no evaluation: add evaluation(loss_fn) returning"),
        (NoDirection(), "the score val/x has no direction (higher_is_better=None): add"),
        (object(), "object has no loss: add loss(loss_fn, output, y)"),
    ],
)
def test_a_task_missing_part_of_the_protocol_is_one_line(obj, words):
    with pytest.raises(ConfigError) as err:
        own_task(obj, "task._target_=pkg.T")
    text = str(err.value)
    assert text.startswith("task._target_=pkg.T: ") and words in text and "\n" not in text
    assert "docs/your-task.md" in text


def test_an_evaluation_without_the_score_is_refused_when_checked():
    t = own_task(WrongKeys(), "task._target_=pkg.WrongKeys")
    with pytest.raises(ConfigError, match="without val/other: return a dict of metrics"):
        t.check({"pred": torch.zeros(2)}, torch.zeros(2), 1, "m", "d")
