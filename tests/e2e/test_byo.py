"""Your own model, data and loss, end to end: a project folder with a Python module and one
YAML file per component (nothing else touched) is trained, recorded, resumed and reproduced by
``ampsweep train --config-dir``; every bad input is refused in one line, with nothing left in
the store."""

from __future__ import annotations

import itertools
import sys

import pytest

from ampsweep.cli.reproduce import reproduce
from ampsweep.cli.train import cmd_train
from ampsweep.tracking import store as mlflow_store

MODULE = '''
import torch
from torch import nn


def make_net(in_channels, num_classes, hidden=16):
    # A lazy layer: its input size is learnt from the first batch.
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(hidden), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(hidden, num_classes))


def two_classes(in_channels):
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(2))


def not_a_model(num_classes):
    return "a model, honestly"


class Blobs(torch.utils.data.Dataset):
    """Three classes of 1x4x4 inputs around three centres: learnable in a few steps."""

    classes = ("a", "b", "c")

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        centres = 2.0 * torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(7))
        self.x = centres[self.y] + 0.5 * torch.randn(n, 1, 4, 4, generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i].numpy(), int(self.y[i])  # arrays and ints: tensor-like is enough


def make_blobs(n=400, seed=0):
    return Blobs(n, seed)


def make_pair(n=400, seed=0):
    return Blobs(n, seed), Blobs(n // 4, seed + 1)


def float_labels():
    return [(torch.zeros(1, 4, 4), 0.5)] * 20


def not_pairs():
    return [torch.zeros(1, 4, 4)] * 20
'''

_count = itertools.count()


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project folder (the current folder): a package and its conf/, written here."""
    name = f"byo_pkg_{next(_count)}"  # a fresh module per test: imports are cached
    folder = tmp_path / "project"
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text("")
    (folder / name / "parts.py").write_text(MODULE)
    conf = folder / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "dataset").mkdir()
    (conf / "model" / "blob_net.yaml").write_text(f"_target_: {name}.parts.make_net\nhidden: 16\n")
    (conf / "dataset" / "blobs.yaml").write_text(
        f"_target_: {name}.parts.make_blobs\nname: blobs\nn: 400\nseed: 0\n"
    )
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the project folder joins it: undo that
    return folder, name


def train(store: str, *overrides: str) -> int:
    args = [
        "--config-dir", "conf", "model=blob_net", "dataset=blobs", "trainer.epochs=3",
        "trainer.batch_size=32", "trainer.log_every=2", "trainer.progress=false",
        "trainer.deterministic=true", "trainer.timing_warmup_steps=1", f"tracking.uri={store}",
        *overrides,
    ]  # fmt: skip
    return cmd_train(args)


def runs(store: str):
    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name("ampsweep")
    return client, client.search_runs([exp.experiment_id]) if exp else []


def test_a_model_and_a_data_set_of_ones_own_train_and_are_recorded(project, store):
    folder, name = project
    assert train(store) == 0
    client, (run,) = runs(store)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "fp32-make_net-blobs"  # the callable's name, or the YAML's name
    tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
    assert tags["model"] == "make_net" and tags["dataset"] == "blobs"
    assert tags["model.target"] == f"{name}.parts.make_net"
    assert tags["dataset.target"] == f"{name}.parts.make_blobs"
    assert len(tags["model.target.sha256"]) == 64  # the module's file, for reproduce
    assert params["model._target_"] == f"{name}.parts.make_net" and params["model.hidden"] == "16"
    # 400 samples, 20% held out by dataset.val_fraction/split_seed; the classes from `classes`
    assert (tags["data.train_samples"], tags["data.val_samples"]) == ("320", "80")
    assert (tags["data.num_classes"], tags["data.input_shape"]) == ("3", "1x4x4")
    assert tags["data.preload"] == "True"  # small: decoded once and kept on the device
    # The lazy layer got its shape before parameters were counted: 16*16+16 + 16*3+3.
    assert tags["model.num_params"] == str(16 * 16 + 16 + 16 * 3 + 3)
    assert metrics["val/acc"] >= 0.9, metrics  # and the optimizer trained it


def test_a_train_and_validation_pair_is_used_as_given(project, store):
    folder, name = project
    (folder / "conf" / "dataset" / "pair.yaml").write_text(f"_target_: {name}.parts.make_pair\n")
    assert train(store, "dataset=pair", "dataset.preload=false") == 0
    _, (run,) = runs(store)
    tags = run.data.tags
    assert (tags["data.train_samples"], tags["data.val_samples"]) == ("400", "100")
    assert tags["data.preload"] == "False"  # dataset.preload=false: the DataLoader path
    assert run.data.metrics["val/acc"] >= 0.85


def test_a_loss_from_a_target(project, store):
    assert train(store, "+loss._target_=torch.nn.CrossEntropyLoss", "loss.label_smoothing=0.2") == 0
    _, (run,) = runs(store)
    assert run.data.params["loss._target_"] == "torch.nn.CrossEntropyLoss"
    assert run.data.tags["loss.target"] == "torch.nn.CrossEntropyLoss"
    assert run.data.tags["loss.target.version"].startswith("torch ")
    # label smoothing keeps the loss away from zero: at 0.2 over 3 classes, above 0.3
    assert run.data.metrics["val/loss"] > 0.3 and run.data.metrics["val/acc"] >= 0.85


def test_reproduce_of_a_user_model_repeats_its_loss_history_exactly(project, store, capsys):
    folder, name = project
    assert train(store, "trainer.max_steps=12") == 0
    client, (orig,) = runs(store)
    rid = orig.info.run_id
    assert reproduce(rid, [f"tracking.uri={store}"]) == 0
    err = capsys.readouterr().err
    assert "model.target" not in err and "data differs" not in err  # the same code and data
    _, found = runs(store)
    (new,) = [r for r in found if r.data.tags.get("reproduces") == rid]
    history = [
        [(m.step, m.value) for m in client.get_metric_history(r, "train/loss")]
        for r in (rid, new.info.run_id)
    ]
    assert len(history[0]) == 6 and sorted(history[0]) == sorted(history[1])
    assert orig.data.metrics["val/acc"] == new.data.metrics["val/acc"]
    # The module changes: a reproduction says the code differs before it trains.
    parts = folder / name / "parts.py"
    parts.write_text(parts.read_text() + "\n# edited\n")
    assert reproduce(rid, [f"tracking.uri={store}"]) == 0
    assert "code differs: model.target.sha256:" in capsys.readouterr().err


def test_a_user_model_resumes_from_its_checkpoint(project, store, tmp_path):
    from ampsweep.config import compose
    from ampsweep.engine import checkpoint, loop, run_folder
    from ampsweep.engine.build import build

    overrides = [
        "model=blob_net", "dataset=blobs", "trainer.max_steps=8", "trainer.checkpoint_every=4",
        "trainer.deterministic=true", "tracking=none", f"trainer.checkpoint_dir={tmp_path}/ck",
    ]  # fmt: skip
    cfg = compose.load(overrides, search=[compose.search_entry("conf")])
    whole = build(cfg)
    folder = run_folder.folder_for(cfg, "r")
    summary = loop.fit(
        whole, lambda m, s: None, checkpoints=checkpoint.Checkpointer(folder, cfg, "r")
    )
    mid = folder / "step-00000004.pt"
    resumed = build(cfg)
    state = checkpoint.restore(resumed, checkpoint.load(mid))
    rest = loop.fit(resumed, lambda m, s: None, state=state)
    assert rest["val/loss"] == summary["val/loss"] and rest["val/acc"] == summary["val/acc"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model._target_=nopkg_xyz.nets.make"],
            "model._target_=nopkg_xyz.nets.make: no module named 'nopkg_xyz'",
        ),
        (
            ["model._target_={pkg}.parts.make_nett"],
            "has no attribute 'make_nett': did you mean {pkg}.parts.make_net?",
        ),
        (
            ["+model.hiden=3", "+model.num_classes=4"],
            "model.hiden=3: unknown key 'hiden' for model._target_={pkg}.parts.make_net: did you "
            "mean model.hidden?; valid keys in model: hidden; model.num_classes=4: ampsweep "
            "passes num_classes",
        ),
        (
            ["model._target_={pkg}.parts.not_a_model", "~model.hidden"],
            "returned a str, not a torch.nn.Module",
        ),
        (
            ["model._target_={pkg}.parts.two_classes", "~model.hidden"],
            "outputs 2 classes but the labels of dataset._target_={pkg}.parts.make_blobs go up "
            "to 2: build the model for 3 classes",
        ),
        (
            ["dataset._target_={pkg}.parts.float_labels", "~dataset.n", "~dataset.seed"],
            "item 0: the label 0.5 is not a class index (an int >= 0)",
        ),
        (
            ["dataset._target_={pkg}.parts.not_pairs", "~dataset.n", "~dataset.seed"],
            "item 0 is a Tensor, not an (input, label) pair",
        ),
        (
            ["+trainer.epochz=3"],
            "trainer.epochz=3: unknown key 'epochz': did you mean trainer.epochs?",
        ),
    ],
    ids=[
        "no-module",
        "no-name",
        "arguments",
        "not-a-module",
        "labels-exceed",
        "float-label",
        "not-pairs",
        "misspelt-plus-key",
    ],  # fmt: skip
)
def test_bad_input_is_one_line_and_leaves_nothing(project, store, capsys, overrides, message):
    folder, name = project
    code = train(store, *(o.format(pkg=name) for o in overrides))
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.format(pkg=name) in " ".join(err.split()), err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert runs(store)[1] == []  # nothing recorded
    assert not (folder / "outputs" / "runs").exists() or not any(
        (folder / "outputs" / "runs").rglob("config.yaml")
    )


@pytest.mark.slow
def test_a_user_model_trains_under_ddp_as_one_run(project, store):
    """trainer.nproc=2: each worker runs the command again, from the same folder, and imports
    the project's package there."""
    from conftest import run_cli

    folder, _ = project
    args = ["train", "--config-dir", "conf", "model=blob_net", "dataset=blobs", "trainer.nproc=2",
            "trainer.epochs=2", "trainer.batch_size=16", "trainer.progress=false",
            f"tracking.uri={store}"]  # fmt: skip
    proc = run_cli(args, folder, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, (run,) = runs(store)
    assert run.data.params["world_size"] == "2" and run.info.status == "FINISHED"
    assert run.data.tags["model.num_params"] == str(16 * 16 + 16 + 16 * 3 + 3)
    assert run.data.metrics["val/acc"] >= 0.85
