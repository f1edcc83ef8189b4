"""What ``ampsweep reproduce`` writes as the Hydra primary config of a reproduction."""

from __future__ import annotations

from omegaconf import OmegaConf

from ampsweep.cli.reproduce import primary_config, score_held

RECORDED = """
trainer: {resume: auto, callbacks: [], strategy: fsdp}
precision:
  name: bf16
  autocast: true
  scaler: {enabled: false, dynamic: false}
  fsdp: {param_dtype: bf16, reduce_dtype: fp32}
"""


def test_another_mode_resets_what_the_recorded_mode_derived(tmp_path):
    plain = primary_config("abc123", RECORDED, ["precision=fp16"], tmp_path)
    assert plain == ["precision.name=fp16"]
    cfg = OmegaConf.load(tmp_path / "config.yaml")
    assert cfg.trainer.resume is None and cfg.trainer.callbacks == []
    assert cfg.precision.scaler.enabled is None and cfg.precision.scaler.dynamic is None
    # the new mode's FSDP policy comes from the table, not the recorded bf16 gathers
    assert cfg.precision.fsdp.param_dtype is None and cfg.precision.fsdp.reduce_dtype is None


def test_the_same_mode_keeps_the_recorded_policy(tmp_path):
    primary_config("abc123", RECORDED, ["optimizer.lr=0.01"], tmp_path)
    cfg = OmegaConf.load(tmp_path / "config.yaml")
    assert cfg.precision.fsdp.param_dtype == "bf16" and cfg.precision.fsdp.reduce_dtype == "fp32"


def test_the_reproduction_s_score_is_judged_by_the_score_the_original_recorded(store_uri):
    """The comparison ends with the score's verdict, in the direction and tolerance the
    original run recorded: a perplexity 3% higher held (5%), one 8% higher rose."""
    from ampsweep.config.score import PERPLEXITY
    from ampsweep.tracking.store import client_for

    client = client_for(store_uri)
    experiment = client.create_experiment("e")

    def logged(ppl, tags):
        run = client.create_run(experiment, tags=tags)
        client.log_metric(run.info.run_id, "val/perplexity", ppl)
        return run.info.run_id

    original = logged(10.0, PERPLEXITY.tags())
    assert score_held(store_uri, original, logged(10.3, {})) == (
        "Perplexity held: 10.300 vs the original's 10.000 (+3.0%; within 5% counts as held)"
    )
    assert score_held(store_uri, original, logged(10.8, {})).startswith("Perplexity rose: 10.800")
    older = logged(10.0, {})  # recorded before runs recorded their score: read by its metric
    assert score_held(store_uri, older, logged(9.0, {})).startswith("Perplexity fell: 9.000")
