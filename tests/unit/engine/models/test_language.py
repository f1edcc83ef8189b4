"""engine/models/language: a causal decoder-only transformer with a tied head; its size checks
and its fit to the data's sequence length are refused in one line before anything runs; Hugging
Face causal LMs take their size and vocabulary from the config and the data, and a missing
library, an unknown architecture or config key are refused in one line."""

from __future__ import annotations

import sys

import pytest
import torch

from ampsweep.config import compose
from ampsweep.config.schema import ConfigError, ModelConfig
from ampsweep.engine import components
from ampsweep.engine.build import build
from ampsweep.engine.loop import fit
from ampsweep.engine.models import MODELS, build_model


def gpt(**args):
    resolved, problems = MODELS.lookup("gpt").resolve(
        {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, **args}
    )
    assert not problems, problems
    return build_model(ModelConfig("gpt", resolved), (16,), 256).eval()


def test_logits_for_every_position_over_the_vocabulary():
    model = gpt()
    x = torch.randint(0, 256, (3, 16))
    assert model(x).shape == (3, 16, 256)
    assert model(x[:, :5]).shape == (3, 5, 256)  # shorter sequences use the first positions


def test_attention_is_causal_a_position_never_sees_the_future():
    torch.manual_seed(0)
    model = gpt()
    x = torch.randint(0, 256, (1, 16))
    changed = x.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256  # change only the tokens from position 10
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[0, :10], b[0, :10])
    assert not torch.allclose(a[0, 10:], b[0, 10:])


def test_the_output_head_shares_the_token_embedding():
    model = gpt()
    assert model.head.weight is model.tok_emb.weight
    n = sum(p.numel() for p in model.parameters())  # counted once
    assert n == 256 * 32 + 16 * 32 + sum(p.numel() for p in model.blocks.parameters()) + 2 * 32


def test_n_embd_must_divide_into_heads():
    _, problems = MODELS.lookup("gpt").resolve({"n_embd": 100, "n_head": 3})
    assert problems == [
        "model.n_embd=100 must be divisible by model.n_head=3: each head gets n_embd / n_head "
        "channels (e.g. model.n_embd=96)"
    ]


def test_sequences_longer_than_the_position_table_are_refused_up_front():
    cfg = compose.load(["model=gpt", "dataset=pysource", "dataset.seq_len=512"])
    with pytest.raises(ConfigError) as err:
        components.resolve(cfg)
    assert str(err.value) == (
        "dataset.seq_len=512 is larger than model.block_size=256 (the GPT has positions for "
        "block_size tokens): lower dataset.seq_len or set model.block_size=512"
    )


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model=gpt"],
            "task=classification: model=gpt is a language_modeling model and dataset=digits is a "
            "classification data set: pick a model and a data set of the same task "
            "(classification models: cnn, mlp,",
        ),
        (
            ["dataset=pysource"],
            "task=language_modeling: model=cnn is a classification model and dataset=pysource is "
            "a language_modeling data set: pick a model and a data set of the same task "
            "(language_modeling models: gpt, hf_causal_lm)",
        ),
    ],
    ids=["gpt-on-images", "cnn-on-text"],
)
def test_a_model_and_data_set_of_different_tasks_are_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        components.resolve(compose.load(overrides))
    assert str(err.value).startswith(message)


QUICK = [
    "trainer.epochs=1", "trainer.max_steps=8", "trainer.batch_size=16", "trainer.log_every=2",
    "trainer.timing_warmup_steps=1", "trainer.progress=false", "tracking=none",
    "optimizer.lr=2e-3",
]  # fmt: skip


def check(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        components.resolve(compose.load(list(overrides)))
    return str(err.value)


def test_hf_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert check("model=hf_causal_lm", "dataset=pysource").startswith(
        "model.arch=llama: model=hf_causal_lm needs the transformers package, which is not "
        "installed: pip install 'ampsweep[hf]'"
    )


def test_an_unknown_hf_architecture_and_config_key_are_refused():
    pytest.importorskip("transformers")
    assert "model.arch=lama: not a Hugging Face causal-LM architecture: did you mean llama" in (
        check("model=hf_causal_lm", "dataset=pysource", "model.arch=lama")
    )
    text = check("model=hf_causal_lm", "dataset=pysource", "model.args.rms_norm_epsilon=1.0")
    assert (
        "model.args.rms_norm_epsilon=1.0: not a key of the llama config: did you mean "
        "model.args.rms_norm_eps?"
    ) in text


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_hf_models_take_their_size_and_vocabulary_from_the_config_and_data(arch):
    pytest.importorskip("transformers")
    setup = build(
        compose.load(
            [
                *QUICK,
                "model=hf_causal_lm",
                f"model.arch={arch}",
                "dataset=pysource",
                "dataset.max_bytes=20000",
                "dataset.seq_len=32",
                "model.hidden_size=32",
                "model.num_attention_heads=2",
                "trainer.max_steps=2",
            ]  # fmt: skip
        )
    )
    config = setup.model.model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (256, 32, 2)
    assert config.num_attention_heads == 2 and config.max_position_embeddings == 32
    summary = fit(setup, lambda m, s: None)
    assert summary["val/perplexity"] < 256  # below a uniform guess over the bytes
