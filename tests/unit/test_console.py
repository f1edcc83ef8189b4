"""app/console.py: the progress bar users see by default at a terminal (none in a log file),
the run summary, and one-line errors."""

from __future__ import annotations

import io
import sys

import pytest
from rich.console import Console

from ampsweep import console
from ampsweep.config import compose as config
from ampsweep.engine import build as train
from ampsweep.engine import loop


@pytest.fixture
def terminal(monkeypatch) -> io.StringIO:
    """The console writing to a fake terminal; what it shows."""
    screen = io.StringIO()
    fake = Console(file=screen, force_terminal=True, width=120, highlight=False)
    monkeypatch.setattr(console, "console", fake)
    return screen


def test_the_bar_is_shown_only_at_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert isinstance(console.progress_bar(True), loop.NoProgress)  # a log file: no bar
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert isinstance(console.progress_bar(True), console.EpochProgress)
    assert isinstance(console.progress_bar(False), loop.NoProgress)  # trainer.progress=false


def test_the_bar_follows_each_epoch_of_a_run(terminal, quick):
    cfg = config.load(
        [*quick, "tracking=none", "model=mlp", "precision=fp16", "trainer.epochs=2",
         "trainer.batch_size=256", "trainer.max_steps=-1", "trainer.log_every=1"]
    )  # fmt: skip
    bar = console.EpochProgress()
    loop.fit(train.build(cfg), lambda m, s: None, progress=bar)
    shown = terminal.getvalue()
    assert "epoch 1/2" in shown and "epoch 2/2" in shown
    assert "5/5" in shown  # 5 steps an epoch: each bar ends full
    assert "loss " in shown and "ms/step" in shown and "scale 65536" in shown
    assert bar._progress is None  # every bar was stopped


def test_a_bar_updated_before_it_started_shows_nothing(terminal):
    console.EpochProgress().update(3, {"train/loss": 1.0}, None)
    assert terminal.getvalue() == ""


def test_the_summary_shows_what_was_measured(terminal):
    summary = {
        "val/acc": 0.9812, "val/loss": 0.07, "perf/samples_per_s": 5123.4,
        "perf/step_time_ms": 12.5, "mem/activation_mib": 2.31, "mem/peak_rss_mib": 812.0,
        "amp/skipped_steps": 2.0, "amp/loss_scale": 16384.0, "perf/wall_s": 3.2,
    }  # fmt: skip
    console.print_summary("fp16-cnn-digits finished", summary, "MLflow run abc in x.db")
    shown = terminal.getvalue()
    for text in ("fp16-cnn-digits finished", "0.9812", "5123.4", "12.50 ms", "2.31 MiB",
                 "final loss scale", "16384", "MLflow run abc in x.db"):  # fmt: skip
        assert text in shown, text
    assert "peak CUDA" not in shown  # a CPU run


def test_an_error_is_one_line_on_stderr(capsys):
    console.error("trainer.epochs=ten: expected an integer " + "x" * 200)
    err = capsys.readouterr().err
    assert err.startswith("error: trainer.epochs=ten") and err.count("\n") == 1


def test_an_error_that_looks_like_markup_is_printed_as_it_is(capsys):
    message = "RuntimeError: [/pytorch/third_party/gloo/pair.cc:545] Connection closed by peer [b]"
    console.error(message)
    assert capsys.readouterr().err == f"error: {message}\n"
