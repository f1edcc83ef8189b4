"""tracking/secrets.py: the values of secret-named environment variables are masked in text,
in values, and in the files uploaded as artifacts (text and names; charts left alone)."""

from __future__ import annotations

import os

from ampsweep.tracking import secrets


def test_values_are_masked(monkeypatch):
    secret = "s3cr3t-value-42"
    monkeypatch.setenv("MY_API_TOKEN", secret)
    monkeypatch.setenv("DB_PASSWORD", "hunter22")
    monkeypatch.setenv("SHORT_KEY", "1")  # too short to mask: it would hit every "1"
    monkeypatch.setenv("HOME_DIR", "/root")  # not a secret name
    masked = secrets.mask_values({"a": f"https://u:{secret}@host", "b": "hunter22", "c": 1})
    assert masked == {"a": "https://u:***@host", "b": "***", "c": "1"}
    assert secrets.mask_text("/root/x") == "/root/x"


def test_the_longest_secret_is_masked_first(monkeypatch):
    monkeypatch.setenv("A_TOKEN", "abcd")
    monkeypatch.setenv("B_SECRET", "abcdefgh")
    assert secrets.secret_values() == ["abcdefgh", "abcd"]
    assert secrets.mask_text("xabcdefghx abcd") == "x***x ***"  # not "x***efghx"


def test_files_are_masked_in_place_text_and_names(tmp_path, monkeypatch):
    secret = "s3cr3t-in-files"
    monkeypatch.setenv("MY_API_TOKEN", secret)
    (tmp_path / "hydra").mkdir()
    (tmp_path / "hydra" / "overrides.yaml").write_text(f"- tracking.run_name=run-{secret}\n")
    (tmp_path / "hydra" / f"note-{secret}.txt").write_text("plain\n")
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) + secret.encode()
    (tmp_path / "hydra" / "chart.png").write_bytes(png)
    secrets.mask_files(tmp_path / "hydra")
    names = sorted(p.name for p in (tmp_path / "hydra").iterdir())
    assert names == ["chart.png", "note-***.txt", "overrides.yaml"]
    assert (tmp_path / "hydra" / "overrides.yaml").read_text() == "- tracking.run_name=run-***\n"
    assert (tmp_path / "hydra" / "chart.png").read_bytes() == png  # binary: as it was


def test_a_masked_copy_leaves_the_original_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("DB_PASSWORD", "hunter22")
    original = tmp_path / "config.yaml"
    original.write_text("uri: postgresql://u:hunter22@db\n")
    (tmp_path / "out").mkdir()
    copy = secrets.masked_copy(original, tmp_path / "out")
    assert copy == tmp_path / "out" / "config.yaml"
    assert copy.read_text() == "uri: postgresql://u:***@db\n"
    assert original.read_text() == "uri: postgresql://u:hunter22@db\n"


def test_nothing_to_mask_without_secrets(tmp_path, monkeypatch):
    for name in list(os.environ):
        if any(word in name.upper() for word in secrets.SECRET_WORDS):
            monkeypatch.delenv(name)
    (tmp_path / "a.txt").write_text("keep me\n")
    secrets.mask_files(tmp_path)
    assert (tmp_path / "a.txt").read_text() == "keep me\n"


def test_a_masked_stream_masks_every_write(monkeypatch, capsys):
    monkeypatch.setenv("MY_API_TOKEN", "s3cr3t-stream")
    stream = secrets.MaskedStream("stdout")
    stream.write("error: dataset.root=/data/nonexist-s3cr3t-stream\n")
    stream.flush()
    assert capsys.readouterr().out == "error: dataset.root=/data/nonexist-***\n"


def test_a_name_holding_a_secret_is_refused_by_the_variable_it_came_from(monkeypatch):
    monkeypatch.setenv("MY_API_TOKEN", "s3cr3t-name")
    problem = secrets.refuse_in_name("tracking.experiment", "exp-s3cr3t-name")
    assert problem.startswith("tracking.experiment=exp-***: holds the value of the secret ")
    assert "MY_API_TOKEN" in problem and "s3cr3t-name" not in problem
    assert secrets.refuse_in_name("tracking.experiment", "exp-plain") is None
