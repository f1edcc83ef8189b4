"""End to end through ``ampsweep``'s command line (in-process): a sweep with repeats prints a
report whose every verdict carries an interval, and gives the same report as explicit seeds; an
fp8 run in emulation is recorded with its converted layers and reproduces; a reproduction never
runs the callbacks a recorded config names; capacity and memory budgets; and every bad input of
these as one line, exit 2, nothing recorded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ampsweep.cli import main as cli
from ampsweep.tracking import store as mlflow_store

pytestmark = pytest.mark.slow


def runs_in(store: str) -> list:
    client = mlflow_store.client_for(store)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


def one_line_error(code: int, err: str, names: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], err
    assert "Traceback" not in err


SWEEP = ["precision=fp32,bf16", "model=mlp", "model.width=8", "trainer.epochs=1",
         "trainer.max_steps=8", "trainer.timing_warmup_steps=1", "trainer.progress=false",
         "diagnostics.every=0"]  # fmt: skip


def report_shape(out: str) -> tuple[list[str], list[str]]:
    """The console table's rows (their modes) and the findings with numbers removed."""
    out = out[out.index("\nSweep ") :]
    table = out.split("Findings")[0].splitlines()
    # The modes, in order (a relaunch's table adds its reused rows' status, "earlier", which
    # may leave the runs column out of a narrow console: the findings below say n=2).
    rows = [line.split()[0] for line in table if line.strip().startswith(("fp32", "bf16"))]
    verdicts = r"(slower than|faster than|indistinguishable in speed from|lower than|higher than|"
    verdicts += r"indistinguishable from)"  # timings on a shared machine may tip a verdict
    findings = [
        re.sub(verdicts, "VERDICT", re.sub(r"[-+]?\d[\d.,]*", "#", line))
        for line in out.split("Findings")[1].splitlines()
    ]
    return rows, [f for f in findings if f.strip().startswith("- ")]


def test_repeats_give_intervals_and_match_explicit_seeds(tmp_path, store, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "-m", *SWEEP, "sweep.repeats=2", f"tracking.uri={store}"]) == 0
    repeated = capsys.readouterr().out
    runs = runs_in(store)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert sorted((r.data.params["precision.name"], r.data.params["trainer.seed"])
                  for r in children) == [("bf16", "0"), ("bf16", "1"), ("fp32", "0"),
                                         ("fp32", "1")]  # fmt: skip
    parent = next(r for r in runs if r.data.tags.get("ampsweep.sweep") == "true")
    assert "sweep.repeats=2" in parent.data.tags["command"]  # the command as typed
    assert "2 seeds each" in repeated
    findings = repeated.split("Findings")[1]
    # A verdict on the interval, or (two runs) the mean and why the interval cannot judge yet;
    # the ratio always with its interval as a range.
    ratio = r"\d[\d.,e+-]*x \(\d[\d.,e+-]*-\d[\d.,e+-]*x\), n=2\)"
    # (a run timed while other processes had the machine is left out of the speed verdict:
    # with one of the two seeds contended the verdict stands on the other, "a single run";
    # with both, there is none)
    contended = "Timing contended" in findings and (
        "Speed, paired" not in findings
        or re.search(r"on this CPU \([\d.]+x, a single run\)", findings)
    )
    assert contended or re.search(
        r"bf16 (is|ran) ([\d.]+x |slightly )?(slower than|faster than|as fast as|"
        r"indistinguishable in speed from) fp32 on this CPU( in the mean)? \(" + ratio,
        findings,
    ), findings
    assert re.search(
        r"bf16's accuracy (is (lower than|higher than|indistinguishable from) fp32's \(|"
        r"against fp32's is )[-+]\d+\.\d \+/- \d+\.\d points, n=2",
        findings,
    ), findings
    # Nothing else stands on a single run: the accuracy verdicts pair both seeds.
    rest = re.sub(r"\([\d.]+x, a single run\)", "", findings) if contended else findings
    assert "single run" not in rest, findings
    # The same sweep with the seeds given explicitly: the same jobs (identical configs, so the
    # relaunch finds each one FINISHED already and skips it), and the same report.
    assert cli.main(["train", "-m", *SWEEP, "trainer.seed=0,1", f"tracking.uri={store}"]) == 0
    explicit = capsys.readouterr().out
    assert explicit.count("skipped, the identical config FINISHED") == 4
    reused = explicit[explicit.index("\nSweep ") :].split("Findings")[0].splitlines()
    assert sum("earlier" in line for line in reused if line.strip().startswith("fp32")) == 1
    assert report_shape(explicit) == report_shape(repeated)
    # ampsweep report reads the newest sweep back, with a memory budget on a CPU
    assert cli.main(["report", "--tracking-uri", store, "--memory-budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "max batch" in out and "the batch of fp32 on an 80 GiB GPU" in out


def test_fp8_emulated_run_is_recorded_and_reproduces(tmp_path, store, quick, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [*quick, "model=mlp", "precision=fp8_tensorwise", "precision.fp8.emulate=true"]
    assert cli.main(["train", *args, f"tracking.uri={store}"]) == 0
    (run,) = runs_in(store)
    tags, metrics = run.data.tags, run.data.metrics
    assert tags["fp8.converted"] == "4" and tags["fp8.kept"] == "1,7"
    assert tags["fp8.emulated"] == "true" and tags["precision"] == "fp8_tensorwise"
    assert metrics["fp8/flop_share"] == pytest.approx(2048 / (4096 + 2048 + 640))
    assert metrics["mem/activation_bytes_per_sample"] > 0 and metrics["mem/model_mib"] > 0
    client = mlflow_store.client_for(store)
    layers = json.loads(Path(client.download_artifacts(run.info.run_id, "fp8_layers.json",
                                                       str(tmp_path))).read_text())  # fmt: skip
    assert [(la["name"], la["converted"]) for la in layers["layers"]] == [
        ("1", False), ("4", True), ("7", False)]  # fmt: skip
    capsys.readouterr()
    assert cli.main(["reproduce", run.info.run_id, f"tracking.uri={store}"]) == 0
    again = next(r for r in runs_in(store) if r.info.run_id != run.info.run_id)
    assert again.data.tags["reproduces"] == run.info.run_id
    assert again.data.tags["fp8.converted"] == "4"


def test_reproduce_never_runs_the_runs_callbacks(tmp_path, store, quick, main):
    """A callback is code that whoever recorded the run named: reproducing the run leaves it
    out (and says so); a callback given to reproduce itself runs."""
    theirs, mine = tmp_path / "theirs.jsonl", tmp_path / "mine.jsonl"
    hook = "trainer.callbacks=[{{_target_: callbacks.RecordSteps, path: '{}'}}]"
    first = main("train", *quick, "model=mlp", f"tracking.uri={store}", hook.format(theirs))
    assert first.code == 0, first.err
    (run,) = runs_in(store)
    recorded = theirs.read_text()
    assert len(recorded.splitlines()) == 12  # before and after each of the 6 steps
    again = main("reproduce", run.info.run_id, f"tracking.uri={store}")
    assert again.code == 0, again.err
    assert "the run's trainer.callbacks are not run (callbacks.RecordSteps)" in again.err
    assert theirs.read_text() == recorded  # not called again
    own = main("reproduce", run.info.run_id, f"tracking.uri={store}", hook.format(mine))
    assert own.code == 0, own.err
    assert theirs.read_text() == recorded and len(mine.read_text().splitlines()) == 12
    copies = [r for r in runs_in(store) if r.data.tags.get("reproduces") == run.info.run_id]
    assert sorted(r.data.params["trainer.callbacks"] != "[]" for r in copies) == [False, True]


BAD = [
    (["train", "precision=fp8_rowwise", "model=mlp"], "precision.fp8.emulate=true"),
    (["train", "-m", "precision=fp32,fp8_rowwise", "precision.fp8.emulate=true"],
     "model=cnn has no nn.Linear layer fp8 can take"),
    (["train", "-m", "precision=fp32,bf16", "sweep.repeats=0"], "sweep.repeats=0 must be >= 1"),
    (["train", "precision=bf16", "sweep.repeats=3"], "sweep.repeats=3 repeats"),
    (["report", "--memory-budget", "80 apples"], "--memory-budget 80 apples: not a memory size"),
    (["capacity", "model=mlp"], "ampsweep capacity searches the largest batch on a CUDA GPU"),
    (["capacity", "--memory-budget", "lots"], "--memory-budget lots: not a memory size"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "names"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_records_nothing(args, names, tmp_path, store, capsys,
                                                   monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    where = ["--tracking-uri", store] if args[0] == "report" else [f"tracking.uri={store}"]
    code = cli.main([*args, *where])
    one_line_error(code, capsys.readouterr().err, names)
    assert runs_in(store) == []


def test_capacity_predicts_on_a_cpu_for_a_budget(tmp_path, store, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["capacity", "--memory-budget", "64MiB", "precision=fp32,bf16", "model=mlp",
            f"tracking.uri={store}"]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "predicted for 64 MiB" in out and "predicting (the search needs a CUDA GPU)" in out
    runs = runs_in(store)
    assert len(runs) == 2 and all(r.data.tags["ampsweep.capacity"] == "true" for r in runs)
    by_mode = {r.data.tags["precision"]: r.data.metrics for r in runs}
    assert by_mode["bf16"]["mem/max_batch_predicted"] > by_mode["fp32"]["mem/max_batch_predicted"]
    assert "mem/max_batch_measured" not in by_mode["fp32"]
