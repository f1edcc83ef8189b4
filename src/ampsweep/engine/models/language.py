"""The language models: a compact GPT written here, and any Hugging Face causal LM built from
its config (``model=hf_causal_lm``, extra ``ampsweep[hf]``; ``from_config``: nothing is
downloaded).

The GPT, for next-token prediction: token and position embeddings, ``n_layer`` pre-norm blocks
(LayerNorm, causal self-attention through ``F.scaled_dot_product_attention``, LayerNorm, a 4x
MLP with GELU), a final LayerNorm and an output head that shares the token embedding's weights.
Sized by ``n_layer``, ``n_head``, ``n_embd`` and ``block_size`` (the longest sequence it has
positions for).

Everything that can refuse a Hugging Face model (the library missing, an unknown architecture,
an unknown config key) is a check of the builder's settings, so it fails with one line before
any run is recorded.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampsweep.config.schema import Config, ConfigError
from ampsweep.engine.models import MODELS
from ampsweep.engine.registry import all_of, fraction, positive


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        block_size: int,
        dropout: float,
    ):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one vocabulary matrix, read and written
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream: its variance grows
        # with depth otherwise.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> next-token logits (B, T, vocab)."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _check_gpt(s: dict) -> list[str]:
    problems = all_of(positive("n_layer", "n_head", "n_embd", "block_size"), fraction("dropout"))(s)
    if not problems and s["n_embd"] % s["n_head"]:
        problems.append(
            f"n_embd={s['n_embd']} must be divisible by model.n_head={s['n_head']}: each head "
            f"gets n_embd / n_head channels (e.g. model.n_embd={s['n_head'] * 32})"
        )
    return problems


def _fits_gpt(s: dict, cfg: Config) -> list[str]:
    """The data's sequences must fit the position table (checked before anything runs)."""
    seq_len = cfg.dataset.args.get("seq_len")
    if isinstance(seq_len, int) and seq_len > s["block_size"]:
        return [
            f"dataset.seq_len={seq_len} is larger than model.block_size={s['block_size']} (the "
            "GPT has positions for block_size tokens): lower dataset.seq_len or set "
            f"model.block_size={seq_len}"
        ]
    return []


@MODELS.register("gpt", check=_check_gpt, task="language_modeling", fits=_fits_gpt)
def gpt(
    vocab_size: int,
    seq_len: int,
    *,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    block_size: int = 256,
    dropout: float = 0.0,
) -> nn.Module:
    """A decoder-only transformer with a tied output head (see the module docstring)."""
    if seq_len > block_size:  # data from a _target_ data set, not known before it loads
        raise ConfigError(
            f"the data's sequences have {seq_len} tokens but model.block_size={block_size}: "
            f"lower dataset.seq_len or set model.block_size={seq_len}"
        )
    return GPT(vocab_size, n_layer, n_head, n_embd, block_size, dropout)


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
