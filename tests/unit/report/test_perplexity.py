"""report: a language model's sweep is compared by perplexity (and tokens/s) instead of
accuracy, picked from what the runs logged; findings state the tolerance and the unigram
baseline."""

from __future__ import annotations

import pytest

from ampsweep.report import render
from ampsweep.report.criteria import PPL_TOLERANCE
from ampsweep.report.model import RunData
from ampsweep.report.sweeps import make_report

PARAMS = {"model.name": "gpt", "dataset.name": "pysource"}


def run(mode: str, ppl: float, tokens: float, **metrics) -> RunData:
    return RunData(
        run_id=f"id-{mode}",
        name=f"{mode}-gpt-pysource",
        status="FINISHED",
        params={**PARAMS, "precision.name": mode},
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
def report():
    runs = [
        run("fp32", 12.0, 50_000),
        run("bf16", 12.1, 80_000),
        run("bf16_pure", 13.0, 90_000),
        run("fp16_noscale", 11.0, 5_000),
    ]
    return make_report({"run_id": "p", "name": "precision_sweep_lm-1"}, runs)


def test_rows_compare_perplexity_with_the_baseline(report):
    rows = {r.precision: r for r in report.rows}
    assert rows["bf16"].ppl_ratio == pytest.approx(12.1 / 12.0)
    assert rows["bf16"].tokens_per_s == 80_000 and rows["bf16"].val_acc is None
    assert report.headline_metrics()["ppl_ratio/bf16_pure"] == pytest.approx(13.0 / 12.0)


def test_the_table_shows_perplexity_and_tokens_instead_of_accuracy(report):
    headers, body = render.table_cells(report)
    assert {"val ppl", "ppl ratio", "tokens/s"} <= set(headers)
    assert "val acc" not in headers and "Δacc pt" not in headers
    bf16 = body[1]
    assert bf16[headers.index("val ppl")] == "12.100"
    assert bf16[headers.index("ppl ratio")] == "1.01x"
    assert bf16[headers.index("tokens/s")] == "80,000"


def test_findings_state_the_tolerance_and_the_unigram_baseline(report):
    text = "\n".join(report.findings)
    assert PPL_TOLERANCE == 0.05
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


def test_the_perplexity_chart_is_drawn(report, tmp_path):
    from ampsweep.report import charts

    made = {p.name for p in charts.write_charts(report, tmp_path)}
    assert "perplexity.png" in made and "accuracy.png" not in made
    assert (tmp_path / "perplexity.png").stat().st_size > 1000
