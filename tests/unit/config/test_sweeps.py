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


def test_expand_sweep_refuses_a_sweep_with_no_value():
    with pytest.raises(ConfigError, match=r"trainer.seed=range\(3,0\): an empty range"):
        expand_sweep(["trainer.seed=range(3,0)"])
    with pytest.raises(ConfigError, match="step 0 never reaches its end"):
        expand_sweep(["optimizer.lr=range(0.1,0.3,0)"])
    with pytest.raises(ConfigError, match="interval.. has no list of values"):
        expand_sweep(["optimizer.lr=interval(0.1,0.3)"])


def test_a_range_of_floats_counts_and_writes_the_decimals_typed():
    assert expand_sweep(["lr=range(0.1,0.7,0.1)"]) == [[f"lr=0.{i}"] for i in range(1, 7)]
    assert expand_sweep(["lr=range(1,0.5,-0.25)"]) == [["lr=1.0"], ["lr=0.75"]]
    assert expand_sweep(["x=range(-0.3,0.1,0.1)"])[3] == ["x=0.0"]  # not 5.6e-17, nor -0.0
