"""A compact GPT: a decoder-only transformer for next-token prediction, written here.

Token and position embeddings, ``n_layer`` pre-norm blocks (LayerNorm, causal self-attention
through ``F.scaled_dot_product_attention``, LayerNorm, a 4x MLP with GELU), a final LayerNorm
and an output head that shares the token embedding's weights. Sized by ``n_layer``,
``n_head``, ``n_embd`` and ``block_size`` (the longest sequence it has positions for).
"""

from __future__ import annotations

import math

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
