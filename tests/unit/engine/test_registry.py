"""engine/registry: a ``_target_`` callable is imported by its dotted path and its arguments are
checked against its signature exactly like a registered builder's settings."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from ampsweep.config.schema import ConfigError, ModelConfig
from ampsweep.engine import components
from ampsweep.engine.models import MODELS, build_model
from ampsweep.engine.optim import LOSSES, build_loss
from ampsweep.engine.registry import import_target

HERE = __name__  # this module, importable by name: its functions serve as targets


def make_net(in_channels: int, num_classes: int, hidden: int = 16, act: str = "relu"):
    return nn.Sequential(
        nn.Flatten(), nn.LazyLinear(hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def needs_depth(num_classes: int, *, depth: int):
    return nn.Linear(4, num_classes)


def takes_anything(num_classes: int, **kwargs):
    return nn.Linear(kwargs.get("width", 4), num_classes)


def not_a_module(num_classes: int):
    return "a string"


def test_a_target_imports_and_its_arguments_are_typed_and_completed():
    builder = MODELS.for_target(f"{HERE}.make_net")
    assert builder.fn is make_net
    assert builder.label == f"model._target_={HERE}.make_net"
    assert builder.wants() == {"in_channels", "num_classes"}  # provided by ampsweep
    args, problems = builder.resolve({"hidden": "32"})
    assert problems == []
    assert args == {"hidden": 32, "act": "relu"}  # "32" typed by the annotation, act defaulted


def test_every_argument_problem_at_once():
    builder = MODELS.for_target(f"{HERE}.needs_depth")
    _, problems = builder.resolve({"dept": 3, "num_classes": 5})
    assert len(problems) == 3, problems
    assert problems[0] == (
        "model.dept=3: unknown key 'dept' for model._target_="
        f"{HERE}.needs_depth: did you mean model.depth?; valid keys in model: depth"
    )
    assert problems[1] == (
        f"model.num_classes=5: ampsweep passes num_classes to model._target_={HERE}.needs_depth"
        " from the data: remove model.num_classes"
    )
    assert problems[2].startswith(f"model.depth: model._target_={HERE}.needs_depth needs this")


def test_a_callable_taking_kwargs_accepts_free_form_arguments():
    args, problems = MODELS.for_target(f"{HERE}.takes_anything").resolve({"width": 8, "x": 1})
    assert problems == [] and args == {"width": 8, "x": 1}
    model = build_model(ModelConfig("takes_anything", args, f"{HERE}.takes_anything"), (1, 2), 3)
    assert model.in_features == 8 and model.out_features == 3


@pytest.mark.parametrize(
    "target,message",
    [
        (
            "nopkg_xyz.nets.make_net",
            "model._target_=nopkg_xyz.nets.make_net: no module named 'nopkg_xyz' (looked in the "
            "installed packages and the current folder",
        ),
        (
            f"{HERE}.make_nett",
            f"model._target_={HERE}.make_nett: {HERE} has no attribute 'make_nett': did you "
            f"mean {HERE}.make_net?",
        ),
        ("torch.nn.NoSuchLayer", "torch.nn has no attribute 'NoSuchLayer'"),
        (f"{HERE}.HERE", f"{HERE}.HERE is a str, not a callable: name a class or a function"),
    ],
)
def test_a_target_that_does_not_import_says_which_part_failed(target, message):
    with pytest.raises(ConfigError) as err:
        import_target("model", target)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_module_that_fails_to_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_user_pkg.py").write_text("import not_installed_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing broken_user_pkg failed: No module named"):
        import_target("model", "broken_user_pkg.make_net")


def test_the_current_folder_is_searched(tmp_path, monkeypatch):
    (tmp_path / "cwd_user_nets.py").write_text("def make(num_classes):\n    return num_classes\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".")])
    assert import_target("model", "cwd_user_nets.make")(3) == 3


def test_a_builder_that_returns_no_module_is_refused():
    with pytest.raises(ConfigError, match=r"returned a str, not a torch.nn.Module"):
        build_model(ModelConfig("x", {}, f"{HERE}.not_a_module"), (1, 8, 8), 10)


def test_a_model_asking_for_what_the_data_lacks_is_refused():
    cfg = ModelConfig("x", {}, f"{HERE}.make_net")
    with pytest.raises(ConfigError, match="asks for in_channels, which data of shape"):
        build_model(cfg, (16,), 256)  # token sequences have no channels


# ---------------------------------------------------------------- losses


def test_a_loss_class_is_instantiated_with_its_arguments():
    from ampsweep.config.schema import LossConfig

    cfg = LossConfig("x", {"label_smoothing": 0.1}, "torch.nn.CrossEntropyLoss")
    args, problems = LOSSES.builder(cfg).resolve(cfg.args)
    assert problems == []
    loss = build_loss(LossConfig("x", args, cfg.target), torch.device("cpu"))
    logits, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    expected = torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1)
    assert torch.allclose(loss(logits, y), expected)


def test_a_partial_loss_binds_its_arguments_and_takes_inputs_at_call_time():
    from ampsweep.config.schema import LossConfig

    target = "torch.nn.functional.cross_entropy"
    builder = LOSSES.for_target(target, partial=True)
    args, problems = builder.resolve({"label_smoothing": 0.2})
    assert problems == []  # input and target are not settings: they come at call time
    loss = build_loss(LossConfig("x", {"label_smoothing": 0.2}, target, True), torch.device("cpu"))
    assert isinstance(loss, functools.partial)
    logits, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    assert torch.allclose(
        loss(logits, y), torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.2)
    )


def test_the_default_loss_is_cross_entropy_with_label_smoothing_checked():
    args, problems = LOSSES.lookup("cross_entropy").resolve({"label_smoothing": 1.5})
    assert problems == ["loss.label_smoothing=1.5 must be in [0, 1)"]


def test_components_resolve_reports_target_problems_with_the_others():
    from ampsweep.config import compose

    cfg = compose.load(["+model._target_=nopkg_xyz.make", "optimizer.lr=0.1", "+optimizer.bad=1"])
    with pytest.raises(ConfigError) as err:
        components.resolve(cfg)
    text = str(err.value)
    assert "model._target_=nopkg_xyz.make: no module named 'nopkg_xyz'" in text
    assert "optimizer.bad=1: unknown key 'bad' for optimizer=adamw" in text
