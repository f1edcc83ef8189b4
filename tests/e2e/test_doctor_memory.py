"""``ampsweep doctor --memory --verify`` on a model whose weights and optimizer state fill its
step's peak: the pure mode verified in the sweep of one-process jobs, FSDP's prescription in a
sweep whose launcher (``hydra/launcher=ampsweep_local``) starts its two ranks, each judged by
the step peak its run recorded (FSDP's: rank 0's, per rank)."""

from __future__ import annotations

import importlib.util
import re

import pytest
from conftest import all_runs, require_tool

ARGS = ["model=mlp", "model.width=512", "trainer.batch_size=2", "trainer.max_steps=2",
        "trainer.progress=false", "tracking.log_model=false"]  # fmt: skip


@pytest.mark.slow
def test_fsdps_prescription_runs_its_ranks_and_holds_its_predicted_share(
    main, store_uri, monkeypatch
):
    found = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher")
    require_tool("submitit", None if found else "hydra-submitit-launcher is not installed")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    out = main("doctor", "--memory", "--verify", *ARGS)
    text = " ".join(out.out.split())  # the console wraps long lines
    assert out.code == 0, (text[-3000:], out.err[-3000:])
    assert re.search(r"bf16_pure \(precision=bf16_pure\): fixed: step peak \S+ MiB vs", text)
    fsdp = re.search(
        r"bf16_fsdp_nproc_2 \(precision=bf16 trainer.strategy=fsdp trainer.nproc=2\): fixed: "
        r"step peak ([\d.]+) MiB vs ([\d.]+) MiB of bf16 less half the predicted saving, per "
        r"rank \(predicted",
        text,
    )
    assert fsdp, text
    runs = {r.info.run_name: r for r in all_runs(store_uri)}
    rank0 = runs["bf16_fsdp_nproc_2-mlp-digits"].data.metrics
    bf16 = runs["bf16-mlp-digits"].data.metrics
    assert rank0["mem/params_sharded_mib"] == pytest.approx(bf16["mem/params_mib"] / 2, rel=0.05)
    assert rank0["mem/step_peak_mib"] == pytest.approx(float(fsdp[1]), rel=0.01)
    assert rank0["mem/step_peak_mib"] < 0.75 * bf16["mem/step_peak_mib"]
    parents = [r for r in runs.values() if r.data.tags.get("ampsweep.sweep") == "true"]
    assert len(parents) == 2  # the one-process jobs' sweep and the two-process one
