"""config.py and schema.py: every shipped config composes; every bad input is one line."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest
from omegaconf import OmegaConf

from ampsweep.config import compose as config
from ampsweep.config.schema import Config, ConfigError, Schema
from ampsweep.engine.build import resolve

CONF = config.config_dir()
GROUPS = ["precision", "model", "dataset", "optimizer", "trainer", "tracking"]
# Every option file of every group, found on disk so options added later are covered too.
OPTIONS = [(g, opt) for g in GROUPS for opt in config.group_options(g)]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# The key each group's option sets to its own name (trainer=default has none).
NAME_KEY = {
    "precision": "name",
    "model": "name",
    "dataset": "name",
    "optimizer": "name",
    "tracking": "backend",
}


def test_every_group_has_options():
    # A glob that found nothing would make the parametrized test below vacuous.
    for group in GROUPS:
        assert config.group_options(group), f"conf/{group}/ has no option files"


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes(group, option):
    cfg = config.load([f"{group}={option}"])
    assert isinstance(cfg, Config)
    if group in NAME_KEY:
        # The option file selects what its name says (a copy-paste slip would not).
        value = getattr(getattr(cfg, group), NAME_KEY[group])
        assert getattr(value, "name", value) == option


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = config.load([f"experiment={experiment}"])
    assert isinstance(cfg, Config)
    # And every job the experiment would sweep over validates up front.
    assert config.validate_command([f"experiment={experiment}"], multirun=True)


def test_defaults():
    cfg = config.load([])
    assert cfg.precision.name == "auto"
    assert cfg.model.name == "cnn"
    assert cfg.dataset.name == "digits"
    assert cfg.optimizer.name == "adamw"
    assert cfg.tracking.backend.name == "mlflow"
    assert "hydra" not in config.flatten(cfg)


def test_fp16_static_ships_a_fixed_scale():
    cfg = config.load(["precision=fp16_static"])
    assert cfg.precision.scaler.init_scale == 1024.0


# (override, substrings the one-line message must hold: key=value, and the fix)
BAD = [
    ("precision=fp8x", ["precision=fp8x", "choose one of", "fp16_static", "bf16"]),
    ("trainer.epoch=3", ["trainer.epoch=3", "did you mean trainer.epochs?"]),
    ("trainer.epochs=ten", ["trainer.epochs=ten", "expected an integer", "trainer.epochs=10"]),
    ("trainer.batch_size=0", ["trainer.batch_size=0", "must be > 0", "trainer.batch_size=64"]),
    ("precision.scaler.init_scale=-1", ["precision.scaler.init_scale=-1", "> 0", "65536"]),
    ("precision.scaler.growth_factor=1.0", ["precision.scaler.growth_factor=1.0", "> 1.0"]),
    ("precision.scaler.backoff_factor=1.5", ["precision.scaler.backoff_factor=1.5", "(0, 1)"]),
    ("trainer.grad_accum_steps=0", ["trainer.grad_accum_steps=0", "use 1"]),
    ("optimizer.lr=-1", ["optimizer.lr=-1", "must be > 0", "optimizer.lr=1e-3"]),
    ("trainer.device=gpu", ["trainer.device=gpu", "choose one of auto, cuda, cpu"]),
    ("precision.name=fp8", ["precision.name=fp8", "choose one of", "fp16"]),
]


@pytest.mark.parametrize("override,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_with_key_value_and_fix(override, expected):
    with pytest.raises(ConfigError) as info:
        config.load([override])
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_all_range_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        config.load(["trainer.batch_size=0", "optimizer.lr=-1"])
    message = str(info.value)
    assert "trainer.batch_size=0" in message and "optimizer.lr=-1" in message
    assert "\n" not in message


def test_unparsable_override_is_named():
    with pytest.raises(ConfigError) as info:
        config.load(["trainer.epochs=[1"])
    message = str(info.value)
    assert message.startswith("trainer.epochs=[1: cannot parse") and "\n" not in message


def test_validate_command_checks_every_job_of_a_sweep():
    # Only the second value of the sweep is bad: it must still fail before anything runs.
    with pytest.raises(ConfigError, match="trainer.batch_size=0"):
        config.validate_command(["trainer.batch_size=32,0"], multirun=True)
    jobs = config.validate_command(["precision=fp32,bf16", "model=mlp,cnn"], multirun=True)
    assert [(c.precision.name, c.model.name) for c in jobs] == [
        ("fp32", "mlp"),
        ("fp32", "cnn"),
        ("bf16", "mlp"),
        ("bf16", "cnn"),
    ]
    # Hydra's own keys are not part of the job config.
    assert config.validate_command(["hydra.job.chdir=false"], multirun=False)


def _leaf_paths(node, prefix=""):
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            yield from _leaf_paths(value, f"{prefix}{f.name}.")
        elif f.name == "args":  # a component's own settings sit beside its shared keys
            yield from (f"{prefix}{k}" for k in value)
        elif f.name in ("target", "partial"):  # _target_/_partial_: shown only when set
            yield from ([f"{prefix}_{f.name}_"] if value else [])
        else:
            yield f"{prefix}{f.name}"


def test_flatten_has_every_leaf_as_a_string():
    cfg = resolve(config.load(["precision=fp16", "precision.scaler.init_scale=512"]))
    flat = config.flatten(cfg)
    assert set(flat) == set(_leaf_paths(cfg))
    assert flat["model.width"] == "32"  # model.args.width, as the user writes it
    assert all(isinstance(v, str) for v in flat.values())
    assert flat["precision.name"] == "fp16"  # Enums by name: the spelling users type
    assert flat["precision.scaler.init_scale"] == "512.0"
    assert flat["precision.scaler.enabled"] == "True"  # resolved: fp16 has a scaler
    assert flat["optimizer.betas"] == "[0.9, 0.999]"  # a list stays one param
    assert flat["trainer.batch_size"] == "64"


def test_flatten_of_a_plain_dict():
    assert config.flatten({"a": {"b": 1, "c": None}, "d": [1, 2]}) == {
        "a.b": "1",
        "a.c": "null",
        "d": "[1, 2]",
    }


def test_to_yaml_round_trips():
    cfg = resolve(config.load(["precision=bf16", "model=mlp", "trainer.epochs=3"]))
    back = config.to_config(
        OmegaConf.merge(OmegaConf.structured(Schema), OmegaConf.create(config.to_yaml(cfg)))
    )
    assert back == cfg


def test_expand_sweep_is_the_cartesian_product():
    jobs = config.expand_sweep(["precision=fp32,fp16", "model=mlp,cnn", "trainer.epochs=1"])
    assert jobs == [
        ["precision=fp32", "model=mlp", "trainer.epochs=1"],
        ["precision=fp32", "model=cnn", "trainer.epochs=1"],
        ["precision=fp16", "model=mlp", "trainer.epochs=1"],
        ["precision=fp16", "model=cnn", "trainer.epochs=1"],
    ]


def test_expand_sweep_ranges_and_choices():
    assert config.expand_sweep(["trainer.seed=range(0,3)"]) == [
        ["trainer.seed=0"],
        ["trainer.seed=1"],
        ["trainer.seed=2"],
    ]
    assert config.expand_sweep(["precision=choice(fp32,bf16)"]) == [
        ["precision=fp32"],
        ["precision=bf16"],
    ]
    assert config.expand_sweep([]) == [[]]


def test_expand_sweep_bad_override():
    with pytest.raises(ConfigError, match="precision=fp32,,: cannot parse"):
        config.expand_sweep(["precision=fp32,,"])


def test_config_dir_is_the_checkout_conf():
    assert (CONF / "config.yaml").is_file()
    assert CONF.name == "conf"
