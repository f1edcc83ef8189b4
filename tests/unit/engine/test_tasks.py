"""engine/tasks: the task decides how the loss sees a batch and what an evaluation reports; the
loop, FLOPs counting and the underflow diagnostics all use the run's one objective."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ampsweep.config import compose
from ampsweep.config.schema import ConfigError
from ampsweep.config.score import ACCURACY, PERPLEXITY, from_tags
from ampsweep.engine import loop
from ampsweep.engine.build import build
from ampsweep.engine.data.batches import Batches
from ampsweep.engine.tasks import Classification, LanguageModeling, Objective, build_objective
from ampsweep.measure import cost
from ampsweep.measure.diagnostics import Diagnostics, reference_grads
from ampsweep.precision.policy import build_policy

CPU = torch.device("cpu")


def test_language_modeling_loss_is_cross_entropy_over_every_position_in_fp32():
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    y = torch.randint(0, 7, (2, 5))
    objective = Objective(LanguageModeling(), F.cross_entropy)
    loss = objective(logits, y)
    assert loss.dtype == torch.float32
    assert loss == F.cross_entropy(logits.float().view(10, 7), y.view(10))


def test_perplexity_is_exp_of_the_mean_token_nll_whatever_loss_trains():
    task = LanguageModeling()
    logits, y = torch.randn(3, 4, 6), torch.randint(0, 6, (3, 4))
    smoothed = lambda a, b: F.cross_entropy(a, b, label_smoothing=0.3)  # noqa: E731
    sums = task.eval_sums(smoothed, logits[:2], y[:2]) + task.eval_sums(smoothed, logits[2:], y[2:])
    val_loss, perplexity = task.finish(sums.tolist())
    nll = F.cross_entropy(logits.reshape(12, 6), y.reshape(12))
    assert perplexity == pytest.approx(math.exp(nll.item()), rel=1e-6)
    assert val_loss == pytest.approx(smoothed(logits.reshape(12, 6), y.reshape(12)).item(), 1e-6)
    assert task.metrics((val_loss, perplexity)) == {
        "val/loss": val_loss,
        "val/perplexity": perplexity,
    }
    assert task.throughput(100.0, y) == {"perf/tokens_per_s": 400.0}


def test_evaluate_on_token_batches():
    logits = torch.randn(6, 4, 5)
    y = torch.randint(0, 5, (6, 4))
    batches = Batches((logits, y), 4, CPU, torch.float32, shuffle=False, drop_last=False, seed=0,
                      preload=True)  # fmt: skip
    policy = build_policy(compose.load(["precision=fp32"]).precision, CPU)
    objective = Objective(LanguageModeling(), F.cross_entropy)
    loss, perplexity = loop.evaluate(torch.nn.Identity(), batches, policy, objective)
    expected = F.cross_entropy(logits.view(24, 5), y.view(24)).item()
    assert loss == pytest.approx(expected, rel=1e-6)
    assert perplexity == pytest.approx(math.exp(expected), rel=1e-6)


@pytest.mark.parametrize(
    "task,logits,y,message",
    [
        (Classification(), (4, 3), (4, 5), "gives targets of shape (5,) per sample, not one"),
        (Classification(), (4, 2), (4,), "m outputs 2 classes but the labels of d go up to 2"),
        (LanguageModeling(), (4, 5, 9), (4,), "not a token sequence"),
        (LanguageModeling(), (4, 9), (4, 5), "m outputs (4, 9) for token sequences of shape"),
        (LanguageModeling(), (4, 5, 2), (4, 5), "m outputs a vocabulary of 2 but the tokens"),
    ],
)
def test_outputs_and_targets_the_task_cannot_use_are_refused(task, logits, y, message):
    with pytest.raises(ConfigError) as err:
        task.check(torch.zeros(logits), torch.zeros(y, dtype=torch.long), 3, "m", "d")
    assert message in str(err.value)


def lm_setup(*extra: str):
    return build(
        compose.load(
            [
                "model=gpt",
                "dataset=pysource",
                "dataset.max_bytes=8000",
                "dataset.seq_len=16",
                "model.n_layer=1",
                "model.n_embd=16",
                "model.n_head=2",
                "model.block_size=16",
                "trainer.batch_size=8",
                "tracking=none",
                *extra,
            ]  # fmt: skip
        )
    )


def test_flops_count_the_runs_own_loss():
    s = lm_setup()
    x, y = next(iter(s.train_batches.epoch(0)))
    seen = []

    def counted(logits, targets):
        seen.append(logits.shape)
        return s.objective(logits, targets)

    assert cost.train_step_flops(s.model, x, y, s.policy, loss=counted) > 0
    assert seen == [(8, 16, 256)]  # the objective saw the model's sequence logits


def test_underflow_diagnostics_measure_the_gradient_of_the_runs_loss():
    s = lm_setup()
    x, y = next(iter(s.train_batches.epoch(0)))
    named = [(n, p) for n, p in s.model.named_parameters()]
    ref = reference_grads(s.model, named, x, y, 1.0, s.objective)
    s.model.zero_grad()
    s.objective(s.model(x), y).backward()
    for (_, p), g in zip(named, ref, strict=True):
        assert torch.allclose(p.grad, g, atol=1e-6)
    metrics = Diagnostics().measure(s.model, s.scaler, x, y, s.objective)
    assert metrics["amp/grad_flushed_frac"] == 0.0  # fp32: nothing lost


def test_a_language_model_run_logs_perplexity_and_tokens_per_second():
    s = lm_setup("trainer.max_steps=4", "trainer.log_every=2", "trainer.timing_warmup_steps=1",
                 "precision=bf16")  # fmt: skip
    logged = []
    summary = loop.fit(s, lambda m, step: logged.append(m))
    assert {"val/loss", "val/perplexity"} <= set(logged[-1]) and "val/acc" not in summary
    assert summary["perf/tokens_per_s"] == pytest.approx(16 * summary["perf/samples_per_s"])
    assert summary["val/perplexity"] == pytest.approx(math.exp(summary["val/loss"]), rel=1e-6)
    assert summary["data/unigram_perplexity"] > 1 and summary["perf/gflops_per_step"] > 0


def test_the_task_owns_its_score_and_task_tolerance_sets_how_near_counts_as_held():
    def score(*overrides):
        return build_objective(compose.load(list(overrides)), CPU).task.score

    assert score() == ACCURACY and ACCURACY.tolerance == 0.015  # 1.5 points
    tight = score("task.tolerance=0.005")
    assert tight.name == "val/acc" and tight.higher_is_better and tight.tolerance == 0.005
    assert tight.held(0.980, 0.984) and not tight.held(0.978, 0.984)
    assert from_tags(tight.tags()) == tight  # what the run records, the report reads back
    lm = score("task=language_modeling", "task.tolerance=0.1")
    assert lm == replace(PERPLEXITY, tolerance=0.1)
    assert lm.held(10.9, 10.0) and lm.held(5.0, 10.0) and not lm.held(11.2, 10.0)  # lower wins
    assert LanguageModeling().metrics((2.0, 7.4)) == {"val/loss": 2.0, "val/perplexity": 7.4}
    with pytest.raises(ConfigError, match=r"task.tolerance=-1 \(task=classification\)"):
        score("task.tolerance=-1")
