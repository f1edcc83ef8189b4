"""tracking/closer.py: runs ended in the order they were handed over, on a background thread
where the command waits for them, and at once in a process a launcher pickled the closer to."""

from __future__ import annotations

import pickle
import threading
import time

from ampsweep.tracking.closer import RunCloser


def test_a_closer_in_the_background_ends_runs_in_order_and_waits_for_them():
    closer = RunCloser(background=True)
    done, started = [], threading.Event()

    def slow():
        started.wait(5)
        time.sleep(0.2)
        done.append("first")

    closer.submit(slow)
    closer.submit(lambda: done.append("second"))
    assert done == []  # submit returned at once
    started.set()
    closer.wait()
    assert done == ["first", "second"]


def test_a_closer_sent_to_another_process_ends_runs_at_once():
    closer = pickle.loads(pickle.dumps(RunCloser(background=True)))
    done = []
    closer.submit(lambda: done.append(1))
    assert done == [1] and not closer.background
