"""cli.py: `ampsweep train` end to end, and every bad input as one line and a non-zero exit.

The bad inputs run in-process through ``cli.main`` (fast, every case), and a representative
one of each kind (compose, validation, hardware, data, store) again in a real subprocess
(marked slow), where a traceback printed at exit would show.
"""

from __future__ import annotations

import pytest
from conftest import run_cli

from ampsweep.app import cli
from ampsweep.app import train as train_cmd
from ampsweep.tracking import store as mlflow_store


def runs_in(store: str):
    client = mlflow_store.client_for(store)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


# (overrides, the key=value the one line must name); {tmp} is the test's temporary folder.
BAD = [
    (["precision=fp8x"], "precision=fp8x"),
    (["trainer.epoch=3"], "trainer.epoch=3"),
    (["trainer.epochs=ten"], "trainer.epochs=ten"),
    (["trainer.batch_size=0"], "trainer.batch_size=0"),
    (["precision.scaler.init_scale=-1"], "precision.scaler.init_scale=-1"),
    (["precision.scaler.growth_factor=1.0"], "precision.scaler.growth_factor=1.0"),
    (["precision.scaler.backoff_factor=1.5"], "precision.scaler.backoff_factor=1.5"),
    (["trainer.grad_accum_steps=0"], "trainer.grad_accum_steps=0"),
    (["optimizer.lr=-1"], "optimizer.lr=-1"),
    (["precision=tf32"], "precision=tf32"),
    (["trainer.device=cuda"], "trainer.device=cuda"),
    (["precision=fp16_pure"], "precision=fp16_pure"),
    (["dataset=mnist", "dataset.root={tmp}/data"], "dataset=mnist"),
    (["dataset=imagefolder", "dataset.root={tmp}/images"], "dataset.root={tmp}/images"),
]
BAD_STORE = (["tracking.uri=sqlite:////no/such/folder/mlflow.db"], "tracking.uri=sqlite:////no")


def check_one_line_error(code: int, out: str, err: str, names: str) -> None:
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and names in lines[0], lines[0]
    assert "Traceback" not in out + err


def _fill(args: list[str], tmp) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in args]


@pytest.mark.parametrize("args,names", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_in_process(args, names, tmp_path, store, quick, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Hydra's run dir, if it gets that far, lands here
    if "{tmp}" in names:
        names = names.replace("{tmp}", str(tmp_path))
    code = cli.main(["train", *quick, f"tracking.uri={store}", *_fill(args, tmp_path)])
    captured = capsys.readouterr()
    check_one_line_error(code, captured.out, captured.err, names)
    assert runs_in(store) == []  # nothing recorded, so nothing left RUNNING
    assert list((tmp_path / "outputs" / "runs").glob("*/*")) == []  # no empty Hydra run dir


def test_unopenable_store_in_process(tmp_path, quick, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, names = BAD_STORE
    code = cli.main(["train", *quick, *args])
    captured = capsys.readouterr()
    check_one_line_error(code, captured.out, captured.err, names)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,names",
    [BAD[2], BAD[8], BAD[9], BAD[12], BAD_STORE],
    ids=["compose", "validate", "hardware", "data", "store"],
)
def test_bad_input_in_a_subprocess(args, names, tmp_path, store, quick):
    names = names.replace("{tmp}", str(tmp_path))
    uri = [] if args is BAD_STORE[0] else [f"tracking.uri={store}"]
    proc = run_cli(["train", *quick, *uri, *_fill(args, tmp_path)], cwd=tmp_path)
    check_one_line_error(proc.returncode, proc.stdout, proc.stderr, names)
    if uri:
        assert runs_in(store) == []


@pytest.mark.slow
def test_train_end_to_end(tmp_path, store, quick):
    proc = run_cli(["train", *quick, "model=mlp", f"tracking.uri={store}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "fp32-mlp-digits finished" in proc.stdout
    (run,) = runs_in(store)
    assert run.info.status == "FINISHED"
    client = mlflow_store.client_for(store)
    hydra = {a.path for a in client.list_artifacts(run.info.run_id, ".hydra")}
    assert {".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml"} <= hydra
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {
        "config.yaml",
        "summary.json",
    }
    tags = run.data.tags
    assert tags["overrides"].split() == [*quick, "model=mlp", f"tracking.uri={store}"]
    # Hydra's run dir is under outputs/ of the folder the command ran in.
    assert tags["run_dir"].startswith(str(tmp_path / "outputs" / "runs"))
    assert run.info.run_id in proc.stdout  # the summary says where the run is recorded


@pytest.mark.slow
def test_help_version_and_python_m(tmp_path):
    top = run_cli(["--help"], cwd=tmp_path)
    assert top.returncode == 0 and "train" in top.stdout and "usage: ampsweep" in top.stdout
    train_help = run_cli(["train", "--help"], cwd=tmp_path)
    assert train_help.returncode == 0, train_help.stderr
    assert "precision" in train_help.stdout and "Traceback" not in train_help.stderr
    version = run_cli(["--version"], cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("ampsweep ")
    assert not (tmp_path / "outputs").exists()  # help writes nothing


def test_no_arguments_prints_usage(capsys):
    assert cli.main([]) == 2
    assert "usage: ampsweep" in capsys.readouterr().out


def test_split_train_args():
    overrides, flags, bare = train_cmd.split_train_args(
        ["-m", "precision=fp32,fp16", "--config-name", "other", "-cp=/x", "model=mlp"]
    )
    assert overrides == ["precision=fp32,fp16", "model=mlp"]
    assert flags == {"--config-name": "other", "-cp": "/x"}
    assert bare == {"-m"}


@pytest.mark.parametrize(
    "raised,code,status,line",
    [
        (RuntimeError("disk full"), 1, "FAILED", "error: RuntimeError: disk full"),
        (KeyboardInterrupt(), 130, "KILLED", "error: interrupted"),
    ],
    ids=["failure", "ctrl-c"],
)
def test_a_run_that_breaks_is_ended_not_left_running(
    raised, code, status, line, tmp_path, store, quick, capsys, monkeypatch
):
    from ampsweep.engine import loop

    def broken(*args, **kwargs):
        raise raised

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loop, "fit", broken)
    assert cli.main(["train", *quick, "model=mlp", f"tracking.uri={store}"]) == code
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [line]
    assert "Traceback" not in captured.out + captured.err
    (run,) = runs_in(store)
    assert run.info.status == status


def test_printing_the_config_of_a_sweep_is_refused_in_one_line(capsys):
    assert cli.main(["train", "-m", "precision=fp32,bf16", "--cfg", "hydra"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cfg cannot be combined with -m" in err
