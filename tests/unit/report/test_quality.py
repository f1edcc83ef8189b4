"""report/quality.py on constructed runs: the time and steps to reach the quality target, from
the evaluations each run logged; "not reached" said as such; the column, finding and chart. A
language model's sweep is compared by perplexity (and tokens/s) instead of accuracy, picked
from what the runs logged; findings state the tolerance and the unigram baseline."""

from __future__ import annotations

import pytest

from ampsweep.config.score import ACCURACY, MIOU, PERPLEXITY, Score
from ampsweep.report import charts, render, sweeps
from ampsweep.report.model import RunData
from ampsweep.report.sweeps import make_report
from unit.report.test_stats import run

START = 1_000_000  # ms: when each run started


def evaluated(mode, seed, job, evals, key="val/acc"):
    """A run that logged ``evals`` (seconds after its start, step, value) and ended there."""
    r = run(mode, seed, job, sps=1000.0, act=1.0)
    r.metrics[key] = evals[-1][2]
    r.started_ms = START
    r.timeline = {key: [(step, value, START + int(s * 1000)) for s, step, value in evals]}
    return r


def test_time_and_steps_to_the_default_target_with_not_reached_said():
    runs = [
        evaluated("fp32", 0, 0, [(10, 100, 0.90), (20, 200, 0.97), (30, 300, 0.98)]),
        evaluated("bf16", 0, 1, [(5, 100, 0.92), (9, 200, 0.976), (14, 300, 0.981)]),
        evaluated("fp16", 0, 2, [(40, 100, 0.50), (80, 200, 0.70), (120, 300, 0.80)]),
    ]
    rep = sweeps.make_report({"run_id": "p", "name": "s"}, runs)
    by = {r.precision: r for r in rep.rows}
    # target: within 0.5 points of fp32's final 0.980, so 0.975
    assert by["fp32"].target == 0.98 - 0.005
    assert (by["fp32"].target_s, by["fp32"].target_steps) == (30.0, 300)
    assert (by["bf16"].target_s, by["bf16"].target_steps) == (9.0, 200)
    assert by["fp16"].target_s is None and by["fp16"].to_target == "not reached"
    assert by["bf16"].to_target == "9.0 s"
    finding = next(f for f in rep.findings if f.startswith("Time to quality"))
    assert "val acc >= 0.975 (within 0.5 points of fp32's 0.980)" in finding
    assert "bf16 in 9.0 s (step 200, 0.30x fp32's time); fp32 in 30.0 s (step 300)" in finding
    assert "fp16 not reached in its 3 evaluation(s)" in finding
    headers, body = render.table_cells(rep, wide=False, width=render.CONSOLE_WIDTH)
    column = headers.index("to target")
    assert [row[column] for row in body] == ["30.0 s", "9.0 s", "not reached"]
    headers, body = render.table_cells(rep)  # the files: the steps too
    assert [row[headers.index("steps to target")] for row in body] == ["300", "200", "-"]


def test_a_given_target_and_a_language_model_lower_is_better(tmp_path):
    key = "val/perplexity"
    runs = [
        evaluated("fp32", 0, 0, [(10, 50, 20.0), (20, 100, 12.0)], key),
        evaluated("bf16", 0, 1, [(8, 50, 14.0), (16, 100, 11.0)], key),
    ]
    default = sweeps.make_report({"run_id": "p"}, runs)
    bf16 = next(r for r in default.rows if r.precision == "bf16")
    assert bf16.target == 12.0 * 1.02 and bf16.target_s == 16.0  # within 2% of 12.0
    given = sweeps.make_report({"run_id": "p"}, runs, target=15.0)
    by = {r.precision: r for r in given.rows}
    assert (by["bf16"].target_s, by["fp32"].target_s) == (8.0, 20.0)
    assert any("val perplexity <= 15.000 (--target)" in f for f in given.findings)
    made = charts.write_charts(given, tmp_path)
    chart = tmp_path / "time_to_quality.png"
    assert chart in made and chart.read_bytes()[:4] == b"\x89PNG"


def test_over_repeats_the_mean_of_the_runs_that_reached_it():
    runs = [
        evaluated("fp32", 0, 0, [(10, 100, 0.98)]),
        evaluated("bf16", 0, 1, [(6, 100, 0.98)]),
        evaluated("fp32", 1, 2, [(12, 100, 0.98)]),
        evaluated("bf16", 1, 3, [(8, 100, 0.90)]),  # this seed never got there
    ]
    rep = sweeps.make_report({"run_id": "p"}, runs)
    bf16 = next(r for r in rep.summary if r.precision == "bf16")
    assert (bf16.n, bf16.target_reached, bf16.target_s) == (2, 1, 6.0)
    assert bf16.to_target == "6.0 s (1/2)"
    fp32 = next(r for r in rep.summary if r.precision == "fp32")
    assert fp32.target_s == 11.0 and fp32.to_target == "11.0 s"


LM_PARAMS = {"model.name": "gpt", "dataset.name": "pysource"}


def lm_run(mode: str, ppl: float, tokens: float, **metrics) -> RunData:
    return RunData(
        run_id=f"id-{mode}",
        name=f"{mode}-gpt-pysource",
        status="FINISHED",
        params={**LM_PARAMS, "precision.name": mode},
        tags={"precision": mode, "model": "gpt", "dataset": "pysource", "device": "cpu"},
        metrics={
            "val/loss": 2.5,
            "val/perplexity": ppl,
            "data/unigram_perplexity": 29.1,
            "perf/samples_per_s": tokens / 64,
            "perf/tokens_per_s": tokens,
            "mem/activation_mib": 20.0 if mode == "fp32" else 12.0,
            "amp/skipped_steps": 0.0,
            **metrics,
        },
    )


@pytest.fixture
def lm_report():
    runs = [
        lm_run("fp32", 12.0, 50_000),
        lm_run("bf16", 12.1, 80_000),
        lm_run("bf16_pure", 13.0, 90_000),
        lm_run("fp16_noscale", 11.0, 5_000),
    ]
    return make_report({"run_id": "p", "name": "precision_sweep_lm-1"}, runs)


def test_rows_compare_perplexity_with_the_baseline(lm_report):
    rows = {r.precision: r for r in lm_report.rows}
    assert rows["bf16"].ppl_ratio == pytest.approx(12.1 / 12.0)
    assert rows["bf16"].tokens_per_s == 80_000 and rows["bf16"].val_acc is None
    assert lm_report.headline_metrics()["ppl_ratio/bf16_pure"] == pytest.approx(13.0 / 12.0)


def test_the_table_shows_perplexity_and_tokens_instead_of_accuracy(lm_report):
    headers, body = render.table_cells(lm_report)
    assert {"val ppl", "ppl ratio", "tokens/s"} <= set(headers)
    assert "val acc" not in headers and "Δacc pt" not in headers
    bf16 = body[1]
    assert bf16[headers.index("val ppl")] == "12.100"
    assert bf16[headers.index("ppl ratio")] == "1.01x"
    assert bf16[headers.index("tokens/s")] == "80,000"


def test_findings_state_the_tolerance_and_the_unigram_baseline(lm_report):
    text = "\n".join(lm_report.findings)
    assert PERPLEXITY.tolerance == 0.05
    assert (
        "fp32 reached validation perplexity 12.000; predicting each token from its frequency "
        "alone (the unigram baseline of the same text) gives 29.100: the model learnt well "
        "below it."
    ) in text
    assert "Perplexity held within 5% of fp32's 12.000: bf16 12.100." in text
    assert "Perplexity rose for bf16_pure: 13.000 (+8.3% vs fp32)." in text
    assert "Perplexity fell for fp16_noscale: 11.000 (-8.3% vs fp32; at this run length" in text
    assert "Fastest here: bf16_pure, 1.80x the fp32 throughput (90,000 tokens/s)." in text
    assert "fp16 without loss scaling (fp16_noscale) reached perplexity 11.000 (-8.3% vs" in text
    assert "nan" not in text and "accuracy (for a language model, perplexity) held" in text


def test_the_perplexity_chart_is_drawn(lm_report, tmp_path):
    from ampsweep.report import charts

    made = {p.name for p in charts.write_charts(lm_report, tmp_path)}
    assert "perplexity.png" in made and "accuracy.png" not in made
    assert (tmp_path / "perplexity.png").stat().st_size > 1000


# A score no shipped task has: a regression's RMSE, lower is better, held within 5%
RMSE = Score("val/rmse", "RMSE", higher_is_better=False, tolerance=0.05, relative=True, target=0.02)


def regression_run(mode, job, rmse_at, speed):
    """A run whose task recorded the RMSE score (its ``score.*`` tags), on a GPU, with its
    evaluations (seconds after its start, step, rmse)."""
    return RunData(
        run_id=f"run-{job}",
        name=f"{mode}-mlp-housing-{job}",
        status="FINISHED",
        params={"precision.name": mode, "model.name": "mlp", "dataset.name": "housing"},
        tags={
            "precision": mode,
            "job_num": str(job),
            "device": "cuda",
            "compute_capability": "9.0",
            **RMSE.tags(),
        },  # fmt: skip
        metrics={
            "val/rmse": rmse_at[-1][2],
            "perf/samples_per_s": speed,
            "mem/activation_mib": 10.0,
        },  # fmt: skip
        timeline={"val/rmse": [(step, v, START + int(s * 1000)) for s, step, v in rmse_at]},
        started_ms=START,
    )


def test_a_lower_is_better_score_is_judged_in_its_own_direction():
    runs = [
        regression_run("fp32", 0, [(10, 100, 0.80), (20, 200, 0.50)], 1000.0),
        regression_run("bf16", 1, [(5, 100, 0.70), (9, 200, 0.51)], 2000.0),  # held (+2%)
        regression_run("fp16", 2, [(6, 100, 0.60), (12, 200, 0.40)], 1500.0),  # better (-20%)
        # the fastest, but its RMSE is 40% higher: a loss, whatever its speed
        regression_run("bf16_pure", 3, [(4, 100, 0.90), (8, 200, 0.70)], 3000.0),
    ]
    rep = sweeps.make_report({"run_id": "p", "name": "regression"}, runs)
    text = "\n".join([rep.recommendation.text, *rep.findings])
    assert "accuracy" not in text.lower() and "perplexity" not in text.lower()
    assert "RMSE held within 5% of fp32's 0.500: bf16 0.510." in rep.findings
    assert "RMSE rose for bf16_pure: 0.700 (+40.0% vs fp32)." in rep.findings
    assert "RMSE fell for fp16: 0.400 (-20.0% vs fp32; at this run length" in text
    # bf16_pure is ruled out by its RMSE; of the modes that held it, bf16 is the fastest
    assert rep.recommendation.mode == "bf16" and rep.recommendation.runner_up == "fp16"
    assert "RMSE 0.510 vs 0.500 (1.02x)" in rep.recommendation.evidence["bf16"]
    # time to quality: the target is 2% above fp32's final RMSE, reached going down
    by = {r.precision: r for r in rep.rows}
    assert by["fp32"].target == pytest.approx(0.51)
    assert (by["bf16"].target_s, by["fp16"].target_s, by["fp32"].target_s) == (9.0, 12.0, 20.0)
    assert by["bf16_pure"].to_target == "not reached"
    finding = next(f for f in rep.findings if f.startswith("Time to quality"))
    assert "val rmse <= 0.510 (within 2% of fp32's 0.500)" in finding
    headers, body = render.table_cells(rep)
    assert [row[headers.index("val rmse")] for row in body] == ["0.5", "0.51", "0.4", "0.7"]
    assert [row[headers.index("ΔRMSE %")] for row in body] == ["+0.0", "+2.0", "-20.0", "+40.0"]


def test_a_run_recorded_before_scores_were_reads_its_score_from_its_metrics():
    older = RunData("r", "fp32", "FINISHED", metrics={"val/perplexity": 9.0, "val/acc": 0.1})
    assert older.score == PERPLEXITY
    assert RunData("r", "fp32", "FINISHED", metrics={"val/acc": 0.9}).score == ACCURACY
    assert RunData("r", "fp32", "FINISHED", metrics={"val/loss": 2.0}).score is None
    recorded = RunData("r", "fp32", "FINISHED", tags=RMSE.tags(), metrics={"val/acc": 0.9})
    assert recorded.score == RMSE  # what the run recorded, not a guess on metric names


def test_a_sentence_opens_with_the_label_and_keeps_an_acronym_as_written():
    assert (ACCURACY.title, MIOU.title) == ("Accuracy", "mIoU")
