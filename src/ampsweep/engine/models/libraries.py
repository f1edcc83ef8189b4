"""Models from libraries: any timm architecture (``model=timm``, extra ``ampsweep[timm]``) and
any Hugging Face causal LM built from its config (``model=hf_causal_lm``, extra
``ampsweep[hf]``). Neither downloads anything unless asked: timm builds with random weights
(``model.pretrained=false``), transformers with ``from_config``.

Everything that can refuse the choice (the library missing, an unknown architecture, an
unknown config key, pretrained weights that are not here and cannot be fetched) is a check
of the builder's settings, so it fails with one line before any run is recorded.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import socket
from typing import Any

import torch
from torch import nn

from ampsweep.config.schema import ConfigError
from ampsweep.engine.models import MODELS
from ampsweep.engine.registry import positive

# ---------------------------------------------------------------- timm


def _check_timm(s: dict) -> list[str]:
    arch = s["arch"]
    try:
        import timm
    except ImportError:
        return [
            f"arch={arch}: model=timm needs the timm package, which is not installed: "
            "pip install 'ampsweep[timm]'"
        ]
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=3)
        hint = f"did you mean {', '.join(close)}?; " if close else ""
        return [
            f"arch={arch}: not a timm architecture: {hint}list them with "
            "python -c 'import timm; print(timm.list_models())'"
        ]
    problem = _pretrained_problem(arch) if s["pretrained"] else None
    return [problem] if problem else []


@functools.cache
def _pretrained_problem(arch: str) -> str | None:
    """Why the pretrained weights of ``arch`` cannot be had, or None once they are in the local
    cache (fetched now, before any run, when they are missing and the hub is reachable)."""
    import timm
    from timm.models import get_pretrained_cfg

    pc = get_pretrained_cfg(arch)
    if pc is None or not (pc.hf_hub_id or pc.url):
        return f"pretrained=true: timm has no pretrained weights for {arch}: use pretrained=false"
    if _cached(pc):
        return None
    host = "huggingface.co" if pc.hf_hub_id else pc.url.split("/")[2]
    if not _reachable(host):
        return (
            f"pretrained=true: the weights of {arch} are not in the local cache and {host} "
            "cannot be reached (no network): use model.pretrained=false, or fetch them once on "
            f"a machine with network (python -c \"import timm; timm.create_model('{arch}', "
            'pretrained=True)") and copy the Hugging Face cache here'
        )
    try:
        timm.create_model(arch, pretrained=True)  # fetches into the cache, once
    except Exception as err:
        return f"pretrained=true: fetching the weights of {arch} failed: {str(err).splitlines()[0]}"
    return None


def _cached(pc) -> bool:
    if pc.hf_hub_id:
        from huggingface_hub import try_to_load_from_cache

        repo = pc.hf_hub_id.split("@")[0]
        names = [pc.hf_hub_filename] if getattr(pc, "hf_hub_filename", None) else []
        names += ["model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"]
        return any(isinstance(try_to_load_from_cache(repo, n), str) for n in names)
    folder = os.path.join(torch.hub.get_dir(), "checkpoints")
    return os.path.isfile(os.path.join(folder, os.path.basename(pc.url)))


def _reachable(host: str) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return False
    try:
        with socket.create_connection((host, 443), timeout=3):
            return True
    except OSError:
        return False


@MODELS.register("timm", check=_check_timm, extra="timm")
def timm_model(
    num_classes: int,
    in_channels: int,
    image_size: int,
    *,
    arch: str = "resnet18d",
    pretrained: bool = False,
    args: dict[str, Any] | None = None,
) -> nn.Module:
    """``timm.create_model(arch)`` for the data's classes and channels; ``args`` are the
    architecture's own keyword arguments (``model.args.drop_rate=0.1``). Architectures that
    take an image size (ViTs) get the data's unless ``model.args.img_size`` is given."""
    import timm
    from timm.models import model_entrypoint

    kwargs = dict(args or {})
    cls = inspect.signature(model_entrypoint(arch)).return_annotation
    if "img_size" not in kwargs and inspect.isclass(cls):
        if "img_size" in inspect.signature(cls).parameters:
            kwargs["img_size"] = image_size
    return timm.create_model(
        arch, pretrained=pretrained, num_classes=num_classes, in_chans=in_channels, **kwargs
    )


# ---------------------------------------------------------------- Hugging Face causal LMs

SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads")


def _check_hf(s: dict) -> list[str]:
    arch = s["arch"]
    try:
        from transformers import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return [
            f"arch={arch}: model=hf_causal_lm needs the transformers package, which is not "
            "installed: pip install 'ampsweep[hf]'"
        ]
    archs = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if arch not in archs or arch not in CONFIG_MAPPING:
        close = difflib.get_close_matches(arch, archs, n=3)
        hint = f"did you mean {', '.join(close)}?; " if close else ""
        return [
            f"arch={arch}: not a Hugging Face causal-LM architecture: {hint}e.g. llama, gpt2, "
            "qwen2, mistral (any model_type of transformers' AutoModelForCausalLM)"
        ]
    problems = positive(*SIZE_KEYS, "intermediate_size")(s)
    if not problems and s["hidden_size"] % s["num_attention_heads"]:
        problems.append(
            f"hidden_size={s['hidden_size']} must be divisible by "
            f"model.num_attention_heads={s['num_attention_heads']}"
        )
    known = _config_keys(CONFIG_MAPPING[arch])
    for key, value in (s["args"] or {}).items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean model.args.{close[0]}?; " if close else ""
            problems.append(
                f"args.{key}={value}: not a key of the {arch} config: {hint}see "
                f"transformers' {CONFIG_MAPPING[arch].__name__}"
            )
    return problems


def _config_keys(config_cls) -> set[str]:
    """The keys a transformers config class takes: its own and its base's parameters, and
    the generic names its attribute_map translates (hidden_size -> n_embd for gpt2)."""
    from transformers import PretrainedConfig

    keys = set(inspect.signature(config_cls.__init__).parameters)
    keys |= set(inspect.signature(PretrainedConfig.__init__).parameters)
    keys |= set(getattr(config_cls, "attribute_map", {}) or {})
    return keys - {"self", "kwargs"}


class CausalLM(nn.Module):
    """A transformers causal LM whose forward takes token ids and returns only the logits
    (the loop, FLOPs counting and the diagnostics all call ``model(x)``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


@MODELS.register("hf_causal_lm", check=_check_hf, task="language_modeling", extra="hf")
def hf_causal_lm(
    vocab_size: int,
    seq_len: int,
    *,
    arch: str = "llama",
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    intermediate_size: int | None = None,
    args: dict[str, Any] | None = None,
) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` of a small ``arch`` config (random weights, no
    download) with the data's vocabulary and sequence length. The size keys use transformers'
    generic names; ``intermediate_size`` None is 8/3 of hidden_size (a SwiGLU MLP with as many
    weights as a 4x MLP), rounded up to 32, for architectures that have one. ``args``: any other
    key of the architecture's config, applied last."""
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    sizes: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "max_position_embeddings": seq_len,
    }
    params = inspect.signature(CONFIG_MAPPING[arch].__init__).parameters
    if "intermediate_size" in params:
        sizes["intermediate_size"] = intermediate_size or -(-hidden_size * 8 // 3 // 32) * 32
    if "num_key_value_heads" in params:  # several defaults differ from the head count
        sizes["num_key_value_heads"] = num_attention_heads
    wanted = {**sizes, **(args or {})}
    config = AutoConfig.for_model(arch, **wanted)
    for key in SIZE_KEYS:
        if getattr(config, key, None) != wanted[key]:
            raise ConfigError(
                f"model.arch={arch}: its config does not take model.{key}: set its own size "
                "keys under model.args"
            )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids of a larger vocabulary
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= vocab_size:
            setattr(config, key, None)
    return CausalLM(AutoModelForCausalLM.from_config(config))
