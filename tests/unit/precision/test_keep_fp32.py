"""precision.keep_fp32: the named modules run outside autocast with fp32 inputs, the model
keeps its class, parameter names and picklability, and a bad pattern or a mode without
autocast is refused in one line before anything is recorded."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import QUICK, all_runs
from torch import nn

from ampsweep.config import compose
from ampsweep.config.schema import ConfigError
from ampsweep.engine.build import build
from ampsweep.engine.checkpoint import snapshot
from ampsweep.precision.modes import PrecisionConfig
from ampsweep.precision.policy import Fp32Forward, build_policy

CPU = torch.device("cpu")


def net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 2)
    )


def policy(mode: str, *patterns: str):
    return build_policy(PrecisionConfig(name=mode, keep_fp32=list(patterns)), CPU)


def dtypes(model: nn.Module, p) -> dict[str, torch.dtype]:
    seen = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(
                lambda mod, a, out, name=name: seen.__setitem__(name, out.dtype)
            )
    with p.autocast():
        model(torch.randn(3, 4))
    return seen


def test_a_kept_module_runs_in_fp32_under_autocast_and_the_others_in_half():
    model = net()
    p = policy("bf16", "2.*")  # a glob: every module inside the second block
    assert p.keep_modules_fp32(model) == ["2.0"]
    assert dtypes(model, p) == {"0": torch.bfloat16, "2.0": torch.float32, "3": torch.bfloat16}


def test_a_kept_module_keeps_its_class_names_state_and_pickles():
    model = net()
    keys = list(model.state_dict())
    policy("fp16", "3").keep_modules_fp32(model)
    assert type(model[3]) is nn.Linear and list(model.state_dict()) == keys
    again = pickle.loads(pickle.dumps(model))
    assert isinstance(again[3].__dict__["forward"], Fp32Forward)
    assert again[3].__dict__["forward"].module is again[3]  # bound to the copy, not the original
    deep = copy.deepcopy(model)
    assert deep[3].__dict__["forward"].module is deep[3]
    buf = io.BytesIO()
    torch.save(model, buf)  # the whole module, as a pickle-format logged model is written
    x = torch.randn(2, 4)
    assert torch.equal(again(x), model(x))


def test_the_logged_model_is_plain(tmp_path):
    setup = build(compose.load([*QUICK, "model=mlp", "precision=bf16", "precision.keep_fp32=[1]",
                                "tracking=none"]))  # fmt: skip
    assert isinstance(setup.model[1].__dict__.get("forward"), Fp32Forward)
    snap = snapshot(setup.model, setup.val_batches)
    assert "forward" not in snap.module[1].__dict__  # all fp32 already: nothing to keep


def test_a_pattern_that_names_no_module_is_refused_with_the_closest_names():
    with pytest.raises(ConfigError) as err:
        policy("bf16", "2.1", "3").keep_modules_fp32(net())
    text = str(err.value)
    assert text.startswith("precision.keep_fp32: no module of the model is called 2.1 (closest: ")
    assert "2.0" in text and "\n" not in text


@pytest.mark.parametrize(
    "mode,words",
    [
        ("fp32", "changes nothing with precision=fp32, which has no autocast"),
        ("bf16_pure", "cannot run with precision=bf16_pure, which stores every parameter in bf16"),
    ],
)
def test_keep_fp32_with_a_mode_without_autocast_is_refused_when_composed(mode, words):
    with pytest.raises(ConfigError, match=words):
        compose.load([f"precision={mode}", "precision.keep_fp32=[fc1]"])


def test_a_bad_pattern_fails_the_command_in_one_line_and_records_nothing(main, store_uri):
    res = main("train", *QUICK, "model=mlp", "precision=bf16", "precision.keep_fp32=[lyr1]",
               f"tracking.uri={store_uri}")  # fmt: skip
    assert res.code == 2
    (line,) = [ln for ln in res.err.splitlines() if ln.strip()]
    assert "precision.keep_fp32: no module of the model is called lyr1" in line
    assert "Traceback" not in res.err
    assert all_runs(store_uri) == []


def test_a_sweep_with_a_bad_pattern_is_refused_before_any_job_runs(main, store_uri):
    res = main("train", "-m", *QUICK, "model=mlp", "precision=fp16,bf16",
               "precision.keep_fp32=[nope]", f"tracking.uri={store_uri}")  # fmt: skip
    assert res.code == 2 and "precision.keep_fp32: no module" in res.err
    assert all_runs(store_uri) == []


def test_keep_fp32_is_recorded_as_a_param_of_the_run(main, store_uri):
    res = main("train", *QUICK, "model=mlp", "precision=fp16", "precision.keep_fp32=[1,4]",
               f"tracking.uri={store_uri}")  # fmt: skip
    assert res.code == 0, res.err
    (run,) = all_runs(store_uri)
    assert run.data.params["precision.keep_fp32"] == "['1', '4']"


@pytest.mark.slow
def test_keep_fp32_holds_under_torch_compile():
    pytest.importorskip("torch._inductor")
    import shutil

    from conftest import require_tool

    require_tool("compiler", None if shutil.which("g++") else "g++ is not installed")
    from ampsweep.engine.loop import fit

    setup = build(compose.load([*QUICK, "model=mlp", "precision=bf16", "precision.keep_fp32=[1]",
                                "trainer.compile=true", "tracking=none"]))  # fmt: skip
    seen = {}
    plain = setup.model._orig_mod
    plain[1].register_forward_hook(lambda m, a, out: seen.__setitem__("kept", out.dtype))
    plain[4].register_forward_hook(lambda m, a, out: seen.__setitem__("other", out.dtype))
    summary = fit(setup, lambda metrics, step: None)
    assert summary["train/steps"] == 6
    with setup.policy.autocast():
        plain(next(iter(setup.val_batches.epoch(0)))[0])
    assert seen == {"kept": torch.float32, "other": torch.bfloat16}


def test_reproduce_keeps_the_runs_keep_fp32(main, store_uri):
    from ampsweep.cli.reproduce import reproduce

    res = main("train", *QUICK, "model=mlp", "precision=bf16", "precision.keep_fp32=[4]",
               f"tracking.uri={store_uri}")  # fmt: skip
    assert res.code == 0, res.err
    (first,) = all_runs(store_uri)
    assert reproduce(first.info.run_id, [f"tracking.uri={store_uri}"]) == 0
    again = next(r for r in all_runs(store_uri) if r.info.run_id != first.info.run_id)
    assert again.data.params["precision.keep_fp32"] == "['4']"
    assert again.data.metrics["val/loss"] == first.data.metrics["val/loss"]
