"""report/recommend.py on constructed runs: a clear win on a GPU, a tie within the intervals,
a baseline at chance, a CPU-only sweep, and a faster mode whose numerics went wrong."""

from __future__ import annotations

from test_report_groups import CPU, CUDA, run

from ampsweep.report import render, sweeps

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
