"""app/cli.py: the ``ampsweep`` command's parser, help and version, and the report command's
one-line errors (in this process: ``cli.main``)."""

from __future__ import annotations

import pytest

from ampsweep.cli import main as cli


def test_no_arguments_prints_usage(main):
    result = main()
    assert result.code == 2 and "usage: ampsweep" in result.out


def test_help_lists_every_command(main):
    result = main("--help")
    assert result.code == 0
    for command in ("train", "report", "reproduce", "ui"):
        assert command in result.out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("ampsweep ")


def test_train_help_is_hydras_and_writes_nothing(tmp_path, main):
    result = main("train", "--help")
    assert result.code == 0, result.err
    assert "precision" in result.out and "Traceback" not in result.err
    assert not (tmp_path / "outputs").exists()  # help writes nothing


def test_report_says_what_is_missing_in_one_line(tmp_path, store_uri, main):
    missing = f"sqlite:///{tmp_path / 'nowhere.db'}"
    result = main("report", "--tracking-uri", missing)
    assert result.code == 2
    assert "no MLflow store at" in result.err and "Traceback" not in result.err
    assert not (tmp_path / "nowhere.db").exists()  # a report never creates a store
    result = main("report", "--tracking-uri", store_uri)  # a store, but empty
    assert result.code == 2 and "no sweep with runs in this store" in result.err
    result = main("report", "--baseline", "fp8")
    assert result.code == 2 and "--baseline fp8: not a precision mode" in result.err
    result = main("report", "--tracking-uri", store_uri, "--sweep", "0123456789abcdef")
    assert result.code == 2 and "--sweep 0123456789abcdef: no such run" in result.err
    result = main("report", "--tracking-uri", store_uri, "--experiment", "nope")
    assert result.code == 2 and "--experiment nope: no such experiment" in result.err
    assert len(result.err.strip().splitlines()) == 1


def test_reproduce_unknown_run_is_one_line(store_uri, main):
    result = main("reproduce", "0123456789abcdef", f"tracking.uri={store_uri}")
    assert result.code == 2
    assert "no such run in the store" in result.err and "Traceback" not in result.err
    assert len(result.err.strip().splitlines()) == 1
