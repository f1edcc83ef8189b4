"""Text data sets for language modeling, offline: the Python standard library's own source
(``dataset=pysource``) and the user's text files (``dataset=textfile``).

Text becomes one stream of token ids: bytes (a vocabulary of 256) unless a Hugging Face
tokenizer is given. The last ``dataset.val_fraction`` of the stream validates; each split is
cut into sequences of ``dataset.seq_len`` tokens (a sample is ``seq_len`` tokens and the same
shifted by one: the next token at every position), which the batches visit in a seeded order
as for images (repeatable, resumable, sharded under DDP). What was read is recorded with the
run (``data.*`` tags: the interpreter version, the files, a SHA-256 of the text), with the
perplexity of a unigram model of the training text on the validation text
(``data/unigram_perplexity``), the floor any model that learns anything must beat.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import sysconfig
from pathlib import Path

import torch

from ampsweep.config.schema import ConfigError, DatasetConfig
from ampsweep.engine.data import DATASETS, Splits
from ampsweep.engine.registry import positive

LM = "language_modeling"
BYTES = 256  # the byte-level vocabulary
# Folders of the standard library that are not part of every installation (test suites are
# packaged separately by some distributions) or not the standard library at all.
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files of the running interpreter, in a fixed order (sorted
    by path relative to the library folder)."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_SKIP)
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def read_bytes(files: list[Path], max_bytes: int) -> tuple[bytes, int]:
    """The files' bytes one after another, cut at ``max_bytes``; and how many files were read."""
    chunks, total, used = [], 0, 0
    for path in files:
        if total >= max_bytes:
            break
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        used += 1
    return b"".join(chunks)[:max_bytes], used


def unigram_perplexity(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """exp(cross-entropy) of the validation tokens under the training tokens' frequencies
    (add-one smoothed): what predicting each token without context achieves."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[val].mean().item())


def sequences(tokens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive windows of ``seq_len`` tokens (inputs) and the same shifted by one
    (targets): every full window of the stream."""
    n = (len(tokens) - 1) // seq_len
    x = tokens[: n * seq_len].view(n, seq_len)
    y = tokens[1 : n * seq_len + 1].view(n, seq_len)
    return x.clone(), y.clone()


def text_splits(
    cfg: DatasetConfig, tokens: torch.Tensor, vocab: int, seq_len: int, what: str, info: dict
) -> Splits:
    cut = int(round(len(tokens) * (1 - cfg.val_fraction)))
    train, val = tokens[:cut], tokens[cut:]
    if len(val) <= seq_len or len(train) <= seq_len:
        raise ConfigError(
            f"{what} gives {len(tokens)} tokens, too few for one training and one validation "
            f"sequence of dataset.seq_len={seq_len} tokens (+1): use more text or lower "
            "dataset.seq_len"
        )
    reference = {"data/unigram_perplexity": unigram_perplexity(train, val, vocab)}
    info = {**info, "tokens": len(tokens), "vocab_size": vocab}
    return Splits(
        cfg.name,
        vocab,
        (seq_len,),
        sequences(train, seq_len),
        sequences(val, seq_len),
        info=info,
        reference=reference,
    )


def _byte_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


@DATASETS.register("pysource", check=positive("max_bytes", "seq_len"), task=LM)
def pysource(cfg: DatasetConfig, *, max_bytes: int = 1_000_000, seq_len: int = 128) -> Splits:
    """The running interpreter's standard-library source (.py files in path order, up to
    ``max_bytes``), byte-level: text every machine has, no download."""
    files = stdlib_files()
    if not files:
        raise ConfigError(
            f"dataset=pysource: no .py files under {sysconfig.get_paths()['stdlib']} (this "
            "Python ships without its library source): use dataset=textfile dataset.root=PATH"
        )
    data, used = read_bytes(files, max_bytes)
    info = {
        "python_version": platform.python_version(),
        "text_files": used,
        "text_bytes": len(data),
        "text_sha256": hashlib.sha256(data).hexdigest(),
        "tokenizer": "bytes",
    }
    return text_splits(cfg, _byte_tokens(data), BYTES, seq_len, "dataset=pysource", info)


def _text_files(root: str) -> list[Path]:
    path = Path(root).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not found:
            raise ConfigError(
                f"dataset.root={root}: the folder holds no .txt files: point dataset.root at a "
                "text file, or a folder of .txt files"
            )
        return found
    raise ConfigError(
        f"dataset.root={root}: no such file or folder ({path.resolve()}): point dataset.root at "
        "a text file, or a folder of .txt files"
    )


def _tokenize(text: bytes, tokenizer: str) -> tuple[torch.Tensor, int]:
    """Token ids of ``text`` with the Hugging Face tokenizer in a local folder."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(
            f"dataset.tokenizer={tokenizer}: a tokenizer needs the transformers package, which "
            "is not installed: pip install 'ampsweep[hf]', or leave dataset.tokenizer=null for "
            "bytes"
        ) from None
    try:
        folder = str(Path(tokenizer).expanduser())
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:
        raise ConfigError(
            f"dataset.tokenizer={tokenizer}: cannot load a tokenizer from it "
            f"({str(err).splitlines()[0]}): give a local folder saved with "
            "tokenizer.save_pretrained(...)"
        ) from None
    ids = tok(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long), len(tok)


@DATASETS.register("textfile", check=positive("seq_len"), task=LM)
def textfile(
    cfg: DatasetConfig,
    *,
    root: str = "data/text.txt",
    seq_len: int = 128,
    tokenizer: str | None = None,
) -> Splits:
    """A text file, or every .txt file of a folder (in path order), as one stream of tokens:
    bytes, or the ids of the Hugging Face tokenizer saved in the folder ``tokenizer``."""
    files = _text_files(root)
    data = b"\n".join(f.read_bytes() for f in files)
    if not data.strip():
        raise ConfigError(
            f"dataset.root={root}: the text is empty: point dataset.root at a file with text"
        )
    if tokenizer:
        tokens, vocab = _tokenize(data, tokenizer)
    else:
        tokens, vocab = _byte_tokens(data), BYTES
    info = {
        "text_files": len(files),
        "text_bytes": len(data),
        "text_sha256": hashlib.sha256(data).hexdigest(),
        "tokenizer": tokenizer or "bytes",
    }
    return text_splits(cfg, tokens, vocab, seq_len, f"dataset.root={root}", info)
