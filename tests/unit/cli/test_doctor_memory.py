"""``ampsweep doctor --memory --verify``: a model whose weights and optimizer state fill its
step's peak gets the finding that bf16 saved (almost) nothing and why, and the pure-bf16
prescription, run and judged by the step peak it measured."""

from __future__ import annotations

import re


def test_the_memory_doctor_prescribes_and_verifies_a_pure_mode(main, quick):
    args = [*quick, "model=mlp", "model.width=64", "trainer.batch_size=2", "trainer.max_steps=2"]
    out = main("doctor", "--memory", "--verify", *args)
    assert out.code == 0, out.err
    assert "fp32: step peak" in out.out
    assert re.search(r"bf16 (saved \S+ of|used \S+ more memory than)", out.out)
    assert "the weights, gradients and optimizer state are" in out.out
    assert "prescription for bf16: precision=bf16_pure" in out.out
    verdict = re.search(r"fixed: step peak ([\d.]+) MiB vs ([\d.]+) MiB of bf16", out.out)
    assert verdict, out.out
    assert float(verdict[1]) < float(verdict[2])  # bf16_pure measured a lower peak
    assert "not verified here: it runs trainer.nproc processes" in out.out  # FSDP's
