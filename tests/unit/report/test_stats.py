"""report/stats.py: intervals on known inputs (every expected one worked out by hand here from
Student's t critical values as printed in textbook tables, t_{0.975, dof}, not by calling
scipy); a report over repeated seeds (repeats grouped per configuration, paired comparisons with
their intervals, verdicts in those terms, a console table that fits, files that keep every run,
charts with error bars); a search's trials grouped by mode, each mode's best by the lowest final
val/loss (the objective the search minimised), only where a mode ran several settings."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
from rich.console import Console

from ampsweep.report import charts, render, stats, sweeps
from ampsweep.report.model import RunData
from unit.report.test_numerics import report
from unit.report.test_numerics import run as trial

# Two-sided 95% critical values of Student's t (any statistics textbook's table)
T_975 = {1: 12.706, 2: 4.303, 4: 2.776, 9: 2.262}


def test_t_quantiles_are_the_textbook_ones():
    for dof, value in T_975.items():
        assert stats.t_quantile(0.95, dof) == pytest.approx(value, abs=5e-4)


def test_mean_interval_of_one_to_five():
    # mean 3; sample sd sqrt(2.5); standard error sqrt(2.5)/sqrt(5) = sqrt(0.5)
    est = stats.mean_interval([1, 2, 3, 4, 5])
    half = 2.776 * math.sqrt(0.5)  # 1.963
    assert est.n == 5 and est.mean == pytest.approx(3.0)
    assert est.low == pytest.approx(3.0 - half, abs=1e-3)
    assert est.high == pytest.approx(3.0 + half, abs=1e-3)
    assert est.half_width == pytest.approx(half, abs=1e-3)


def test_two_values_give_the_wide_interval_of_one_degree_of_freedom():
    # [0, 2]: mean 1, sd sqrt(2), standard error 1: the interval is 1 +/- 12.706
    est = stats.mean_interval([0.0, 2.0])
    assert est.low == pytest.approx(1 - 12.706, abs=1e-3)
    assert est.high == pytest.approx(1 + 12.706, abs=1e-3)


def test_a_single_run_has_a_mean_and_no_interval():
    est = stats.mean_interval([0.986])
    assert est.mean == 0.986 and est.n == 1
    assert not est.has_interval and est.half_width is None
    assert stats.compare(est, 0.0) is None
    assert stats.mean_interval([]) is None
    assert stats.mean_interval([float("nan")]) is None  # a missing metric is not a value


def test_identical_values_give_a_zero_width_interval():
    est = stats.mean_interval([0.52, 0.52, 0.52])
    assert est.low == pytest.approx(0.52) and est.high == pytest.approx(0.52)


def test_paired_difference_uses_the_differences_of_each_seed():
    # Accuracy of a mode and of fp32 on seeds 0, 1, 2: differences 0.01, 0.00, 0.02,
    # mean 0.01, sd 0.01, standard error 0.01/sqrt(3); t(2) = 4.303
    mode = [0.98, 0.97, 0.99]
    fp32 = [0.97, 0.97, 0.97]
    est = stats.paired_difference(mode, fp32)
    half = 4.303 * 0.01 / math.sqrt(3)  # 0.02484
    assert est.mean == pytest.approx(0.01)
    assert est.half_width == pytest.approx(half, abs=1e-4)
    # Unpaired, the same numbers would carry fp32's spread too; paired, a shift common to both
    # runs of a seed cancels: here the mode beats fp32 by exactly 0.01 on every seed.
    shifted = stats.paired_difference([0.91, 0.96, 0.99], [0.90, 0.95, 0.98])
    assert shifted.mean == pytest.approx(0.01)
    assert shifted.half_width == pytest.approx(0.0, abs=1e-12)
    assert stats.compare(shifted, 0.0) == "higher"
    with pytest.raises(ValueError):
        stats.paired_difference([1.0], [1.0, 2.0])


def test_ratio_interval_is_a_geometric_mean_with_a_log_scale_interval():
    # ratios 2, 4, 8: logs ln2 * (1, 2, 3), mean ln 4 (geometric mean 4), sd ln 2,
    # standard error ln2/sqrt(3); t(2) = 4.303
    est = stats.ratio_interval([2.0, 4.0, 8.0])
    spread = 4.303 * math.log(2) / math.sqrt(3)  # 1.722
    assert est.mean == pytest.approx(4.0)
    assert est.low == pytest.approx(4.0 * math.exp(-spread), rel=1e-3)  # 0.715
    assert est.high == pytest.approx(4.0 * math.exp(spread), rel=1e-3)  # 22.39
    # x times faster and x times slower are symmetric: the interval of 1/ratio is 1/interval
    inverse = stats.ratio_interval([1 / 2, 1 / 4, 1 / 8])
    assert inverse.low == pytest.approx(1 / est.high) and inverse.high == pytest.approx(1 / est.low)


def test_paired_ratio_of_throughputs():
    # samples/s of fp16 and fp32 on three seeds: ratios 0.16, 0.16, 0.16
    est = stats.paired_ratio([160.0, 176.0, 144.0], [1000.0, 1100.0, 900.0])
    assert est.mean == pytest.approx(0.16)
    assert est.low == pytest.approx(0.16) and est.high == pytest.approx(0.16)
    assert stats.compare(est, 1.0) == "lower"


def test_compare_says_where_the_interval_lies():
    lower = stats.Estimate(-0.05, -0.08, -0.02, 5)
    higher = stats.Estimate(0.05, 0.02, 0.08, 5)
    across = stats.Estimate(-0.001, -0.004, 0.002, 5)
    assert stats.compare(lower, 0.0) == "lower"
    assert stats.compare(higher, 0.0) == "higher"
    assert stats.compare(across, 0.0) == "indistinguishable"
    assert stats.compare(stats.Estimate(1.02, 0.97, 1.07, 3), 1.0) == "indistinguishable"
    assert stats.compare(stats.Estimate(0.16, 0.15, 0.17, 3), 1.0) == "lower"


def test_ten_runs_shrink_the_interval_as_t_and_root_n_say():
    values = [0.980, 0.984, 0.986, 0.982, 0.988, 0.985, 0.983, 0.987, 0.981, 0.984]
    mean = sum(values) / 10
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 9)
    est = stats.mean_interval(values)
    assert est.half_width == pytest.approx(2.262 * sd / math.sqrt(10), rel=1e-3)


def test_fewer_than_three_runs_are_too_wide_for_a_tie_but_not_for_a_clear_verdict():
    assert stats.compare(stats.Estimate(1.48, 0.25, 8.69, 2), 1.0) == "too wide"
    assert stats.compare(stats.Estimate(0.04, 0.039, 0.041, 2), 1.0) == "lower"


def test_repeats_needed_is_where_the_t_interval_narrows_to_the_target():
    # a mean of 10 with sd 1 over 2 runs: half-width 12.706 / sqrt(2) = 8.98; to reach 0.5
    # needs t(n-1) / sqrt(n) <= 0.5: n=18 gives 2.110 / 4.243 = 0.497, n=17 2.120 / 4.123 = 0.514
    est = stats.mean_interval([10 - 0.5**0.5, 10 + 0.5**0.5])
    assert stats.repeats_needed(est, 0.5) == 18
    # a ratio: its half-width on the log scale against ln(1 + target)
    ratio = stats.ratio_interval([1.0, 1.02, 0.98])
    assert stats.repeats_needed(ratio, 0.10, ratio=True) <= 3
    huge = stats.mean_interval([0.0, 100.0])
    assert stats.repeats_needed(huge, 0.5) == stats.MAX_REPEATS + 1
    assert stats.repeats_needed(stats.mean_interval([1.0]), 0.5) is None


def test_an_interval_is_cut_at_the_range_its_quantity_cannot_leave():
    est = stats.mean_interval([0.98, 1.0, 0.5], bounds=(0.0, 1.0))
    free = stats.mean_interval([0.98, 1.0, 0.5])
    assert free.high > 1.0 and free.low < 1.0  # the t interval alone passes 1
    assert (est.mean, est.low, est.high) == (free.mean, max(0.0, free.low), 1.0)


CPU = {"device": "cpu", "device_name": "x86_64", "cpu_threads": "2", "torch_version": "2.14.1"}
CUDA = {"device": "cuda", "device_name": "NVIDIA H200", "compute_capability": "9.0"}
T2 = 4.303  # Student's t, 2 degrees of freedom, two-sided 95% (textbook table)


def run(mode, seed, job, *, device=CPU, lr="0.001", tags=None, **metrics):
    names = {"acc": "val/acc", "sps": "perf/samples_per_s", "act": "mem/activation_mib"}
    names |= {"peak": "mem/peak_allocated_mib", "mfu": "perf/mfu", "scale": "amp/loss_scale"}
    names |= {"bps": "mem/activation_bytes_per_sample", "model": "mem/model_mib"}
    names |= {"budget": "mem/budget_gib", "skipped": "amp/skipped_steps"}
    return RunData(
        run_id=f"run-{job}",
        name=f"{mode}-cnn-digits-{job}",
        status="FINISHED",
        params={
            "precision.name": mode,
            "model.name": "cnn",
            "trainer.seed": str(seed),
            "optimizer.lr": lr,
        },  # fmt: skip
        tags={
            "precision": mode,
            "model": "cnn",
            "dataset": "digits",
            "job_num": str(job),
            **device,
            **(tags or {}),
        },  # fmt: skip
        metrics={names[k]: v for k, v in metrics.items()},
    )


# Three seeds of fp32 and bf16 (jobs ordered as Hydra's basic sweeper runs them).
FP32_ACC, BF16_ACC = [0.980, 0.986, 0.983], [0.981, 0.984, 0.985]
FP32_SPS, BF16_SPS = [1000.0, 1100.0, 900.0], [160.0, 187.0, 135.0]


def three_seeds(device=CPU, **extra) -> list[RunData]:
    runs = []
    for i, seed in enumerate(range(3)):
        runs.append(
            run(
                "fp32",
                seed,
                i,
                device=device,
                acc=FP32_ACC[i],
                sps=FP32_SPS[i],
                act=1.66,
                bps=27184.0,
                model=0.3,
                **extra,
            )  # fmt: skip
        )
    for i, seed in enumerate(range(3)):
        runs.append(
            run(
                "bf16",
                seed,
                3 + i,
                device=device,
                acc=BF16_ACC[i],
                sps=BF16_SPS[i],
                act=0.87,
                bps=13616.0,
                model=0.34,
                **extra,
            )  # fmt: skip
        )
    return runs


def test_repeats_become_one_row_per_mode_with_paired_intervals():
    rep = sweeps.make_report({"run_id": "p", "name": "s"}, three_seeds())
    assert rep.repeated and len(rep.rows) == 6  # every run keeps its row
    fp32, bf16 = rep.summary
    assert (fp32.precision, fp32.n, bf16.n) == ("fp32", 3, 3)
    assert fp32.name == "fp32-cnn-digits" and bf16.baseline == "fp32-cnn-digits"
    assert bf16.members == ["run-3", "run-4", "run-5"] and bf16.seed == "0,1,2"
    # accuracy: mean 0.98333, paired differences +0.001, -0.002, +0.002 (mean 0.000333)
    assert bf16.val_acc == pytest.approx(sum(BF16_ACC) / 3)
    diffs = [b - f for b, f in zip(BF16_ACC, FP32_ACC, strict=True)]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert bf16.acc_delta == pytest.approx(mean)
    assert bf16.ci["acc_delta"].half_width == pytest.approx(T2 * sd / math.sqrt(3), rel=1e-3)
    # speed: the same seed's ratios 0.16, 0.17, 0.15; geometric mean and log-scale interval
    logs = [math.log(b / f) for b, f in zip(BF16_SPS, FP32_SPS, strict=True)]
    mlog = sum(logs) / 3
    slog = math.sqrt(sum((x - mlog) ** 2 for x in logs) / 2)
    assert bf16.speedup == pytest.approx(math.exp(mlog))
    assert bf16.ci["speedup"].low == pytest.approx(math.exp(mlog - T2 * slog / 3**0.5), rel=1e-3)
    assert bf16.ci["speedup"].high == pytest.approx(math.exp(mlog + T2 * slog / 3**0.5), rel=1e-3)
    # activation memory is the same in every seed: a zero-width interval
    assert bf16.activation_ratio == pytest.approx(0.87 / 1.66)
    assert bf16.ci["activation_ratio"].half_width == pytest.approx(0.0, abs=1e-12)
    head = rep.headline_metrics()
    assert head["speedup/bf16"] == pytest.approx(bf16.speedup)
    assert head["speedup_low/bf16"] == pytest.approx(bf16.ci["speedup"].low)


def test_every_verdict_carries_its_interval():
    rep = sweeps.make_report({"run_id": "p"}, three_seeds())
    text = "\n".join(rep.findings)
    low, high = rep.summary[1].ci["speedup"].low, rep.summary[1].ci["speedup"].high
    speedup = rep.summary[1].speedup  # 0.16x: 6.3 times slower
    assert (
        f"bf16 is {1 / speedup:.1f}x slower than fp32 on this CPU ({speedup:.2f}x "
        f"({low:.2f}-{high:.2f}x), n=3)" in text
    )
    assert "bf16's accuracy is indistinguishable from fp32's (+0.0 +/- 0.5 points, n=3)" in text
    assert "fp32 reached 0.983 +/- 0.007 (n=3)" in text
    assert "Most activation memory saved: bf16, 0.87 MiB per step vs 1.66 MiB for fp32 " in text
    assert "(0.52x in all 3 runs; 48% less)" in text
    assert "single run" not in text


def test_a_clear_accuracy_loss_is_called_lower():
    runs = three_seeds()
    for r, acc in zip(runs[3:], (0.900, 0.905, 0.897), strict=True):
        r.metrics["val/acc"] = acc
    text = "\n".join(sweeps.make_report({"run_id": "p"}, runs).findings)
    # differences -0.080, -0.081, -0.086: mean -0.0823, sd 0.00321, 4.303 * sd / sqrt(3) = 0.0080
    assert "bf16's accuracy is lower than fp32's (-8.2 +/- 0.8 points, n=3)" in text


def test_one_run_per_mode_says_the_verdict_rests_on_a_single_run():
    runs = [r for r in three_seeds() if r.params["trainer.seed"] == "0"]
    rep = sweeps.make_report({"run_id": "p"}, runs)
    assert not rep.repeated and rep.summary == rep.rows
    assert any("rests on a single run per mode" in f and "sweep.repeats=3" in f
               for f in rep.findings)  # fmt: skip


def test_seeds_and_other_settings_group_separately():
    runs = three_seeds() + [
        run("fp32", s, 6 + s, lr="0.01", acc=0.97, sps=1000.0, act=1.66) for s in range(2)
    ]
    runs += [run("bf16", s, 8 + s, lr="0.01", acc=0.96, sps=990.0, act=0.87) for s in range(2)]
    rep = sweeps.make_report({"run_id": "p"}, runs)
    assert [(r.precision, r.varies, r.n) for r in rep.summary] == [
        ("fp32", "lr=0.001", 3), ("bf16", "lr=0.001", 3), ("fp32", "lr=0.01", 2),
        ("bf16", "lr=0.01", 2),
    ]  # fmt: skip
    assert {r.varies for r in rep.rows} >= {"lr=0.001 seed=0", "lr=0.01 seed=1"}
    assert rep.summary[3].acc_delta == pytest.approx(-0.01)


def test_a_pure_mode_with_and_without_master_weights_group_apart():
    runs = three_seeds()
    for i in range(4):  # two seeds without master weights (jobs 6, 7), two with (8, 9)
        runs.append(run("bf16_pure", i % 2, 6 + i, acc=0.9 + i / 100, sps=900.0, act=0.87))
    for r in runs:
        r.params["precision.master_weights"] = "True" if r.run_id in ("run-8", "run-9") else "False"
    rep = sweeps.make_report({"run_id": "p"}, runs)
    # Only the row that set it says so; fp32 and bf16 could not set it and say nothing
    assert [(r.precision, r.config, r.n) for r in rep.summary] == [
        ("fp32", "", 3), ("bf16", "", 3), ("bf16_pure", "", 2),
        ("bf16_pure", "master_weights=true", 2),
    ]  # fmt: skip
    # One configuration, one fp32 baseline: the findings are not parted by the setting
    assert not any("(cnn on digits, master" in f for f in rep.findings), rep.findings
    assert any("bf16_pure (master_weights=true)'s accuracy is lower" in f for f in rep.findings)
    assert {r.configuration for r in rep.summary} == {rep.summary[0].configuration}
    assert rep.summary[3].baseline == rep.summary[2].baseline == "fp32-cnn-digits"


def test_a_precision_setting_shows_where_it_is_set():
    runs = three_seeds()
    for r in runs:  # the doctor's numerics sweep: bf16 again with one module kept in fp32
        r.params["precision.keep_fp32"] = "[fc2]" if r.run_id == "run-5" else "[]"
    rows = sweeps.make_report({"run_id": "p"}, runs).rows
    shown = {(r.precision, r.seed): r.config for r in rows}
    assert shown[("bf16", "2")] == "keep_fp32=[fc2] seed=2"
    assert shown[("bf16", "1")] == shown[("fp32", "1")] == "seed=1"  # [] is the default


def test_a_failed_run_keeps_its_row_and_its_seed_is_left_out_of_the_pairs():
    runs = three_seeds()
    runs[0].status = "FAILED"  # fp32 of seed 0: bf16 seed 0 has no baseline
    runs[0].tags["error"] = "boom"
    rep = sweeps.make_report({"run_id": "p"}, runs)
    assert [r.status for r in rep.summary] == ["FAILED", "FINISHED", "FINISHED"]
    bf16 = rep.summary[2]
    assert bf16.n == 3 and bf16.ci["speedup"].n == 2  # two seeds with a baseline
    assert any("ended FAILED: boom" in f for f in rep.findings)


def test_the_console_table_fits_100_columns_with_intervals_on_a_gpu():
    modes = ["fp32", "tf32", "fp16", "fp16_static", "fp16_noscale", "bf16", "fp16_pure",
             "bf16_pure", "fp8_tensorwise", "fp8_rowwise"]  # fmt: skip
    runs, job = [], 0
    for m in modes:
        for seed in range(3):
            extra = {"scale": 32768.0 + job, "skipped": 3.0 + seed} if "fp16" in m else {}
            runs.append(
                run(
                    m,
                    seed,
                    job,
                    device=CUDA,
                    acc=0.9876 - 0.001 * seed,
                    sps=12345.0 + 97 * job,
                    act=1234.5 + seed,
                    peak=45678.0 + job,
                    mfu=0.41 + 0.01 * seed,
                    bps=1234567.0 + seed,
                    model=1234.0,
                    budget=139.8,
                    **extra,
                )  # fmt: skip
            )
            job += 1
    rep = sweeps.make_report({"run_id": "0" * 32, "name": "precision_sweep_gpu-x"}, runs)
    console = Console(width=100, record=True, soft_wrap=True)
    render.print_table(rep, console)
    lines = console.export_text().split("Findings")[0].splitlines()
    table = lines[next(i for i, ln in enumerate(lines) if ln.startswith("Sweep ")) + 1 :]
    assert max(len(line.rstrip()) for line in table) <= 100
    assert "…" not in "\n".join(table)  # nothing cut off
    header = table[1]
    for needed in ("mode", "val acc", "Δacc pt", "speed-up", "act mem"):
        assert needed in header
    assert "±" in "\n".join(table)
    rows = [line for line in table if line.strip().startswith(tuple(modes))]
    assert len(rows) == len(modes)  # one row per mode, not one per seed
    # --wide and the files keep every run and every column
    headers, body = render.table_cells(rep, rows=rep.rows)
    assert len(body) == 30 and "seed=2" in {c for row in body for c in row}


def test_files_carry_every_run_and_the_summary():
    rep = sweeps.make_report({"run_id": "p", "command": "ampsweep train -m"}, three_seeds())
    md = render.to_markdown(rep)
    assert "## Every run" in md and md.count("| fp32 | seed=") == 3
    assert "| bf16 | cnn | digits | FINISHED | 3 | 0.983 ±0.005 |" in md
    rows = list(csv.DictReader(io.StringIO(render.to_csv(rep))))
    assert len(rows) == 6 and rows[4]["seed"] == "1"
    obj = json.loads(render.to_json(rep))
    assert len(obj["rows"]) == 6 and len(obj["summary"]) == 2
    assert obj["summary"][1]["ci"]["speedup"]["n"] == 3


def test_charts_draw_error_bars_from_the_intervals(tmp_path):
    rep = sweeps.make_report({"run_id": "p"}, three_seeds())
    below, above = charts._errors(rep.summary, "val_acc")
    est = rep.summary[0].ci["val_acc"]
    assert below[0] == pytest.approx(est.mean - est.low)
    assert above[0] == pytest.approx(est.high - est.mean)
    assert charts._errors(rep.rows, "val_acc") is None  # single runs: no bars
    made = charts.write_charts(rep, tmp_path)
    assert {p.name for p in made} >= {"throughput.png", "accuracy.png", "memory.png"}


def test_max_batch_for_a_budget_and_its_finding():
    runs = [r for r in three_seeds() if r.params["trainer.seed"] == "0"]
    budget = 80 * 1024**3
    rep = sweeps.make_report({"run_id": "p"}, runs, budget=budget)
    fp32, bf16 = rep.rows
    # (80 GiB - model) / bytes per sample, by hand
    assert fp32.max_batch == math.floor((budget - 0.3 * 1024**2) / 27184)
    assert bf16.max_batch == math.floor((budget - 0.34 * 1024**2) / 13616)
    assert bf16.max_batch_ratio == pytest.approx(bf16.max_batch / fp32.max_batch)
    text = "\n".join(rep.findings)
    assert f"bf16 fits {bf16.max_batch_ratio:.2f}x the batch of fp32 on an 80 GiB GPU" in text
    headers, _ = render.table_cells(rep, wide=False)
    assert "max batch" in headers
    # no budget on a CPU: no column, no finding
    plain = sweeps.make_report({"run_id": "p"}, runs)
    assert plain.rows[0].max_batch is None and "fits" not in "\n".join(plain.findings)


def test_a_cuda_run_predicts_for_its_gpu_memory():
    runs = [r for r in three_seeds(CUDA) if r.params["trainer.seed"] == "0"]
    for r in runs:
        r.metrics["mem/budget_gib"] = 139.8
        r.metrics["mem/max_batch_predicted"] = 1000.0 if r.precision == "fp32" else 1900.0
    rep = sweeps.make_report({"run_id": "p"}, runs)
    assert rep.rows[1].max_batch_ratio == pytest.approx(1.9)
    assert "bf16 fits 1.90x the batch of fp32 on this 140 GiB GPU" in "\n".join(rep.findings)


def test_an_emulated_fp8_run_is_said_to_have_a_meaningless_speed():
    runs = [r for r in three_seeds() if r.params["trainer.seed"] == "0"]
    fp8 = run("fp8_rowwise", 0, 9, acc=0.982, sps=40.0, act=0.8,
              tags={"fp8.emulated": "true"})  # fmt: skip
    fp8.metrics["fp8/flop_share"] = 0.62
    rep = sweeps.make_report({"run_id": "p"}, [*runs, fp8])
    text = "\n".join(rep.findings)
    assert "fp8_rowwise-cnn-digits-9 ran in torchao's fp8 emulation" in text
    assert "its speed means nothing" in text and "carry 62% of the FLOPs" in text
    assert "fp8_rowwise 0.04x" not in text  # not among the speed verdicts
    assert rep.rows[2].emulated
    alone = sweeps.make_report({"run_id": "p"}, [runs[0], fp8])  # fp32 and the emulated run
    assert not any(f.startswith("Fastest") for f in alone.findings)


def two_seeds_on_a_shared_machine() -> list[RunData]:
    """Two seeds, timed on a machine other processes competed for: fp32 ran at 353 samples/s
    with seed 0 and 1,555 with seed 1; fp16 autocast 25 times slower than fp32 in both."""
    runs = [
        run("fp32", 0, 0, acc=0.117, sps=353.0, act=1.0),
        run("fp32", 1, 1, acc=0.118, sps=1555.0, act=1.0),
        run("bf16", 0, 2, acc=0.120, sps=600.0, act=0.5),
        run("bf16", 1, 3, acc=0.110, sps=2000.0, act=0.5),
        run("fp16", 0, 4, acc=0.120, sps=353.0 / 25, act=0.5),
        run("fp16", 1, 5, acc=0.110, sps=1555.0 / 25, act=0.5),
    ]
    return runs


def test_two_seeds_give_ranges_and_say_the_interval_is_too_wide_to_judge():
    rep = sweeps.make_report({"run_id": "p"}, two_seeds_on_a_shared_machine())
    text = "\n".join(rep.findings)
    bf16 = rep.summary[1].ci["speedup"]
    # log ratios ln(600/353) and ln(2000/1555): t(1) = 12.706 spreads them over 0.25-8.7x
    assert (bf16.low, bf16.high) == (pytest.approx(0.252, rel=1e-2), pytest.approx(8.69, rel=1e-2))
    assert (
        "bf16 ran 1.5x faster than fp32 on this CPU in the mean (1.48x (0.25-8.69x), n=2)" in text
    )
    # the runs needed at that spread: t(n-1) * sd / sqrt(n) <= ln(1.1), worked out here
    from scipy import stats as st

    logs = [math.log(600 / 353), math.log(2000 / 1555)]
    sd = abs(logs[0] - logs[1]) / math.sqrt(2)
    needed = next(n for n in range(2, 101) if st.t.ppf(0.975, n - 1) * sd / n**0.5 <= math.log(1.1))
    assert f"too wide to judge: at this spread about {needed} runs per mode" in text
    assert "indistinguishable" not in text
    # the same 25x slowdown in both seeds is a verdict even at n=2, and called what it is
    assert "fp16 is 25x slower than fp32 on this CPU (0.04x in both runs)" in text
    # accuracy: +0.3 and -0.8 points, +/- 7.0 at t(1): too wide next to the 1.5-point tolerance
    assert "bf16's accuracy against fp32's is -0.3 +/- 7.0 points, n=2, but with 2 runs" in text


def test_two_seeds_print_ranges_in_the_table_and_no_error_bar_goes_below_zero(tmp_path):
    rep = sweeps.make_report({"run_id": "p"}, two_seeds_on_a_shared_machine())
    headers, body = render.table_cells(rep)
    cells = dict(zip(headers, body[1], strict=True))  # bf16
    assert cells["speed-up"] == "1.48x (0.25-8.69x)"
    assert "±" not in cells["speed-up"]
    # fp32's throughput: mean 954, sd 850, half-width 12.706 * 850 / sqrt(2) = 7,636: a
    # "954 ±7,636" would reach -6,682; the range starts at 0
    half = 12.706 * abs(1555.0 - 353.0) / math.sqrt(2) / math.sqrt(2)
    fp32 = dict(zip(headers, body[0], strict=True))
    assert fp32["samples/s"] == f"954 (0-{954 + half:,.0f})"
    below, above = charts._errors(rep.summary, "samples_per_s")
    assert below[0] == pytest.approx(954.0)  # down to zero, not to -6,680
    assert above[0] == pytest.approx(rep.summary[0].ci["samples_per_s"].high - 954.0)
    assert all(value - b >= 0 for value, b in zip([r.samples_per_s for r in rep.summary], below,
                                                  strict=True))  # fmt: skip


def test_an_accuracys_interval_never_passes_1_nor_a_speed_below_0():
    accs, sps = [0.99, 1.0, 0.2], [10.0, 900.0, 20.0]
    runs = [run("fp32", s, s, acc=a, sps=v) for s, a, v in zip(range(3), accs, sps, strict=True)]
    (fp32,) = sweeps.make_report({"run_id": "p", "name": "s"}, runs).summary
    assert fp32.ci["val_acc"].high == 1.0 and fp32.ci["val_acc"].low > -1e-12
    assert fp32.ci["samples_per_s"].low == 0.0


def test_each_mode_names_its_best_trial():
    runs = [
        trial("fp32", lr="0.01", job=0, val__loss=2.1, val__acc=0.3),
        trial("bf16", lr="0.01", job=1, val__loss=1.9, val__acc=0.4),
        trial("fp32", lr="0.001", job=2, val__loss=1.7, val__acc=0.5),
        trial("bf16", lr="0.001", job=3, val__loss=2.3, val__acc=0.2, status="FAILED"),
    ]
    rep = report(runs)
    best = {m.precision: (m.best.run_id, m.trials, m.loss) for m in stats.best_by_mode(rep)}
    assert best == {"fp32": ("fp32-0-0.001", 2, 1.7), "bf16": ("bf16-0-0.01", 1, 1.9)}
    (fp32_line,) = [ln for ln in stats.lines(rep) if ln.startswith("fp32:")]
    assert fp32_line == (
        "fp32: best of 2 trial(s) is fp32-cnn-digits-2 (fp32-0-0.001): val/loss 1.7 with lr=0.001"
    )
    assert "## Best of each mode" in render.to_markdown(rep)


def test_a_grid_of_one_setting_per_mode_or_its_repeats_is_no_search():
    runs = [trial(m, seed=s, job=2 * s + i, val__loss=2.0) for s in (0, 1)
            for i, m in enumerate(("fp32", "bf16"))]  # fmt: skip
    rep = report(runs)
    assert stats.best_by_mode(rep) == [] and stats.lines(rep) == []
    assert "## Best of each mode" not in render.to_markdown(rep)
