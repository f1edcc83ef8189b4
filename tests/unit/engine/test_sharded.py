"""engine/sharded.py in one process: which modules become FSDP units, the precision policy's
defaults from the mode table, the one-line refusals (shard patterns matching nothing, fp8,
FSDP keys without FSDP, a strategy mismatch on resume), the re-shaping of a resume onto another
number of ranks, and the report telling FSDP policies apart. (Training under FSDP needs a
process group: tests/e2e/test_fsdp.py.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError, Strategy, validate
from ampsweep.engine import sharded
from ampsweep.engine.models.language import GPT
from ampsweep.precision import modes
from ampsweep.precision.modes import Dtype
from ampsweep.precision.policy import build_policy
from ampsweep.report import stats, sweeps
from ampsweep.report.model import RunData


def test_units_are_the_transformer_blocks_else_the_top_level_children_else_the_patterns():
    gpt = GPT(vocab_size=64, n_layer=3, n_head=2, n_embd=16, block_size=8, dropout=0.0)
    assert sharded.units(gpt, []) == ["blocks.0", "blocks.1", "blocks.2"]
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert sharded.units(mlp, []) == ["1", "3"]  # the children that hold parameters
    assert sharded.units(gpt, ["blocks.*.attn", "blocks.1"]) == [
        "blocks.0.attn",
        "blocks.1",
        "blocks.2.attn",
    ]  # fmt: skip  (blocks.1.attn is inside blocks.1: one unit)


def test_units_of_a_hugging_face_model_are_its_declared_blocks():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    class Inner(nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.stack = nn.Sequential(Layer(), Layer())

    wrapper = nn.Module()
    wrapper.model = Inner()
    assert sharded.units(wrapper, []) == ["model.stack.0", "model.stack.1"]


def test_shard_patterns_that_match_nothing_are_refused_naming_the_closest_modules():
    gpt = GPT(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=8, dropout=0.0)
    with pytest.raises(ConfigError) as err:
        sharded.units(gpt, ["block.*", "blocks.*"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("trainer.fsdp.shard: no module of the model is called block.*")
    assert "closest: blocks" in message and "blocks.*'" in message


def test_the_mode_table_gives_fsdp_its_policy_and_overrides_win():
    bf16, fp32 = modes.MODES["bf16"], modes.MODES["fp32"]
    pc = modes.PrecisionConfig(name="bf16")
    resolved = sharded.resolved_precision(pc, bf16).fsdp
    assert (resolved.param_dtype, resolved.reduce_dtype) == (Dtype.bf16, Dtype.fp32)
    resolved = sharded.resolved_precision(pc, fp32).fsdp
    assert (resolved.param_dtype, resolved.reduce_dtype) == (Dtype.fp32, Dtype.fp32)
    pc.fsdp.reduce_dtype = Dtype.bf16
    policy = sharded.mixed_precision(sharded.resolved_precision(pc, bf16))
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    for mode in modes.MODES.values():  # every row names float dtypes the policy can use
        assert {mode.fsdp_param_dtype, mode.fsdp_reduce_dtype} <= set(Dtype.__members__)


def test_fsdp_keys_without_fsdp_and_a_non_float_reduce_dtype_are_config_errors():
    with pytest.raises(ConfigError) as err:
        config.load(["precision.fsdp.reduce_dtype=bf16", "trainer.fsdp.shard=[blocks.*]"])
    message = str(err.value)
    assert message.startswith(
        "precision.fsdp.reduce_dtype=bf16 is FSDP's and changes nothing under "
        "trainer.strategy=ddp: add trainer.strategy=fsdp, or drop it"
    )
    assert "trainer.fsdp.shard=[blocks.*] changes nothing" in message
    with pytest.raises(ConfigError, match="reduce_dtype=int8: invalid value: choose one of fp32"):
        config.load(["trainer.strategy=fsdp", "precision.fsdp.reduce_dtype=int8"])
    cfg = config.load(["trainer.strategy=fsdp", "precision.fsdp.reduce_dtype=bf16"])
    assert not validate(cfg) and cfg.precision.fsdp.reduce_dtype == Dtype.bf16


def test_fp8_under_fsdp_takes_the_tensorwise_recipe_only():
    for mode, refused in (("fp8_rowwise", True), ("fp8_tensorwise", False)):
        cfg = config.load(["trainer.strategy=fsdp", f"precision={mode}",
                           "precision.fp8.emulate=true"])  # fmt: skip
        policy = build_policy(cfg.precision, torch.device("cpu"))
        if refused:
            reason = "float8 all-gather under FSDP takes the tensorwise recipe only"
            with pytest.raises(ConfigError, match=reason):
                sharded.check(cfg, policy, torch.device("cpu"))
        else:
            sharded.check(cfg, policy, torch.device("cpu"))


def _ckpt(**config_values) -> dict:
    return {"sharded": "step-00000004.dcp", "config": config_values}


def test_a_checkpoint_of_the_other_strategy_is_refused_naming_the_one_that_wrote_it():
    cfg = config.load(["trainer.strategy=fsdp"])
    ddp = {"config": {"trainer.strategy": "Strategy.ddp"}}
    line = sharded.mismatch(ddp, cfg, "x.pt", Path("x.pt"))
    assert "was written by a trainer.strategy=ddp run and this run is trainer.strategy=fsdp" in line
    assert sharded.mismatch(_ckpt(**{"trainer.strategy": "Strategy.fsdp"}), cfg, "x", Path("x"))\
        is None  # fmt: skip
    under_ddp = replace(cfg, trainer=replace(cfg.trainer, strategy=Strategy.ddp))
    assert "written by a trainer.strategy=fsdp run" in sharded.mismatch(
        _ckpt(**{"trainer.strategy": "Strategy.fsdp"}), under_ddp, "x", Path("x")
    )


def test_a_sharded_resume_may_change_the_ranks_that_share_the_same_global_batch():
    cfg = config.load(["trainer.strategy=fsdp", "trainer.batch_size=32"])
    saved = _ckpt(**{"trainer.nproc": "2", "trainer.batch_size": "16"})
    as_saved = sharded.as_saved(saved, cfg)
    assert (as_saved.trainer.nproc, as_saved.trainer.batch_size) == (2, 16)
    other = config.load(["trainer.strategy=fsdp", "trainer.batch_size=16"])  # half the batch
    assert sharded.as_saved(saved, other) is other  # left for the config check to refuse
    whole = {"config": {"trainer.nproc": "2", "trainer.batch_size": "16"}}  # not sharded
    assert sharded.as_saved(whole, cfg) is cfg


def test_held_memory_counts_a_dtensor_by_its_local_shard():
    from ampsweep.measure.memory import model_memory

    model = nn.Linear(4, 4, bias=False)
    shard = torch.zeros(2, 4)
    model.weight.to_local = lambda: shard  # a DTensor parameter's local shard
    held = model_memory(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert held == {"params_fp32": 2 * 4 * 4, "grads_fp32": 2 * 4 * 4}


def _run(run_id: str, mode: str, reduce: str, ppl: float) -> RunData:
    params = {"precision.name": mode, "model.name": "gpt", "trainer.strategy": "fsdp",
              "precision.fsdp.param_dtype": mode, "precision.fsdp.reduce_dtype": reduce,
              "trainer.seed": "0"}  # fmt: skip
    tags = {"precision": mode, "model": "gpt", "dataset": "pysource", "device": "cpu"}
    metrics = {"val/perplexity": ppl, "perf/tokens_per_s": 1000.0}
    return RunData(run_id, f"{mode}-{reduce}", "FINISHED", params, tags, metrics)


def test_the_report_compares_fsdp_reductions_as_it_compares_modes():
    runs = [_run("a", "fp32", "fp32", 10.0), _run("b", "bf16", "fp32", 10.5),
            _run("c", "bf16", "bf16", 11.0)]  # fmt: skip
    rows = {r.run_id: r for r in sweeps.compute_rows(runs)}
    assert rows["b"].baseline_run_id == rows["c"].baseline_run_id == "a"
    assert rows["b"].config == "param_dtype=bf16 reduce_dtype=fp32"
    assert rows["c"].config == "param_dtype=bf16 reduce_dtype=bf16"
    # Not merged as repeats of one configuration: one row each.
    summarised = stats.summarise(sweeps.compute_rows(runs), runs)
    assert [r.run_id for r in summarised] == ["a", "b", "c"]


def test_a_rank_of_n_is_predicted_to_hold_one_nth_and_its_largest_gathered_block():
    from ampsweep.engine import capacity
    from ampsweep.measure.memory import model_memory

    gpt = GPT(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=8, dropout=0.0)
    optimizer = torch.optim.AdamW(gpt.parameters())
    gpt(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    cfg = config.load(["trainer.strategy=fsdp", "trainer.nproc=4", "precision=bf16"])
    cfg = replace(cfg, precision=sharded.resolved_precision(cfg.precision, modes.MODES["bf16"]))
    assert capacity.per_rank(cfg) and not capacity.per_rank(config.load([]))
    held = sharded.predicted_held(gpt, optimizer, cfg)
    whole = model_memory(gpt, optimizer)
    for key, nbytes in whole.items():
        assert held[key] == nbytes / 4
    # bf16 gathers, one unit at a time: the root's (embeddings, tied head, final norm)
    block = sum(p.numel() for p in gpt.blocks[0].parameters())
    root = sum(p.numel() for p in gpt.parameters()) - 2 * block
    assert held["params_gathered_bf16"] == 2 * max(block, root)
    fsdp = replace(cfg.trainer.fsdp, reshard_after_forward=False)
    kept = replace(cfg, trainer=replace(cfg.trainer, fsdp=fsdp))
    predicted = sharded.predicted_held(gpt, optimizer, kept)
    assert predicted["params_gathered_bf16"] == 2 * (2 * block + root)


def test_every_torch_norm_that_can_keep_running_statistics_is_its_own_fp32_unit():
    import inspect

    keeping = [
        cls for name in dir(nn) if not name.startswith("Lazy")
        and isinstance(cls := getattr(nn, name), type) and issubclass(cls, nn.Module)
        and "track_running_stats" in inspect.signature(cls).parameters
    ]  # fmt: skip
    assert keeping and set(keeping) == set(sharded.RUNNING_STATS_NORMS)


def test_hugging_face_models_still_name_their_blocks_where_units_reads_them():
    # units() reads Transformers' _no_split_modules (transformers 5.24.0)
    transformers = pytest.importorskip("transformers")
    assert hasattr(transformers.PreTrainedModel, "_no_split_modules")
    assert "GPT2Block" in transformers.GPT2LMHeadModel._no_split_modules
