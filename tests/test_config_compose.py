"""config/compose: the user's config folder beside ampsweep's, ``_target_`` sections, and keys
added with ``+`` that nothing would read."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ampsweep.config import compose
from ampsweep.config.schema import ConfigError, Schema


@pytest.fixture
def user_conf(tmp_path: Path) -> Path:
    """A user's config folder: a model, a data set and an experiment that uses ampsweep's
    groups as well as its own."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "dataset").mkdir()
    (conf / "experiment").mkdir()
    (conf / "model" / "my_net.yaml").write_text("_target_: mypkg.nets.make_net\nhidden: 32\n")
    (conf / "dataset" / "my_data.yaml").write_text(
        "_target_: mypkg.data.make_data\nname: my_data\nsize: 100\nval_fraction: 0.25\n"
    )
    (conf / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: my_net\n  - override /optimizer: sgd"
        "\n\ntrainer:\n  epochs: 2\nhydra:\n  sweeper:\n    params:\n      precision: fp32,bf16\n"
    )
    return conf


def test_the_users_groups_sit_beside_ampsweeps(user_conf):
    search = [compose.search_entry(user_conf)]
    cfg = compose.load(["model=my_net", "dataset=my_data", "model.hidden=64"], search=search)
    assert cfg.model.target == "mypkg.nets.make_net"
    assert cfg.model.name == "make_net"  # no name given: the callable's own
    assert cfg.model.args == {"hidden": 64}
    assert cfg.dataset.name == "my_data" and cfg.dataset.target == "mypkg.data.make_data"
    assert cfg.dataset.val_fraction == 0.25  # a shared key, typed as for built-in data sets
    assert cfg.dataset.args == {"size": 100}
    # the user's experiment uses ampsweep's groups (optimizer=sgd) and its own (my_net)
    jobs = compose.validate_command(["experiment=mine"], True, search=search)
    assert [j.precision.name for j in jobs] == ["fp32", "bf16"]
    assert {j.model.name for j in jobs} == {"make_net"} and jobs[0].optimizer.name == "sgd"


def test_hydra_searchpath_on_the_command_line_works_too(user_conf):
    cfg = compose.load([f"hydra.searchpath=[file://{user_conf}]", "model=my_net"])
    assert cfg.model.target == "mypkg.nets.make_net"


def test_an_unknown_option_lists_the_users_options_too(user_conf):
    with pytest.raises(ConfigError) as err:
        compose.load(["model=my_nett"], search=[compose.search_entry(user_conf)])
    assert "model=my_nett: no such option in config group 'model': choose one of" in str(err.value)
    assert "my_net" in str(err.value) and "cnn" in str(err.value)
    assert "my_net" in compose.group_options("model", search=[compose.search_entry(user_conf)])


def test_free_form_args_need_no_plus():
    assert compose.normalise_overrides(["model.args.drop_rate=0.1", "model.width=8", "-m"]) == [
        "++model.args.drop_rate=0.1",
        "model.width=8",
        "-m",
    ]
    cfg = compose.load(["model=timm", "model.args.drop_rate=0.1"])
    assert cfg.model.args["args"] == {"drop_rate": 0.1}


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "+trainer.epochz=3",
            "trainer.epochz=3: unknown key 'epochz': did you mean trainer.epochs?; valid keys in "
            "trainer: device, epochs,",
        ),
        (
            "+precision.scaler.init_scal=8",
            "precision.scaler.init_scal=8: unknown key 'init_scal': did you mean "
            "precision.scaler.init_scale?",
        ),
        ("+epochs=3", "epochs=3: unknown key 'epochs': did you mean trainer.epochs?; valid keys"),
    ],
)
def test_a_key_added_to_a_typed_section_is_refused(override, message):
    with pytest.raises(ConfigError) as err:
        compose.load([override])
    assert str(err.value).startswith(message)


def test_free_form_target_arguments_stay_allowed():
    cfg = compose.load(["+model._target_=torchvision.models.resnet18", "+model.num_classes=10"])
    assert cfg.model.args["num_classes"] == 10


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "+optimizer._target_=torch.optim.SGD",
            "optimizer._target_=torch.optim.SGD: not supported",
        ),
        ("+model._target_=resnet18", "not a dotted path to a callable"),
        (
            "+model._recursive_=false",
            "model._recursive_=False: not supported: model takes _target_",
        ),
        ("+loss._partial_=true", "loss._partial_: has no _target_ to bind"),
    ],
)
def test_special_keys_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        compose.load([override])


def test_a_target_section_round_trips_through_the_logged_yaml():
    cfg = compose.load(
        ["+loss._target_=torch.nn.functional.cross_entropy", "+loss._partial_=true", "model=mlp"]
    )
    text = compose.to_yaml(cfg)
    assert "_target_: torch.nn.functional.cross_entropy" in text and "_partial_: true" in text
    back = compose.to_config(OmegaConf.merge(OmegaConf.structured(Schema), OmegaConf.create(text)))
    assert back == cfg
    flat = compose.flatten(cfg)
    assert flat["loss._target_"] == "torch.nn.functional.cross_entropy"
    assert "model._target_" not in flat  # only set ones are shown
