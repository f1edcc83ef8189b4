"""report/recommend.py on constructed runs: a clear win on a GPU, a tie within the intervals,
a baseline at chance, a CPU-only sweep, and a faster mode whose numerics went wrong."""

from __future__ import annotations

import pytest

from ampsweep.report import render, sweeps
from ampsweep.tracking.store import FP8_EMULATED
from unit.report.test_stats import CPU, CUDA, run

COMMAND = "ampsweep train -m precision=fp32,bf16,fp16 sweep.repeats=3 model=cnn trainer.epochs=2"


def sweep_of(speeds, accs, device=CUDA, bf16_diverged=False, **tags):
    runs, job = [], 0
    for mode, sps in speeds.items():
        for seed, (s, a) in enumerate(zip(sps, accs[mode], strict=True)):
            act = 1.0 if mode == "fp32" else 0.5
            diverged = {"diverged": "true"} if bf16_diverged and mode == "bf16" else {}
            these = {**tags, **diverged}
            runs.append(run(mode, seed, job, device=device, tags=these, sps=s, acc=a, act=act))
            job += 1
    return sweeps.make_report({"run_id": "p", "name": "s", "command": COMMAND}, runs)


FP32 = [1000.0, 1100.0, 900.0]
ACC = [0.980, 0.986, 0.983]


def test_a_clear_win_is_recommended_with_its_evidence_runner_up_and_command():
    rep = sweep_of(
        {"fp32": FP32, "bf16": [3000.0, 3350.0, 2650.0], "fp16": [2000.0, 2180.0, 1830.0]},
        {"fp32": ACC, "bf16": [0.981, 0.984, 0.985], "fp16": [0.979, 0.987, 0.982]},
    )
    rec = rep.recommendation
    assert (rec.mode, rec.runner_up, rec.open_question) == ("bf16", "fp16", "")
    assert rec.command == "ampsweep train precision=bf16 model=cnn trainer.epochs=2"
    assert rec.reason.startswith("bf16 is 3.0x faster than fp32 for cnn on digits on this GPU")
    assert "accuracy 0.983 (+0.0 +/- 0.5 points vs fp32)" in rec.reason
    assert "0.50x the activation memory" in rec.reason and "no loss scaler needed" in rec.reason
    assert "Runner-up: fp16, 2.0x faster." in rec.reason
    # the report opens with it: the console's first lines, the Markdown's, report.json
    assert render.opening(rep)[0].startswith("Use bf16: bf16 is 3.0x faster")
    assert render.to_markdown(rep).split("\n")[2].startswith("**Use bf16:")
    assert '"mode": "bf16"' in render.to_json(rep)


def test_a_tie_within_the_intervals_is_an_open_question_with_the_repeats_that_close_it():
    rep = sweep_of(
        {"fp32": FP32[:2], "bf16": [1400.0, 1000.0]},
        {"fp32": ACC[:2], "bf16": [0.981, 0.984]},
    )
    rec = rep.recommendation
    assert rec.mode is None and "bf16" in rec.open_question
    assert "cannot yet be told from fp32" in rec.reason and "too wide to judge" in rec.reason
    needed = int(rec.command.rsplit("sweep.repeats=", 1)[1])
    assert needed > 2 and f"About {needed} runs per mode" in rec.reason
    assert rec.command.startswith("ampsweep train -m precision=fp32,bf16,fp16 model=cnn")


def test_a_baseline_at_chance_is_not_a_baseline():
    rep = sweep_of(
        {"fp32": FP32, "bf16": [3000.0, 3350.0, 2650.0]},
        {"fp32": [0.117, 0.12, 0.11], "bf16": [0.118, 0.11, 0.12]},
        **{"data.num_classes": "10"},
    )
    rec = rep.recommendation
    assert rec.mode is None
    assert rec.reason.startswith(
        "fp32 reached accuracy 0.116, near chance for 10 classes (0.100): the baseline has "
        "not learned, so no mode can be judged against it"
    )
    assert "trainer.epochs=<more>" in rec.command and "trainer.epochs=2" not in rec.command


def test_a_cpu_sweep_leaves_speed_to_a_gpu_run():
    rep = sweep_of(
        {"fp32": FP32, "bf16": [3000.0, 3350.0, 2650.0]},
        {"fp32": ACC, "bf16": [0.981, 0.984, 0.985]},
        device=CPU,
    )
    rec = rep.recommendation
    assert rec.mode is None and "GPU" in rec.open_question
    assert rec.reason.startswith("cpu (x86_64, 2 threads, torch 2.14.1) has no tensor cores")
    assert "Quality held for bf16: accuracy 0.983" in rec.reason
    assert rec.command.endswith("trainer.device=cuda")


def test_a_faster_mode_whose_numerics_went_wrong_is_never_recommended():
    rep = sweep_of(
        {"fp32": FP32, "bf16": [3000.0, 3350.0, 2650.0]},
        {"fp32": ACC, "bf16": [0.981, 0.984, 0.985]},
        bf16_diverged=True,
    )
    rec = rep.recommendation
    assert rec.mode == "fp32" and "bf16 went wrong numerically" in rec.reason


# What a run logs of its share of the machine (measure.contention): alone on 2 cores, and
# beside processes that took 1.2 of them.
IDLE = {"perf/cpu_cores_used": 1.9, "perf/cpu_cores_others": 0.05, "perf/cpu_cores": 2.0}
BUSY = {"perf/cpu_cores_used": 0.8, "perf/cpu_cores_others": 1.2, "perf/cpu_cores": 2.0}


def contend(rep_runs, busy):
    """Give every run its share of the machine: BUSY for the (mode, seed) pairs in ``busy``."""
    for r in rep_runs:
        r.metrics.update(BUSY if (r.precision, r.params["trainer.seed"]) in busy else IDLE)
    return sweeps.make_report({"run_id": "p", "name": "s", "command": COMMAND}, rep_runs)


SPEEDS = {"fp32": FP32, "bf16": [3000.0, 3350.0, 2650.0], "fp16": [2000.0, 2180.0, 1830.0]}
ACCS = {"fp32": ACC, "bf16": [0.981, 0.984, 0.985], "fp16": [0.979, 0.987, 0.982]}


def test_contended_timings_are_left_out_of_the_speed_verdict_with_a_note():
    every_bf16 = {("bf16", str(seed)) for seed in range(3)}
    rep = contend(sweep_of(SPEEDS, ACCS).runs, every_bf16)
    rec = rep.recommendation
    # bf16 measured 3x, but only while others had the machine: fp16 is the verdict
    assert rec.mode == "fp16" and rec.reason.startswith("fp16 is 2.0x faster than fp32")
    assert "The timings of bf16 were contended" in rec.reason
    bf16 = next(r for r in rep.summary if r.precision == "bf16")
    assert bf16.contended and bf16.contended_runs == 3 and bf16.timing == "3/3 contended"
    text = "\n".join(rep.findings)
    assert "Timing contended" in text and "3 of 3" not in text
    assert "bf16-cnn-digits: other processes used 1.2 of 2 cores (this run 0.8)" in text
    speed = next(f for f in rep.findings if f.startswith("Speed"))
    assert "fp16 is 2.0x faster" in speed and "bf16" not in speed


def test_a_contended_baseline_leaves_speed_an_open_question():
    every_fp32 = {("fp32", str(seed)) for seed in range(3)}
    rep = contend(sweep_of(SPEEDS, ACCS).runs, every_fp32)
    rec = rep.recommendation
    assert rec.mode is None and "idle machine" in rec.open_question
    assert "every timing that would compare their speed was contended" in rec.reason
    assert not any(f.startswith("Speed") for f in rep.findings)


def test_one_contended_repeat_is_left_out_of_the_speed_up_of_its_mode():
    rep = contend(sweep_of(SPEEDS, ACCS).runs, {("bf16", "1")})
    bf16 = next(r for r in rep.summary if r.precision == "bf16")
    assert not bf16.contended and bf16.contended_runs == 1 and bf16.n == 3
    assert bf16.ci["speedup"].n == 2  # seeds 0 and 2 only
    assert bf16.speedup == pytest.approx((3000 / 1000 * 2650 / 900) ** 0.5)
    assert rep.recommendation.mode == "bf16"
    assert any("1 of 3 runs of bf16" in f and "from the other 2" in f for f in rep.findings)


def test_a_machine_with_room_to_spare_is_not_contended():
    from ampsweep.measure.contention import contended

    assert contended(0.8, 1.2, 2.0)  # others took more than a quarter of a full machine
    assert not contended(1.9, 0.05, 2.0)  # alone
    assert not contended(4.0, 2.0, 16.0)  # others busy, but cores were left idle
    assert not contended(None, None, None)  # not measured (an older run): no flag


@pytest.mark.parametrize(
    ("typed", "gpu_has"),
    [
        ("precision.fp8.emulate=true", ""),  # asked for on the command line: dropped
        ("+precision.fp8.emulate=true", ""),
        ("", " precision.fp8.emulate=false"),  # set by the sweep's config files: turned off
    ],
)
def test_a_cpu_sweep_of_emulated_fp8_suggests_real_fp8_on_the_gpu(typed, gpu_has):
    command = f"ampsweep train -m precision=fp32,fp8_rowwise model=mlp {typed} trainer.epochs=2"
    runs = [
        run("fp32", 0, 0, sps=1000.0, acc=0.98),
        run("fp8_rowwise", 0, 1, sps=200.0, acc=0.98, tags={FP8_EMULATED: "true"}),
    ]
    rep = sweeps.make_report({"run_id": "p", "name": "s", "command": command}, runs)
    assert rep.rows[1].emulated  # the run the suggestion is about was emulated
    assert rep.recommendation.command == (
        "ampsweep train -m precision=fp32,fp8_rowwise model=mlp trainer.epochs=2 "
        f"trainer.device=cuda{gpu_has}"
    )
    # a rerun on this CPU keeps the emulation: without it, fp8 cannot run here
    runs[0].tags["data.num_classes"] = "10"
    runs[0].metrics["val/acc"] = 0.1
    rerun = sweeps.make_report({"run_id": "p", "name": "s", "command": command}, runs)
    assert typed in rerun.recommendation.command
    assert "emulate=false" not in rerun.recommendation.command


def test_a_row_with_a_precision_setting_is_recommended_by_it_and_its_command_sets_it():
    # the doctor's verify sweep: bf16_pure beside bf16_pure with fp32 master weights
    speeds = {"fp32": FP32, "bf16_pure": [1500.0, 1650.0, 1350.0], "masters": [2000.0] * 3}
    runs, job = [], 0
    for name, sps in speeds.items():
        mode = "bf16_pure" if name == "masters" else name
        for seed, (s, a) in enumerate(zip(sps, ACC, strict=True)):
            runs.append(run(mode, seed, job, device=CUDA, sps=s, acc=a, act=1.0))
            runs[-1].params["precision.master_weights"] = str(name == "masters")
            job += 1
    rep = sweeps.make_report({"run_id": "p", "name": "s", "command": COMMAND}, runs)
    rec = rep.recommendation
    assert (rec.mode, rec.runner_up) == ("bf16_pure (master_weights=true)", "bf16_pure")
    assert rec.command == (
        "ampsweep train precision=bf16_pure precision.master_weights=true model=cnn "
        "trainer.epochs=2"
    )
    assert rec.reason.startswith("bf16_pure (master_weights=true) is 2.0x faster than fp32")
    assert "Runner-up: bf16_pure, 1.5x faster." in rec.reason
    assert set(rec.evidence) == {"bf16_pure (master_weights=true)", "bf16_pure"}
