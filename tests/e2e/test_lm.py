"""Language models end to end: the LM precision sweep (at a reduced size) with its report in
perplexity and tokens/s, a Llama-shaped Hugging Face model in fp32 and bf16, reproduce and
resume of an LM run, and DDP over sharded sequences."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli

from ampsweep.cli.reproduce import reproduce
from ampsweep.cli.train import cmd_train
from ampsweep.tracking import store as mlflow_store

# The experiment's GPT and data, shrunk: fewer bytes, shorter sequences, a few steps.
REDUCED = [
    "dataset.max_bytes=40000", "dataset.seq_len=32", "trainer.batch_size=16",
    "trainer.epochs=1", "trainer.max_steps=12", "trainer.log_every=4",
    "trainer.timing_warmup_steps=2", "diagnostics.every=4",
]  # fmt: skip
SHORT = [
    "dataset=pysource", "dataset.max_bytes=20000", "dataset.seq_len=16", "trainer.batch_size=8",
    "trainer.epochs=1", "trainer.max_steps=8", "trainer.log_every=2",
    "trainer.timing_warmup_steps=1", "trainer.progress=false", "trainer.deterministic=true",
]  # fmt: skip
TINY = [*SHORT, "model=gpt", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
        "model.block_size=16"]  # fmt: skip


def children(store: str, experiment: str = "ampsweep"):
    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get(mlflow_store.SWEEP) == "true"]
    kids = {r.info.run_name: r for r in runs if mlflow_store.PARENT in r.data.tags}
    return client, parents, kids


@pytest.mark.slow
def test_the_lm_precision_sweep_reports_perplexity_tokens_and_memory(
    store, tmp_path, monkeypatch, capsys, main
):
    monkeypatch.chdir(tmp_path)
    code = cmd_train(["-m", "experiment=precision_sweep_lm", *REDUCED, f"tracking.uri={store}"])
    out = capsys.readouterr().out
    assert code == 0
    client, (parent,), kids = children(store)
    modes = ["fp32", "fp16", "fp16_noscale", "bf16", "bf16_pure"]
    assert set(kids) == {f"{m}-gpt-pysource" for m in modes}
    assert all(k.info.status == "FINISHED" for k in kids.values())
    fp32 = kids["fp32-gpt-pysource"].data
    assert fp32.params["task.name"] == "language_modeling"
    # the task's score, recorded for the report to judge by: lower is better, 5% held
    score = {k: v for k, v in fp32.tags.items() if k.startswith("score.")}
    assert score["score.name"] == "val/perplexity" and score["score.higher_is_better"] == "False"
    assert score["score.tolerance"] == "0.05" and score["score.relative"] == "True"
    assert fp32.tags["data.python_version"] and len(fp32.tags["data.text_sha256"]) == 64
    assert fp32.metrics["val/perplexity"] < 256  # a few steps: below a uniform guess
    assert fp32.metrics["data/unigram_perplexity"] < 256
    assert {"amp/grad_underflow_frac", "perf/tokens_per_s"} <= set(fp32.metrics)
    # The printed report: perplexity and tokens/s, no accuracy.
    assert "val ppl" in out and "tokens/s" in out and "val acc" not in out
    assert "unigram baseline of the same text" in out
    rows = json.loads(main("report", "--format", "json", "--tracking-uri", store).out)["rows"]
    bf16 = next(r for r in rows if r["precision"] == "bf16")
    half = kids["bf16-gpt-pysource"].data.metrics
    assert bf16["val_ppl"] == half["val/perplexity"]
    assert bf16["ppl_ratio"] == pytest.approx(
        half["val/perplexity"] / fp32.metrics["val/perplexity"]
    )
    assert bf16["tokens_per_s"] == half["perf/tokens_per_s"]
    assert bf16["activation_ratio"] < 1.0  # half-precision activations saved for backward
    charts = {f.path for f in client.list_artifacts(parent.info.run_id, "charts")}
    assert "charts/perplexity.png" in charts
    assert "ppl_ratio/bf16" in parent.data.metrics


def test_the_experiments_gpt_learns_well_below_the_unigram_baseline():
    """The sweep's model and data (150 of its 234 steps, fp32): the validation perplexity falls
    well below that of predicting each byte from its frequency in the training text."""
    from ampsweep.config import compose
    from ampsweep.engine.build import build
    from ampsweep.engine.loop import fit

    cfg = compose.load(
        [
            "experiment=precision_sweep_lm",
            "precision=fp32",
            "trainer.epochs=10",
            "trainer.max_steps=150",
            "trainer.eval_every=100",
            "diagnostics.every=0",
            "tracking=none",
        ]  # fmt: skip
    )
    summary = fit(build(cfg), lambda m, s: None)
    ppl, unigram = summary["val/perplexity"], summary["data/unigram_perplexity"]
    print(f"\nGPT after 150 steps: val/perplexity {ppl:.2f}, unigram baseline {unigram:.2f}")
    assert ppl < 0.75 * unigram, (ppl, unigram)


@pytest.mark.slow
def test_a_llama_shaped_hf_model_trains_a_sweep_job_in_fp32_and_bf16(store, tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="pip install 'ampsweep[hf]'")
    monkeypatch.chdir(tmp_path)
    args = [*SHORT, "model=hf_causal_lm", "model.hidden_size=32", "model.num_attention_heads=2",
            "trainer.max_steps=12"]  # fmt: skip
    assert cmd_train(["-m", *args, "precision=fp32,bf16", f"tracking.uri={store}"]) == 0
    client, _, kids = children(store)
    assert set(kids) == {"fp32-hf_causal_lm-pysource", "bf16-hf_causal_lm-pysource"}
    for kid in kids.values():
        assert kid.info.status == "FINISHED"
        assert kid.data.params["model.arch"] == "llama"
        losses = [m.value for m in client.get_metric_history(kid.info.run_id, "train/loss")]
        assert losses[-1] < losses[0]  # it learns
        assert kid.data.metrics["val/perplexity"] < 256


def test_reproduce_of_an_lm_run_repeats_its_loss_history(store, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cmd_train([*TINY, "precision=bf16", f"tracking.uri={store}"]) == 0
    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name("ampsweep")
    (orig,) = client.search_runs([exp.experiment_id])
    assert reproduce(orig.info.run_id, [f"tracking.uri={store}"]) == 0
    assert "data differs" not in capsys.readouterr().err  # the same text: the same digest
    (new,) = client.search_runs([exp.experiment_id], f"tags.reproduces = '{orig.info.run_id}'")
    a, b = (
        [(m.step, m.value) for m in client.get_metric_history(r, "train/loss")]
        for r in (orig.info.run_id, new.info.run_id)
    )
    assert len(a) == 4 and sorted(a) == sorted(b)
    assert new.data.metrics["val/perplexity"] == orig.data.metrics["val/perplexity"]
    assert new.data.tags["data.text_sha256"] == orig.data.tags["data.text_sha256"]


def test_an_lm_run_resumes_exactly(tmp_path):
    from ampsweep.config import compose
    from ampsweep.engine import checkpoint, loop, run_folder
    from ampsweep.engine.build import build

    cfg = compose.load([*TINY, "tracking=none", "trainer.checkpoint_every=4",
                        "model.dropout=0.1", f"trainer.checkpoint_dir={tmp_path}"])  # fmt: skip
    whole_log: list = []
    folder = run_folder.folder_for(cfg, "r")
    whole = loop.fit(build(cfg), lambda m, s: whole_log.append((s, m)),
                     checkpoints=checkpoint.Checkpointer(folder, cfg, "r"))  # fmt: skip
    resumed = build(cfg)
    state = checkpoint.restore(resumed, checkpoint.load(folder / "step-00000004.pt"))
    rest_log: list = []
    rest = loop.fit(resumed, lambda m, s: rest_log.append((s, m)), state=state)
    assert rest["val/perplexity"] == whole["val/perplexity"]
    assert rest_log == [(s, m) for s, m in whole_log if s > 4]


@pytest.mark.slow
def test_ddp_shards_the_sequences_into_one_run(store, tmp_path):
    args = ["train", *TINY, "precision=fp32", "trainer.nproc=2", f"tracking.uri={store}"]
    proc = run_cli(args, tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = mlflow_store.client_for(store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params["world_size"] == "2"
    m = run.data.metrics
    assert m["perf/tokens_per_s"] == pytest.approx(16 * m["perf/samples_per_s"])  # summed ranks
    assert m["val/perplexity"] < 256


@pytest.mark.slow
def test_a_compiled_gpt_trains_as_the_eager_one():
    from ampsweep.config import compose
    from ampsweep.engine.build import build
    from ampsweep.engine.loop import fit

    results = []
    for compiled in ("false", "true"):
        cfg = compose.load([*TINY, "tracking=none", "precision=bf16", "trainer.max_steps=4",
                            f"trainer.compile={compiled}"])  # fmt: skip
        setup = build(cfg)
        results.append(fit(setup, lambda m, s: None))
    assert isinstance(setup.model, torch._dynamo.eval_frame.OptimizedModule)
    eager, compiled_run = results
    assert compiled_run["train/steps"] == 4
    # the same model and data: the compiled graph fuses bf16 ops differently, nothing more
    assert compiled_run["val/loss"] == pytest.approx(eager["val/loss"], rel=0.02)
