"""``ampsweep doctor --memory``: the finding and its prescriptions, written as the options of
an experiment; with ``--verify`` that experiment runs as a sweep recorded in MLflow, and each
prescription is judged by the step peak its own run measured. FSDP's prescription, whose job
runs two processes, is verified in tests/e2e/test_doctor_memory.py."""

from __future__ import annotations

import re

import pytest
from conftest import all_runs
from omegaconf import OmegaConf

from ampsweep.cli import doctor_memory
from ampsweep.cli.doctor_memory import Job, MemoryDoctor, option_of, sharded
from ampsweep.measure.capacity import Breakdown
from ampsweep.report.memory import Fix

FOLDER = "outputs/doctor/conf"
NO_MODEL = "tracking.log_model=false"  # the runs are judged by their metrics alone


@pytest.fixture
def store_uri(store_uri, monkeypatch):
    """The test's store, where the doctor's sweep records its runs."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    return store_uri


def test_a_larger_batch_is_verified_by_its_own_run_in_the_doctors_sweep(main, quick, store_uri):
    # a cnn's activations dominate its step: bf16 halves them, so a larger batch fits in
    # fp32's peak; the sweep runs fp32, bf16 and that batch, each a run in MLflow
    args = [*quick, "model=cnn", "trainer.batch_size=16", "trainer.max_steps=2", NO_MODEL]
    out = main("doctor", "--memory", "--verify", *args)
    assert out.code == 0, out.err[-3000:]
    text = " ".join(out.out.split())  # the console wraps long lines
    found = re.search(r"prescription for bf16: precision=bf16 trainer.batch_size=(\d+)", text)
    assert found, text
    batch = int(found[1])
    assert batch > 16
    option = f"bf16_batch_size_{batch}"
    verdict = re.search(
        rf"{option} \(precision=bf16 trainer.batch_size={batch}\): fixed: step peak "
        r"([\d.]+) (KiB|MiB) vs ([\d.]+) (KiB|MiB) of fp32 at batch 16 \(predicted",
        text,
    )
    assert verdict, text
    written = OmegaConf.load(f"{FOLDER}/experiment/doctor_memory.yaml")
    assert written.hydra.sweeper.params["+doctor_memory"] == f"fp32,bf16,{option}"
    assert written.trainer.batch_size == 16  # the user's, which the option's own overrides
    assert OmegaConf.load(f"{FOLDER}/doctor_memory/{option}.yaml").trainer.batch_size == batch
    runs = all_runs(store_uri)
    kids = {r.info.run_name: r for r in runs if r.data.tags.get("ampsweep.sweep") != "true"}
    assert set(kids) == {"fp32-cnn-digits", "bf16-cnn-digits", f"{option}-cnn-digits"}
    run = kids[f"{option}-cnn-digits"]
    assert run.data.params["trainer.batch_size"] == str(batch)
    assert (
        run.data.metrics["mem/step_peak_mib"]
        <= kids["fp32-cnn-digits"].data.metrics["mem/step_peak_mib"] * 1.1
    )  # what the verdict said, from the run MLflow holds


def test_without_verify_the_prescriptions_are_written_with_fsdps_predicted_peak(main, quick):
    args = [*quick, "model=mlp", "model.width=64", "trainer.batch_size=2", "trainer.max_steps=2"]
    out = main("doctor", "--memory", *args)
    assert out.code == 0, out.err
    text = " ".join(out.out.split())
    assert "fp32: step peak" in text
    assert "the weights, gradients and optimizer state are" in text
    assert "prescription for bf16: precision=bf16_pure (predicted" in text
    fsdp = "prescription for bf16: precision=bf16 trainer.strategy=fsdp trainer.nproc=2"
    assert re.search(rf"{fsdp} \(predicted [\d.]+ (KiB|MiB) per rank\)", text), text
    assert f"launch it: ampsweep train -m --config-dir {FOLDER} experiment=doctor_memory " in text
    assert "experiment=doctor_memory_nproc_2 " in text and "hydra/launcher=ampsweep_local" in text
    option = OmegaConf.load(f"{FOLDER}/doctor_memory/bf16_fsdp_nproc_2.yaml")
    assert (option.precision.name, option.trainer.strategy, option.trainer.nproc) == (
        "bf16",
        "fsdp",
        2,
    )
    two = OmegaConf.load(f"{FOLDER}/experiment/doctor_memory_nproc_2.yaml")
    assert two.trainer.nproc == 2  # its launcher starts that many processes for each job
    assert two.hydra.sweeper.params["+doctor_memory"] == "bf16_fsdp_nproc_2"


def test_a_prescription_that_is_a_mode_examined_too_runs_once(main, quick):
    args = [*quick, "model=mlp", "model.width=64", "trainer.batch_size=2", "trainer.max_steps=2"]
    out = main("doctor", "--memory", "--modes", "bf16,bf16_pure", *args)
    assert out.code == 0, out.err
    written = OmegaConf.load(f"{FOLDER}/experiment/doctor_memory.yaml")
    options = written.hydra.sweeper.params["+doctor_memory"].split(",")
    assert options[:3] == ["fp32", "bf16", "bf16_pure"]  # bf16's prescription, and a mode
    assert len(options) == len(set(options))
    two = OmegaConf.load(f"{FOLDER}/experiment/doctor_memory_nproc_2.yaml")
    assert two.hydra.sweeper.params["+doctor_memory"] == "bf16_fsdp_nproc_2,bf16_pure_fsdp_nproc_2"


def test_fsdps_limit_is_the_modes_peak_less_half_the_predicted_saving():
    parts = {"params": 16.0, "grads": 16.0, "optimizer": 32.0, "activations": 4.0, "other": 32.0}
    bd = Breakdown("bf16", 2, parts)
    fix = Fix(("precision=bf16", "trainer.strategy=fsdp", "trainer.nproc=2"), None, "shards")
    judged = sharded(fix, bd)
    assert judged.predicted_mib == 100.0 - 32.0  # half the weights, gradients and state
    assert judged.limit_mib == 100.0 - 16.0
    assert judged.verdict(80.0)[0] and not judged.verdict(100.0)[0]  # unsharded: not fixed
    four = sharded(Fix(fix.overrides[:2] + ("trainer.nproc=4",), None, "shards"), bd)
    assert four.predicted_mib == 100.0 - 48.0
    pure = Fix(("precision=bf16_pure",), 50.0, "pure", 100.0, "bf16")
    assert sharded(pure, bd) is pure  # a prediction of its own: left as it is


def test_each_prescription_is_an_option_named_after_its_overrides():
    masters = Fix(("precision=bf16_pure", "precision.master_weights=true"), 1.0, "masters")
    assert option_of(masters) == "bf16_pure_master_weights"
    job = Job(option_of(masters), list(masters.overrides), masters, "bf16")
    assert job.body("run") == {
        "precision": {"name": "bf16_pure", "master_weights": True},
        "tracking": {"run_name": "run"},
    }
    batch = Fix(("precision=bf16", "trainer.batch_size=48"), 1.0, "batch")
    assert option_of(batch) == "bf16_batch_size_48"
    fsdp = Fix(("precision=bf16", "trainer.strategy=fsdp", "trainer.nproc=2"), None, "shards")
    assert option_of(fsdp) == "bf16_fsdp_nproc_2"
    assert Job(option_of(fsdp), list(fsdp.overrides), fsdp).nproc == 2


def test_fsdps_job_is_left_out_where_no_launcher_can_start_its_ranks(monkeypatch):
    doctor = MemoryDoctor(None, ["bf16"], "cpu", print)
    fsdp = Job("bf16_fsdp_nproc_2", ["precision=bf16", "trainer.nproc=2"])
    assert doctor.runnable(fsdp) == "" and doctor.runnable(Job("bf16", ["precision=bf16"])) == ""
    real = doctor_memory.importlib.util.find_spec
    monkeypatch.setattr(
        doctor_memory.importlib.util,
        "find_spec",
        lambda name: None if name == doctor_memory.SUBMITIT else real(name),
    )
    assert doctor.runnable(fsdp) == (
        "its trainer.nproc=2 processes need hydra/launcher=ampsweep_local: "
        "pip install 'ampsweep[cluster]'"
    )


@pytest.mark.parametrize("given", ["trainer.nproc=2", "trainer.strategy=fsdp"])
def test_what_the_memory_doctor_cannot_use_is_one_line(given, main, store_uri):
    out = main("doctor", "--memory", "--verify", "model=mlp", given)
    assert out.code == 2
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1, out.err
    assert f"{given}: doctor --memory measures a step in one process" in lines[0]
    assert all_runs(store_uri) == []
