"""app/train.py: the train command in this process (``cli.main.main``): every bad input as one
line and exit 2 with nothing recorded, a broken run ended rather than left RUNNING, the
refusals of ``-m`` with ``trainer.nproc>1``, and a sweep with failing jobs."""

from __future__ import annotations

import json

import pytest
from conftest import all_runs, free_port

from ampsweep.tracking import store

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
    (["precision=bf16", "precision.master_weights=true"],
     "precision.master_weights=true needs a pure mode (fp16_pure, bf16_pure), and precision=bf16"),
    (["precision=bf16_pure", "precision.master_weights=true", "trainer.strategy=fsdp"],
     "precision.master_weights=true cannot run with trainer.strategy=fsdp"),
    (["dataset=mnist", "dataset.root={tmp}/data"], "dataset=mnist"),
    (["dataset=imagefolder", "dataset.root={tmp}/images"], "dataset.root={tmp}/images"),
    # trainer.callbacks: tests/callbacks.py is on the path of in-process tests
    (["trainer.callbacks=[{_target_: nosuchpkg.Hook}]"],
     "trainer.callbacks[0]._target_=nosuchpkg.Hook: no module named 'nosuchpkg'"),
    (["trainer.callbacks=[{_target_: callbacks.RecordStep, path: x}]"],
     "did you mean callbacks.RecordSteps?"),
    (["trainer.callbacks=[{_target_: callbacks.NoHooks}]"],
     "NoHooks has no before_update or after_step method: a callback has"),
    (["trainer.callbacks=[{_target_: callbacks.signal_at_step, step: 3}]"],
     "callbacks.signal_at_step: a function, not a class"),
    (["trainer.callbacks=[{_target_: callbacks.RecordSteps, paht: x}]"],
     "trainer.callbacks[0].paht=x: unknown key 'paht'"),
    (["trainer.callbacks=[{every: 3}]"], "trainer.callbacks[0]={'every': 3}: no _target_"),
    (["trainer.callbacks={_target_: callbacks.RecordSteps}"],
     "trainer.callbacks={_target_: callbacks.RecordSteps}: "),
    (["--config-name", "nope"], "--config-name nope: no such config"),
    (["--config-path", "{tmp}/nope"], "--config-path {tmp}/nope: no such folder"),
    (["--config-dir", "{tmp}/nope"], "--config-dir {tmp}/nope: no such folder"),
]  # fmt: skip
BAD_STORE = (["tracking.uri=sqlite:////no/such/folder/mlflow.db"], "tracking.uri=sqlite:////no")


def check_one_line_error(code: int, out: str, err: str, names: str) -> None:
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and names in lines[0], lines[0]
    assert "Traceback" not in out + err


def fill(args: list[str], tmp) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in args]


@pytest.mark.parametrize("args,names", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_in_process(args, names, tmp_path, store_uri, quick, main):
    names = names.replace("{tmp}", str(tmp_path))
    result = main("train", *quick, f"tracking.uri={store_uri}", *fill(args, tmp_path))
    check_one_line_error(result.code, result.out, result.err, names)
    assert all_runs(store_uri) == []  # nothing recorded, so nothing left RUNNING
    assert list((tmp_path / "outputs" / "runs").glob("*/*")) == []  # no empty Hydra run dir


def test_unopenable_store_in_process(quick, main):
    args, names = BAD_STORE
    result = main("train", *quick, *args)
    check_one_line_error(result.code, result.out, result.err, names)


def test_unreachable_server_fails_fast_before_training(tmp_path, quick, main, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for args, env, key in (
        ([f"tracking.uri={url}"], {}, "tracking.uri"),
        ([], {"MLFLOW_TRACKING_URI": url}, "MLFLOW_TRACKING_URI"),
    ):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        result = main("train", *quick, "model=mlp", *args)
        assert result.code == 2
        err = result.err.strip()
        assert f"{key}={url}" in err and "does not answer" in err and "mlflow server" in err
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert "steps" not in result.out  # no training started
        assert not (tmp_path / "outputs").exists()


def test_a_callback_from_the_config_sees_every_step(tmp_path, store_uri, quick, main):
    """trainer.callbacks: instantiated by the job, called before each update (gradients there)
    and after each step; recorded as a param, and not part of the config hash."""
    steps = tmp_path / "steps.jsonl"
    hook = f"trainer.callbacks=[{{_target_: callbacks.RecordSteps, path: '{steps}'}}]"
    result = main("train", *quick, "model=mlp", f"tracking.uri={store_uri}", hook)
    assert result.code == 0, result.err
    seen = [json.loads(line) for line in steps.read_text().splitlines()]
    expected = [[{"before_update": n, "grads": True}, {"after_step": n}] for n in range(1, 7)]
    assert seen == [record for pair in expected for record in pair]
    assert main("train", *quick, "model=mlp", f"tracking.uri={store_uri}").code == 0
    with_hook, without = sorted(all_runs(store_uri), key=lambda r: r.info.start_time)
    recorded = with_hook.data.params["trainer.callbacks"]
    assert recorded == str([{"_target_": "callbacks.RecordSteps", "path": str(steps)}])
    assert without.data.params["trainer.callbacks"] == "[]"
    assert with_hook.data.tags[store.CONFIG_HASH] == without.data.tags[store.CONFIG_HASH]


@pytest.mark.parametrize(
    "raised,code,status,line",
    [
        (RuntimeError("disk full"), 1, "FAILED", "error: RuntimeError: disk full"),
        (KeyboardInterrupt(), 130, "KILLED", "error: interrupted: "),
    ],
    ids=["failure", "ctrl-c"],
)
def test_a_run_that_breaks_is_ended_not_left_running(
    raised, code, status, line, store_uri, quick, main, monkeypatch
):
    from ampsweep.engine import loop

    def broken(*args, **kwargs):
        raise raised

    monkeypatch.setattr(loop, "fit", broken)
    result = main("train", *quick, "model=mlp", f"tracking.uri={store_uri}")
    assert result.code == code
    (said,) = result.err.strip().splitlines()
    assert said.startswith(line)
    assert "Traceback" not in result.out + result.err
    (run,) = all_runs(store_uri)
    assert run.info.status == status


def test_printing_the_config_of_a_sweep_is_refused_in_one_line(main):
    result = main("train", "-m", "precision=fp32,bf16", "--cfg", "hydra")
    assert result.code == 2
    assert result.err.count("\n") == 1 and "--cfg cannot be combined with -m" in result.err


# ---------------------------------------------------------------- -m with trainer.nproc > 1


def test_a_sweep_of_ddp_jobs_needs_a_launcher_that_starts_processes(store_uri, main):
    result = main(
        "train", "-m", "precision=fp32,bf16", "trainer.nproc=2", f"tracking.uri={store_uri}"
    )
    check_one_line_error(result.code, result.out, result.err, "trainer.nproc=2 in a sweep")
    assert "hydra/launcher=ampsweep_slurm" in result.err
    assert all_runs(store_uri) == []  # refused before the sweep's parent run


def test_the_largest_nproc_of_a_sweep_is_the_one_refused(store_uri, main):
    result = main("train", "-m", "trainer.nproc=1,3", f"tracking.uri={store_uri}")
    check_one_line_error(result.code, result.out, result.err, "trainer.nproc=3 in a sweep")


def test_a_sweep_under_torchrun_is_refused(store_uri, main, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    result = main("train", "-m", "precision=fp32,bf16", f"tracking.uri={store_uri}")
    check_one_line_error(result.code, result.out, result.err, "-m under torchrun")
    assert all_runs(store_uri) == []


# ---------------------------------------------------------------- a sweep with failing jobs


@pytest.mark.slow
def test_a_failing_job_fails_its_child_and_the_parent_not_the_sweep(store_uri, quick, main):
    # tf32 cannot run on a CPU; the fp32 jobs share a name, so they get their job numbers.
    args = ["train", "-m", "precision=fp32,tf32", "optimizer.lr=0.001,0.002"]
    result = main(*args, f"tracking.uri={store_uri}", "trainer.device=cpu", *quick, "model=mlp")
    assert result.code == 1
    assert "2 of 4 jobs failed" in result.err
    # Hydra's basic sweeper runs the product in override order: fp32 jobs 0-1, tf32 jobs 2-3.
    assert "#2 tf32-mlp-digits-2 (FAILED); #3 tf32-mlp-digits-3 (FAILED)" in result.err
    # Each job's error is said once when it fails (and once more in the report's findings).
    assert result.err.count("precision=tf32 needs a CUDA GPU") == 2
    assert result.out.count("precision=tf32 needs a CUDA GPU") == 2
    assert "Traceback" not in result.err
    runs = all_runs(store_uri)
    parents = [r for r in runs if r.data.tags.get(store.SWEEP) == "true"]
    kids = [r for r in runs if store.PARENT in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FAILED"
    tags = parents[0].data.tags
    assert (tags["jobs_total"], tags["jobs_finished"], tags["jobs_failed"]) == ("4", "2", "2")
    status = {k.info.run_name: k.info.status for k in kids}
    assert status == {
        "fp32-mlp-digits-0": "FINISHED",
        "fp32-mlp-digits-1": "FINISHED",
        "tf32-mlp-digits-2": "FAILED",
        "tf32-mlp-digits-3": "FAILED",
    }
    failed = next(k for k in kids if k.info.run_name == "tf32-mlp-digits-2")
    assert "needs a CUDA GPU" in failed.data.tags["error"]
    assert all(k.info.status != "RUNNING" for k in kids)


# ---------------------------------------------------------------- how often a command composes


@pytest.fixture
def compositions(monkeypatch) -> list[list[str]]:
    """The overrides of every composition of a config from here on, ampsweep's own compose
    API (``config.compose``) and Hydra's runs alike: both go through Hydra's config loader."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    composed: list[list[str]] = []
    load = ConfigLoaderImpl.load_configuration

    def counting(self, config_name, overrides, run_mode, *args, **kwargs):
        composed.append(list(overrides))
        return load(self, config_name, overrides, run_mode, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counting)
    return composed


def test_a_single_run_is_composed_once_and_runs_as_composed(
    store_uri, quick, main, compositions, tmp_path
):
    """Hydra's loader composes the run once; ampsweep plans that config and Hydra runs it in
    its run dir (hydra.run.dir), with its .hydra/ files."""
    run_dir = tmp_path / "the-run"
    args = [*quick, "model=mlp", f"tracking.uri={store_uri}", f"hydra.run.dir={run_dir}"]
    result = main("train", *args)
    assert result.code == 0, result.err
    assert len(compositions) == 1 and "model=mlp" in compositions[0], compositions
    (run,) = all_runs(store_uri)
    assert run.info.status == "FINISHED" and run.info.run_name == "fp32-mlp-digits"
    assert "model=mlp" in (run_dir / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.parametrize("sweeper,per_job", [("ampsweep", 1), ("basic", 2)])
def test_hydra_composes_each_job_once_to_run_it_after_ampsweeps_check(
    store_uri, quick, main, sweeper, per_job, compositions
):
    """Every composition of a sweep is counted: the sweep's own config once (Hydra's
    multirun), then each job once with ampsweep's sweeper (the default), which hands it to
    ampsweep's checks and then to the launcher as it is. Hydra's basic sweeper composes each
    job once more, to check its batch."""
    args = ["precision=fp32,bf16", f"hydra/sweeper={sweeper}", f"tracking.uri={store_uri}"]
    result = main("train", "-m", *args, *quick, "model=mlp")
    assert result.code == 0, result.err
    assert len(compositions) == 1 + 2 * per_job, compositions  # the sweep's, then each job's
    assert {o for job in compositions[1:] for o in job if o.startswith("precision=")} == {
        "precision=fp32",
        "precision=bf16",
    }
    runs = all_runs(store_uri)
    assert sorted(r.info.run_name for r in runs if store.PARENT in r.data.tags) == [
        "bf16-mlp-digits",
        "fp32-mlp-digits",
    ]


def test_a_sweep_dir_given_on_the_command_line_is_used(tmp_path, store_uri, quick, main):
    args = ["-m", "precision=fp32,bf16", "model=mlp", *quick, f"tracking.uri={store_uri}"]
    result = main("train", *args, "hydra.sweep.dir=sweeps/mine")
    assert result.code == 0, result.err
    made = {p.name for p in (tmp_path / "sweeps" / "mine").iterdir()}
    assert {"0", "1", "multirun.yaml", "ampsweep_sweep.json"} <= made, made
    assert not (tmp_path / "outputs" / "multirun").exists()


# ---------------------------------------------------------------- Hydra's sweep grammar


def test_a_glob_sweep_with_exclude_runs_the_modes_it_picks(store_uri, quick, main):
    pick = "precision=glob(*,exclude=[tf32,fp8*,auto,fp16*,bf16_pure])"
    result = main("train", "-m", pick, f"tracking.uri={store_uri}", *quick, "model=mlp")
    assert result.code == 0, result.err
    runs = all_runs(store_uri)
    (parent,) = [r for r in runs if r.data.tags.get(store.SWEEP) == "true"]
    kids = [r for r in runs if r.data.tags.get(store.PARENT) == parent.info.run_id]
    assert sorted(k.data.tags[store.PRECISION] for k in kids) == ["bf16", "fp32"]
    assert parent.info.status == "FINISHED"


@pytest.mark.parametrize(
    "args,line",
    [
        (["precision=glob("], "precision=glob(: cannot parse this override"),
        (["trainer.seed=range(a)"], "trainer.seed=range(a): cannot parse this override"),
        (["hydra/sweeper=nope"], "hydra/sweeper=nope: no such sweeper: choose one of basic, "),
        (["hydra/launcher=nope"], "hydra/launcher=nope: no such launcher: choose one of basic"),
    ],
    ids=["glob-unclosed", "range-of-a-word", "sweeper", "launcher"],
)
def test_a_malformed_sweep_is_one_line(args, line, store_uri, main):
    result = main("train", "-m", *args, f"tracking.uri={store_uri}")
    check_one_line_error(result.code, result.out, result.err, line)
    assert "range(0,3)" in result.err or "choose one of" in result.err  # the fix
    assert all_runs(store_uri) == []


def test_every_problem_of_a_sweep_is_said_before_its_parent_exists(tmp_path, store_uri, main):
    (tmp_path / "outputs").mkdir()  # a folder of the user's own stays
    args = ["trainer.batch_size=32,0", "optimizer.lr=-1,0.1", "precision=fp32,bf16"]
    result = main("train", "-m", *args, f"tracking.uri={store_uri}")
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    assert all(ln.startswith("error: ") for ln in lines) and len(lines) == len(set(lines))
    assert any("trainer.batch_size=0 must be > 0" in ln for ln in lines)
    assert any("optimizer.lr=-1.0 must be > 0" in ln for ln in lines)
    assert "Traceback" not in result.out + result.err
    assert all_runs(store_uri) == []  # no parent run, no child
    assert (tmp_path / "outputs").is_dir()  # the user's folder stays, without a sweep folder
    assert not any((tmp_path / "outputs").iterdir())


def test_a_config_that_asks_for_a_sweep_is_swept_without_m(tmp_path, store_uri, quick, main):
    """``hydra.mode: MULTIRUN`` in a config (here an experiment file with its own sweep
    params) makes the command a sweep, as in any Hydra app: a parent and a child per job."""
    experiment = tmp_path / "conf" / "experiment" / "modes.yaml"
    experiment.parent.mkdir(parents=True)
    experiment.write_text(
        "# @package _global_\n"
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      precision: fp32,bf16\n"
    )
    args = ["--config-dir", str(tmp_path / "conf"), "experiment=modes", "model=mlp", *quick]
    result = main("train", *args, f"tracking.uri={store_uri}")
    assert result.code == 0, result.err
    runs = all_runs(store_uri)
    (parent,) = [r for r in runs if r.data.tags.get(store.SWEEP) == "true"]
    kids = sorted(r.info.run_name for r in runs if store.PARENT in r.data.tags)
    assert kids == ["bf16-mlp-digits", "fp32-mlp-digits"]
    assert parent.info.status == "FINISHED"
