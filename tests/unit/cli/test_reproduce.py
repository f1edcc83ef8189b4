"""What ``ampsweep reproduce`` writes as the Hydra primary config of a reproduction."""

from __future__ import annotations

from omegaconf import OmegaConf

from ampsweep.cli.reproduce import primary_config

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
