"""app/signals.py: a stop request (SIGTERM / Ctrl-C) inside the training loop waits for the
step boundary, a second one or one outside the loop stops at once. (The requeue signal inside
a job: tests/unit/launch/test_slurm.py.)"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from ampsweep.runner.signals import StopRequest


def in_main_thread() -> None:
    # Signal handlers can only be installed (and signals only delivered) in the main thread.
    assert threading.current_thread() is threading.main_thread()


def test_a_second_signal_stops_at_once():
    in_main_thread()
    stop = StopRequest().install()
    try:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGTERM)  # the first: noted, honoured at the next step
            assert stop.requested
            with pytest.raises(KeyboardInterrupt, match="SIGINT"):
                os.kill(os.getpid(), signal.SIGINT)  # the second: at once
    finally:
        stop.uninstall()


def test_a_signal_outside_the_training_loop_stops_at_once():
    in_main_thread()
    stop = StopRequest().install()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert not stop.requested
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # uninstalled
