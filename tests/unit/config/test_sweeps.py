"""config/sweeps.py: the jobs of a sweep on a command line, for the commands that examine each
one without running a Hydra sweep (capacity, doctor)."""

from __future__ import annotations

import pytest

from ampsweep.config.schema import ConfigError
from ampsweep.config.sweeps import expand_sweep


def test_expand_sweep_is_the_cartesian_product():
    jobs = expand_sweep(["precision=fp32,fp16", "model=mlp,cnn", "trainer.epochs=1"])
    assert jobs == [
        ["precision=fp32", "model=mlp", "trainer.epochs=1"],
        ["precision=fp32", "model=cnn", "trainer.epochs=1"],
        ["precision=fp16", "model=mlp", "trainer.epochs=1"],
        ["precision=fp16", "model=cnn", "trainer.epochs=1"],
    ]


def test_expand_sweep_ranges_and_choices():
    assert expand_sweep(["trainer.seed=range(0,3)"]) == [
        ["trainer.seed=0"],
        ["trainer.seed=1"],
        ["trainer.seed=2"],
    ]
    assert expand_sweep(["precision=choice(fp32,bf16)"]) == [
        ["precision=fp32"],
        ["precision=bf16"],
    ]
    assert expand_sweep([]) == [[]]


def test_expand_sweep_bad_override():
    with pytest.raises(ConfigError, match="precision=fp32,,: cannot parse"):
        expand_sweep(["precision=fp32,,"])
