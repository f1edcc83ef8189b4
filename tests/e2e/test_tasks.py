"""Every supervised task end to end: the example projects' regression (diabetes), binary
(breast cancer) and segmentation (synthetic shapes) sweeps over fp32, bf16 and fp16 on the CPU,
each report judging by the task's score in its direction; a task of one's own through
``task._target_``; and each bad input of these tasks refused in one line, exit 2, with nothing
in the store."""

from __future__ import annotations

import itertools
import json
import shutil
import sys

import pytest
from conftest import REPO, all_runs

from ampsweep.tracking import store as mlflow_store

SMALL = ["trainer.deterministic=true", "trainer.timing_warmup_steps=1"]


@pytest.fixture
def example(tmp_path, monkeypatch):
    """A copy of an example project as the current folder (it writes outputs/ where it runs)."""

    def copy(name: str):
        project = tmp_path / name
        shutil.copytree(REPO / "examples" / name, project)
        monkeypatch.chdir(project)
        monkeypatch.setattr(sys, "path", list(sys.path))  # the project folder joins it
        return project

    return copy


def sweep(main, store: str, experiment: str, *overrides: str):
    """The sweep of ``experiment``, and its runs by name and the report as JSON."""
    res = main("train", "-m", "--config-dir", "conf", f"experiment={experiment}",
               f"tracking.uri={store}", *SMALL, *overrides)  # fmt: skip
    assert res.code == 0, res.err
    client = mlflow_store.client_for(store)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    kids = {r.info.run_name: r for r in runs if mlflow_store.PARENT in r.data.tags}
    report = main("report", "--format", "json", "--tracking-uri", store)
    assert report.code == 0, report.err
    return res.out, kids, json.loads(report.out)


def judged_by(report: dict, name: str, higher_is_better: bool) -> None:
    """Every row of the report carries the task's score and its direction."""
    for row in report["rows"]:
        assert row["score"]["name"] == name
        assert row["score"]["higher_is_better"] is higher_is_better


@pytest.mark.slow
def test_a_regression_sweep_on_diabetes_is_judged_by_rmse_lower_is_better(example, main, store):
    example("regression")
    out, kids, report = sweep(main, store, "diabetes_sweep", "trainer.epochs=4")
    assert set(kids) == {f"{m}-mlp-diabetes" for m in ("fp32", "bf16", "fp16")}
    for run in kids.values():
        assert run.data.tags["score.name"] == "val/rmse"
        assert run.data.tags["score.higher_is_better"] == "False"
        assert {"val/rmse", "val/mae", "val/r2"} <= set(run.data.metrics)
    assert kids["fp32-mlp-diabetes"].data.metrics["val/r2"] > 0.2  # it learnt something
    judged_by(report, "val/rmse", False)
    assert "RMSE held within 5% of fp32's" in out or "RMSE rose" in out
    assert "val rmse <=" in out  # time to quality, in the score's direction
    assert "accuracy" not in " ".join(report["findings"])


@pytest.mark.slow
def test_a_task_of_ones_own_drives_the_report(example, main, store):
    example("regression")
    out, kids, report = sweep(main, store, "median_error_sweep", "trainer.epochs=2")
    fp32 = kids["fp32-mlp-diabetes"]
    assert fp32.data.tags["score.name"] == "val/median_error"
    assert {"val/median_error", "val/max_error"} <= set(fp32.data.metrics)
    judged_by(report, "val/median_error", False)
    assert "val median_error" in out and "Median error" in out


@pytest.mark.slow
def test_a_binary_sweep_on_breast_cancer_is_judged_by_auroc(example, main, store):
    example("binary")
    out, kids, report = sweep(main, store, "breast_cancer_sweep", "trainer.epochs=3")
    assert set(kids) == {f"{m}-mlp-breast_cancer" for m in ("fp32", "bf16", "fp16")}
    fp32 = kids["fp32-mlp-breast_cancer"].data.metrics
    assert fp32["val/auroc"] > 0.9 and fp32["val/acc"] > 0.8
    judged_by(report, "val/auroc", True)
    assert "AUROC" in out
    assert "has not learned" not in out  # one logit has no chance level of 1/classes


@pytest.mark.slow
def test_a_segmentation_sweep_is_judged_by_miou(example, main, store):
    example("segmentation")
    small = ["trainer.epochs=2", "dataset.num_samples=64", "dataset.image_size=16",
             "model.width=4", "model.depth=1", "trainer.batch_size=16"]  # fmt: skip
    out, kids, report = sweep(main, store, "shape_masks_sweep", *small)
    assert set(kids) == {f"{m}-unet-shape_masks" for m in ("fp32", "bf16", "fp16")}
    for run in kids.values():
        assert {"val/miou", "val/pixel_acc"} <= set(run.data.metrics)
    judged_by(report, "val/miou", True)
    assert "mIoU" in out


# ---------------------------------------------------------------- bad input: one line, exit 2

MODULE = """
import torch


def float_targets():
    return [(torch.zeros(4), 0.5)] * 20


class Pairs(list):
    num_classes = 2  # what the model is built for: two outputs, against targets of three


def wrong_shape():
    return Pairs([(torch.zeros(4), torch.zeros(3))] * 20)


def masks(classes=5):
    return [(torch.zeros(1, 8, 8), torch.full((8, 8), classes - 1))] * 8


def tiny_unet(in_channels, num_classes):
    return torch.nn.Conv2d(in_channels, 2, 1)


class NoLoss:
    score = {"name": "val/x", "higher_is_better": True}

    def evaluation(self, loss_fn):
        return None


class NoDirection:
    score = {"name": "val/x"}

    def loss(self, loss_fn, output, y):
        return output.sum()

    def evaluation(self, loss_fn):
        return None
"""

_count = itertools.count()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project as the current folder: a module of data sets, a model and tasks, and
    a conf/ folder naming each."""
    name = f"tasks_pkg_{next(_count)}"  # a fresh module per test: imports are cached
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "parts.py").write_text(MODULE)
    files = {
        "dataset/floats.yaml": "float_targets",
        "dataset/wrong_shape.yaml": "wrong_shape",
        "dataset/masks.yaml": "masks",
        "model/tiny_unet.yaml": "tiny_unet",
        "task/no_loss.yaml": "NoLoss",
        "task/no_direction.yaml": "NoDirection",
    }
    for path, target in files.items():
        (tmp_path / "conf" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / path).write_text(f"_target_: {name}.parts.{target}\n")
    (tmp_path / "conf" / "loss").mkdir()
    (tmp_path / "conf" / "loss" / "bce.yaml").write_text("_target_: torch.nn.BCELoss\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return name


@pytest.mark.parametrize(
    "args,words",
    [
        (
            ["dataset=floats", "model=mlp"],
            "the label 0.5 is not a class index (an int >= 0) for task=classification: use "
            "task=regression",
        ),
        (
            ["dataset=breast_cancer", "model=mlp", "loss=bce"],
            "loss._target_=torch.nn.BCELoss: binary cross-entropy on probabilities is refused "
            "by autocast",
        ),
        (
            ["dataset=wrong_shape", "task=regression", "loss=mse", "model=mlp"],
            "task=regression: model=mlp outputs (2, 2) but dataset._target_={p}.parts.wrong_shape "
            "gives targets of shape (2, 3): make them the same shape",
        ),
        (
            ["dataset=masks", "task=segmentation", "model=tiny_unet"],
            "holds class 4 but model._target_={p}.parts.tiny_unet outputs 2 classes",
        ),
        (["dataset=diabetes", "model=mlp", "loss=cross_entropy"], "use loss=mse"),
        (
            ["dataset=diabetes", "model=mlp", "task=no_loss"],
            "task._target_={p}.parts.NoLoss: NoLoss has no loss: add loss(loss_fn, output, y)",
        ),
        (
            ["dataset=diabetes", "model=mlp", "task=no_direction"],
            "the score val/x has no direction (higher_is_better=None)",
        ),
    ],
)
def test_a_bad_input_of_a_task_is_one_line_exit_2_and_records_nothing(
    args, words, project, main, store
):
    res = main("train", "--config-dir", "conf", *args, f"tracking.uri={store}",
               "trainer.epochs=1", "trainer.batch_size=4")  # fmt: skip
    assert res.code == 2, res.err
    lines = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and words.format(p=project) in lines[0], res.err
    assert all_runs(store) == []
