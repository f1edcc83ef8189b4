"""engine/data/text: the standard library's source and the user's text files as next-token
sequences: a fixed order and split, a digest of what was read, the unigram baseline."""

from __future__ import annotations

import hashlib
import math
import platform

import pytest
import torch

from ampsweep.config.schema import ConfigError, DatasetConfig
from ampsweep.engine import data
from ampsweep.engine.data import text
from ampsweep.engine.data.batches import Batches


def load(name: str, **args) -> data.Splits:
    shared = {k: args.pop(k) for k in ("val_fraction",) if k in args}
    builder = data.DATASETS.lookup(name)
    resolved, problems = builder.resolve(args)
    assert not problems, problems
    return data.load(DatasetConfig(name=name, args=resolved, **shared), "language_modeling")


def test_pysource_reads_the_standard_library_in_a_fixed_order():
    files = text.stdlib_files()
    assert files == sorted(files, key=lambda p: p.relative_to(files[0].parent).as_posix())
    assert not any({"site-packages", "test", "__pycache__"} & set(p.parts) for p in files)
    splits = load("pysource", max_bytes=20_000, seq_len=32)
    raw, _ = text.read_bytes(files, 20_000)
    assert splits.info["text_sha256"] == hashlib.sha256(raw).hexdigest()
    assert splits.info["python_version"] == platform.python_version()
    assert splits.info["text_bytes"] == 20_000 and splits.num_classes == 256
    again = load("pysource", max_bytes=20_000, seq_len=32)
    assert torch.equal(splits.train[0], again.train[0])  # the same text every time


def test_sequences_are_the_text_and_the_same_shifted_by_one():
    splits = load("pysource", max_bytes=10_000, seq_len=16, val_fraction=0.25)
    raw, _ = text.read_bytes(text.stdlib_files(), 10_000)
    tokens = torch.tensor(list(raw))
    x, y = splits.train
    assert splits.input_shape == (16,) and x.shape[1] == 16 and x.dtype == torch.long
    assert torch.equal(x[0], tokens[:16]) and torch.equal(y[0], tokens[1:17])
    assert torch.equal(x[1], tokens[16:32])
    assert len(x) == (7500 - 1) // 16  # the first 75% trains
    vx, _ = splits.val
    assert torch.equal(vx[0], tokens[7500:7516])  # the rest validates, never seen in training


def test_the_unigram_baseline_is_the_perplexity_of_byte_frequencies():
    train = torch.tensor([0, 0, 0, 1])
    val = torch.tensor([0, 1])
    # add-one smoothing over 4 symbols: p(0) = 4/8, p(1) = 2/8
    expected = math.exp(-(math.log(4 / 8) + math.log(2 / 8)) / 2)
    assert text.unigram_perplexity(train, val, 4) == pytest.approx(expected)
    splits = load("pysource", max_bytes=20_000, seq_len=32)
    assert 10 < splits.reference["data/unigram_perplexity"] < 256  # bytes of code: skewed


def test_token_sequences_batch_as_integers(tmp_path):
    splits = load("pysource", max_bytes=5_000, seq_len=8)
    batches = Batches(splits.train, 4, torch.device("cpu"), torch.bfloat16, shuffle=True,
                      drop_last=True, seed=0, preload=True, channels_last=True)  # fmt: skip
    x, y = next(iter(batches.epoch(0)))
    assert x.dtype == torch.long and y.dtype == torch.long and x.shape == (4, 8)


def test_textfile_reads_a_file_or_a_folder_of_txt_files(tmp_path):
    (tmp_path / "b.txt").write_text("world " * 200)
    (tmp_path / "a.txt").write_text("hello " * 200)
    (tmp_path / "notes.md").write_text("ignored")
    folder = load("textfile", root=str(tmp_path), seq_len=16)
    assert folder.info["text_files"] == 2
    assert bytes(folder.train[0][0].tolist()).startswith(b"hello")  # a.txt first
    one = load("textfile", root=str(tmp_path / "b.txt"), seq_len=16)
    assert one.info["text_bytes"] == 1200 and one.info["tokenizer"] == "bytes"


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: None, "dataset.root={p}/missing.txt: no such file or folder"),
        (lambda p: (p / "missing.txt").write_text("  \n"), "the text is empty"),
        (lambda p: (p / "missing.txt").write_text("ab" * 20), "too few for one training and"),
    ],
    ids=["missing", "empty", "too-short"],
)
def test_textfile_bad_input_is_one_line(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(ConfigError) as err:
        load("textfile", root=str(tmp_path / "missing.txt"), seq_len=16)
    assert message.format(p=tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_textfile_with_a_local_hugging_face_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "def", "return", "x", "y", "(", ")", ":"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(
        tmp_path / "tok"
    )
    (tmp_path / "code.txt").write_text("def x ( y ) : return y\n" * 40)
    splits = load("textfile", root=str(tmp_path / "code.txt"), seq_len=8,
                  tokenizer=str(tmp_path / "tok"))  # fmt: skip
    assert splits.num_classes == len(words) and splits.info["tokenizer"] == str(tmp_path / "tok")
    assert splits.train[0][0][:4].tolist() == [1, 3, 5, 4]  # def x ( y


def test_a_missing_tokenizer_folder_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "t.txt").write_text("some text " * 100)
    with pytest.raises(ConfigError, match=r"dataset.tokenizer=.*nope: cannot load a tokenizer"):
        load("textfile", root=str(tmp_path / "t.txt"), tokenizer=str(tmp_path / "nope"))
