"""config/compose.py: every shipped config composes (groups, experiments, launchers); every
bad input is one line with the key, the value and the fix; flatten, YAML and sweep expansion;
the user's config folder beside ampsweep's, ``_target_`` sections, and keys added with ``+``
that nothing would read."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from conftest import sweep_jobs
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
    # And every job the experiment would sweep over composes and types.
    code, jobs = sweep_jobs(f"experiment={experiment}")
    assert code == 0 and jobs


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
    ("trainer.callbacks={_target_: a.B}",
     ["trainer.callbacks={_target_: a.B}", "write a list of mappings", "trainer.callbacks=[{"]),
    ("trainer.callbacks=[a.B]", ["trainer.callbacks=[a.B]", "write a list of mappings"]),
]  # fmt: skip


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


def test_every_job_of_a_sweep_is_typed_in_the_order_it_runs():
    code, jobs = sweep_jobs("precision=fp32,bf16", "model=mlp,cnn", "hydra.job.chdir=false")
    assert code == 0
    assert [(c.precision.name, c.model.name) for c in jobs] == [
        ("fp32", "mlp"),
        ("fp32", "cnn"),
        ("bf16", "mlp"),
        ("bf16", "cnn"),
    ]


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


def test_config_dir_is_the_checkout_conf():
    assert (CONF / "config.yaml").is_file()
    assert CONF.name == "conf"


def test_slurm_launcher_config_composes_with_its_knobs():
    cfg = config.compose(
        [
            "hydra/launcher=ampsweep_slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=240",
            "trainer.nproc=4",
        ],
        return_hydra_config=True,
    )
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert (launcher["partition"], launcher["timeout_min"]) == ("gpu", 240)
    # one task (rank) and one GPU per process of trainer.nproc
    assert cfg.hydra.launcher.tasks_per_node == cfg.hydra.launcher.gpus_per_node == 4


def test_local_launcher_config_composes():
    cfg = config.compose(["hydra/launcher=ampsweep_local"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("submitit_launcher.LocalLauncher")
    assert cfg.hydra.launcher.tasks_per_node == 1


# ---------------------------------------------------------------- the user's config folder


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
    search = [config.search_entry(user_conf)]
    cfg = config.load(["model=my_net", "dataset=my_data", "model.hidden=64"], search=search)
    assert cfg.model.target == "mypkg.nets.make_net"
    assert cfg.model.name == "make_net"  # no name given: the callable's own
    assert cfg.model.args == {"hidden": 64}
    assert cfg.dataset.name == "my_data" and cfg.dataset.target == "mypkg.data.make_data"
    assert cfg.dataset.val_fraction == 0.25  # a shared key, typed as for built-in data sets
    assert cfg.dataset.args == {"size": 100}
    # the user's experiment uses ampsweep's groups (optimizer=sgd) and its own (my_net)
    code, jobs = sweep_jobs("--config-dir", str(user_conf), "experiment=mine")
    assert code == 0
    assert [j.precision.name for j in jobs] == ["fp32", "bf16"]
    assert {j.model.name for j in jobs} == {"make_net"} and jobs[0].optimizer.name == "sgd"


def test_hydra_searchpath_on_the_command_line_works_too(user_conf):
    cfg = config.load([f"hydra.searchpath=[file://{user_conf}]", "model=my_net"])
    assert cfg.model.target == "mypkg.nets.make_net"


def test_an_unknown_option_lists_the_users_options_too(user_conf):
    with pytest.raises(ConfigError) as err:
        config.load(["model=my_nett"], search=[config.search_entry(user_conf)])
    assert "model=my_nett: no such option in config group 'model': choose one of" in str(err.value)
    assert "my_net" in str(err.value) and "cnn" in str(err.value)
    assert "my_net" in config.group_options("model", search=[config.search_entry(user_conf)])


def test_free_form_args_need_no_plus():
    assert config.normalise_overrides(["model.args.drop_rate=0.1", "model.width=8", "-m"]) == [
        "++model.args.drop_rate=0.1",
        "model.width=8",
        "-m",
    ]
    cfg = config.load(["model=timm", "model.args.drop_rate=0.1"])
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
        config.load([override])
    assert str(err.value).startswith(message)


def test_free_form_target_arguments_stay_allowed():
    cfg = config.load(["+model._target_=torchvision.models.resnet18", "+model.num_classes=10"])
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
        config.load([override])


def test_a_target_section_round_trips_through_the_logged_yaml():
    cfg = config.load(
        ["+loss._target_=torch.nn.functional.cross_entropy", "+loss._partial_=true", "model=mlp"]
    )
    text = config.to_yaml(cfg)
    assert "_target_: torch.nn.functional.cross_entropy" in text and "_partial_: true" in text
    back = config.to_config(OmegaConf.merge(OmegaConf.structured(Schema), OmegaConf.create(text)))
    assert back == cfg
    flat = config.flatten(cfg)
    assert flat["loss._target_"] == "torch.nn.functional.cross_entropy"
    assert "model._target_" not in flat  # only set ones are shown


def test_callbacks_are_a_typed_list_logged_as_one_param():
    """trainer.callbacks: empty by default; each entry typed and its defaults filled in by
    resolve (the logged config says what ran); the whole list one param; the YAML reads back."""
    assert config.load([]).trainer.callbacks == []
    hook = "trainer.callbacks=[{_target_: callbacks.SignalAtStep, step: '6', signal: SIGTERM}]"
    cfg = resolve(config.load([hook]))
    entry = {"_target_": "callbacks.SignalAtStep", "step": 6, "signal": "SIGTERM", "job": None,
             "rank": None}  # fmt: skip
    assert cfg.trainer.callbacks == [entry]
    assert config.flatten(cfg)["trainer.callbacks"] == str([entry])
    text = config.to_yaml(cfg)
    back = config.to_config(OmegaConf.merge(OmegaConf.structured(Schema), OmegaConf.create(text)))
    assert back == cfg


def test_a_saved_job_config_gets_ampsweeps_run_settings(tmp_path):
    """A run's .hydra/config.yaml has no defaults list and no hydra section: rerun from it,
    it gets ampsweep's search path, logging, run and sweep dirs, which compose to the same
    settings as ampsweep's own primary config."""
    saved = tmp_path / "config.yaml"
    saved.write_text(OmegaConf.to_yaml(config.compose(["model=mlp"])))
    extra = config.saved_config_overrides(tmp_path, "config", [])
    assert "hydra/job_logging=none" in extra and "hydra/hydra_logging=none" in extra
    ours = config.compose(["model=mlp"], return_hydra_config=True).hydra
    rerun = config.compose([*extra], tmp_path, "config", return_hydra_config=True).hydra
    for key in ("run", "sweep", "job_logging", "hydra_logging"):
        assert OmegaConf.to_container(rerun[key]) == OmegaConf.to_container(ours[key]), key
    assert rerun.job.name == "ampsweep" and rerun.job.chdir is False
    # what the command gives already stays as given
    given = config.saved_config_overrides(tmp_path, "config", ["hydra.sweep.dir=mine"])
    assert not [o for o in given if o.startswith("hydra.sweep.dir=")]
    # ampsweep's own primary config, and one with a defaults list (reproduce's), get none
    assert config.saved_config_overrides(config.config_dir(), "config", []) == []
    saved.write_text("defaults:\n  - ampsweep_schema\n  - _self_\n")
    assert config.saved_config_overrides(tmp_path, "config", []) == []
