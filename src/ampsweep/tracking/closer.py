"""Ending runs after their training: logging the model, linking its metrics, registering it,
ending the run, in the order the runs were handed over, at once or on one background thread
(an in-process sweep: the next job trains while the last one's model is written)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class RunCloser:
    """Finishes runs (log the model, link its metrics, register it, end the run) after their
    training, in order, either at once or, with ``background``, on one background thread: in
    an in-process sweep the next job then trains while the last one's model is written. A run
    is FINISHED only once all of it is recorded; ``wait`` returns when every run handed over
    has ended. Pickled (a launcher running jobs in other processes), it finishes at once."""

    def __init__(self, background: bool = False):
        self.background = background
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, finish: Callable[[], None]) -> None:
        if not self.background:
            finish()
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ampsweep-close")
        self._pending.append(self._executor.submit(finish))

    def wait(self) -> None:
        """Until every run handed over has ended (each ``finish`` reports its own errors)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def __getstate__(self) -> dict:
        return {"background": False, "_executor": None, "_pending": []}
