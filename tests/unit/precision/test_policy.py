"""precision/policy.py: what each mode does to dtypes, the scaler and the global TF32 state
(restored after every test by the conftest), and how a mode is refused on this hardware."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ampsweep.config import compose as config
from ampsweep.config.schema import ConfigError
from ampsweep.precision.modes import MODES
from ampsweep.precision.policy import (
    StaticGradScaler,
    build_policy,
    found_inf,
    set_tf32,
    tf32_enabled,
)

CPU = torch.device("cpu")

# mode: (dtype of a matmul inside policy.autocast(), parameter dtype, scaler class or None)
CPU_MODES = {
    "fp32": (torch.float32, torch.float32, None),
    "fp16": (torch.float16, torch.float32, torch.amp.GradScaler),
    "fp16_static": (torch.float16, torch.float32, StaticGradScaler),
    "fp16_noscale": (torch.float16, torch.float32, None),
    "bf16": (torch.bfloat16, torch.float32, None),
    "bf16_pure": (torch.bfloat16, torch.bfloat16, None),
}


def policy_for(*overrides: str, device: torch.device = CPU):
    return build_policy(config.load(list(overrides)).precision, device)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_matmul_dtype_inside_autocast(mode):
    policy = policy_for(f"precision={mode}")
    x = torch.randn(4, 4, dtype=policy.param_dtype)  # inputs live in the parameter dtype
    with policy.autocast():
        out = x @ x
    assert out.dtype == CPU_MODES[mode][0]


@pytest.mark.parametrize("mode", CPU_MODES)
def test_outer_autocast_does_not_leak_in(mode):
    # The policy's context is disabled (not absent) in non-autocast modes, so a caller's
    # autocast cannot silently change what the mode computes in.
    policy = policy_for(f"precision={mode}")
    x = torch.randn(4, 4, dtype=policy.param_dtype)
    with torch.autocast("cpu", dtype=torch.float16 if "bf16" in mode else torch.bfloat16):
        with policy.autocast():
            out = x @ x
    assert out.dtype == CPU_MODES[mode][0]


@pytest.mark.parametrize("mode", CPU_MODES)
def test_parameter_dtype_after_prepare_model(mode):
    policy = policy_for(f"precision={mode}")
    model = policy.prepare_model(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()))
    assert {p.dtype for p in model.parameters()} == {CPU_MODES[mode][1]}
    assert policy.param_dtype == CPU_MODES[mode][1]


@pytest.mark.parametrize("mode", CPU_MODES)
def test_scaler_per_mode(mode):
    scaler = policy_for(f"precision={mode}").make_scaler()
    cls = CPU_MODES[mode][2]
    assert scaler.is_enabled() == (cls is not None)
    if cls is not None:
        assert type(scaler) is cls


def test_scaler_options_are_passed_through():
    policy = policy_for(
        "precision=fp16",
        "precision.scaler.init_scale=512",
        "precision.scaler.growth_factor=3.0",
        "precision.scaler.backoff_factor=0.25",
        "precision.scaler.growth_interval=7",
    )
    scaler = policy.make_scaler()
    assert scaler.get_scale() == 512.0
    assert scaler.get_growth_factor() == 3.0
    assert scaler.get_backoff_factor() == 0.25
    assert scaler.get_growth_interval() == 7
    assert policy.scaler.enabled is True and policy.scaler.dynamic is True


def test_scaler_switches():
    off = policy_for("precision=fp16", "precision.scaler.enabled=false").make_scaler()
    assert not off.is_enabled()
    # bf16 autocast keeps fp32 gradients, so a scaler may be switched on.
    assert policy_for("precision=bf16", "precision.scaler.enabled=true").make_scaler().is_enabled()
    static = policy_for("precision=fp16", "precision.scaler.dynamic=false").make_scaler()
    assert type(static) is StaticGradScaler


def test_scaler_refused_for_pure_modes():
    with pytest.raises(ConfigError, match="precision.scaler.enabled=true.*bf16_pure"):
        policy_for("precision=bf16_pure", "precision.scaler.enabled=true")


@pytest.mark.parametrize("mode", CPU_MODES)
def test_every_mode_sets_tf32_off_both_ways(mode):
    set_tf32(True)  # a previous job in the same process left TF32 on
    policy_for(f"precision={mode}").set_global_state()
    assert tf32_enabled() == (False, False)


def test_tf32_policy_turns_tf32_on_and_fp32_turns_it_off():
    fp32 = policy_for("precision=fp32")
    # The tf32 mode refuses CPU, so its flag-setting is checked on a policy built directly.
    replace(fp32, mode=MODES["tf32"]).set_global_state()
    assert tf32_enabled() == (True, True)
    fp32.set_global_state()
    assert tf32_enabled() == (False, False)


def test_auto_is_fp32_on_cpu():
    policy = policy_for("precision=auto")
    assert policy.mode == MODES["fp32"]
    resolved = policy.resolved_config(config.load([]).precision)
    assert resolved.name == "fp32"
    assert resolved.dtype.name == "fp32"
    assert (resolved.autocast, resolved.pure, resolved.tf32) == (False, False, False)
    assert resolved.scaler.enabled is False


@pytest.mark.parametrize("mode,fix", [("tf32", "precision=fp32"), ("fp16_pure", "bf16_pure")])
def test_cuda_only_modes_refused_on_cpu(mode, fix):
    with pytest.raises(ConfigError) as info:
        policy_for(f"precision={mode}")
    message = str(info.value)
    assert f"precision={mode}" in message and "CUDA" in message and fix in message


# ---------------------------------------------------------------- the scaler on inf


def _one_step(scaler, inject_inf: bool):
    """One scaled step of a tiny model; returns (params before, params after, found_inf)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randn(8, 4)).square().mean()
    scaler.scale(loss).backward()
    if inject_inf:
        model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    skipped = found_inf(scaler, opt).item()
    scaler.step(opt)
    scaler.update()
    after = [p.detach().clone() for p in model.parameters()]
    return before, after, skipped


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_static_scaler_skips_inf_step_and_keeps_scale():
    scaler = policy_for("precision=fp16_static").make_scaler()
    before, after, skipped = _one_step(scaler, inject_inf=True)
    assert skipped == 1.0
    assert _same(before, after)  # the optimizer step was skipped
    assert scaler.get_scale() == 1024.0  # ... and the scale did not back off


def test_static_scaler_never_grows():
    scaler = policy_for("precision=fp16_static", "precision.scaler.growth_interval=1").make_scaler()
    for _ in range(3):
        before, after, skipped = _one_step(scaler, inject_inf=False)
        assert skipped == 0.0 and not _same(before, after)
    assert scaler.get_scale() == 1024.0


def test_dynamic_scaler_halves_on_inf_and_grows_after_clean_steps():
    scaler = policy_for(
        "precision=fp16", "precision.scaler.init_scale=1024", "precision.scaler.growth_interval=2"
    ).make_scaler()
    before, after, skipped = _one_step(scaler, inject_inf=True)
    assert skipped == 1.0 and _same(before, after)
    assert scaler.get_scale() == 512.0
    for _ in range(2):
        assert _one_step(scaler, inject_inf=False)[2] == 0.0
    assert scaler.get_scale() == 1024.0


def test_found_inf_of_disabled_scaler_is_zero():
    scaler = policy_for("precision=bf16").make_scaler()
    before, after, skipped = _one_step(scaler, inject_inf=False)
    assert skipped == 0.0 and not _same(before, after)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_tf32_mode_on_cuda():
    policy = policy_for("precision=tf32", device=torch.device("cuda"))
    policy.set_global_state()
    assert tf32_enabled() == (True, True)
    assert policy.param_dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp16", "bf16", "fp16_pure"])
def test_cuda_matmul_dtype(mode):
    policy = policy_for(f"precision={mode}", device=torch.device("cuda"))
    x = torch.randn(4, 4, device="cuda", dtype=policy.param_dtype)
    with policy.autocast():
        out = x @ x
    assert out.dtype == (torch.bfloat16 if mode == "bf16" else torch.float16)


@pytest.mark.gpu
def test_auto_on_cuda_is_half():
    policy = policy_for("precision=auto", device=torch.device("cuda"))
    expected = MODES["bf16" if torch.cuda.is_bf16_supported() else "fp16"]
    assert policy.mode == expected


def test_bf16_refused_on_a_gpu_without_it(monkeypatch):
    # No GPU here: pretend to be a pre-Ampere one, to check the refusal and its fix.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    cuda = torch.device("cuda", 0)
    for mode in ("bf16", "bf16_pure"):
        with pytest.raises(ConfigError) as info:
            policy_for(f"precision={mode}", device=cuda)
        message = str(info.value)
        assert f"precision={mode}" in message and "Tesla T4" in message
        assert "precision=fp16" in message
    # ... and auto picks the scaled fp16 mode there.
    assert policy_for("precision=auto", device=cuda).mode == MODES["fp16"]


def test_gradscaler_still_keeps_its_inf_checks_per_optimizer():
    # found_inf reads GradScaler's private record of unscale_'s checks (torch 2.14.1)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()
    scaler.unscale_(opt)
    per_device = scaler._found_inf_per_device(opt)  # noqa: SLF001
    assert {d.type for d in per_device} == {"cpu"}
    assert sum(v.item() for v in per_device.values()) == 1.0
