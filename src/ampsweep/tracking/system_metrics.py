"""The machine's load while a run trains: MLflow's ``system/...`` metrics, sampled on a
background thread and logged through the run's own recorder (the UI's System metrics tab)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from ampsweep.tracking import store


class SystemMetrics:
    """The machine's load, sampled every ``interval`` seconds on a background thread with
    MLflow's own collectors (``mlflow_calls.sample_system``, in the process where MLflow is
    imported: the recorder host of a tracked run) and logged as MLflow's ``system/...``
    metrics, one step per sample.

    Unlike ``mlflow.start_run(log_system_metrics=True)`` it logs through the run's own
    buffered writer (no extra client polling the run), and takes a last sample when stopped,
    so a run shorter than the interval still has its point. ``read()``: one sample (the first
    call starts the collectors and returns nothing); ``done()``: the collectors are no longer
    needed."""

    def __init__(self, log: Callable[[dict[str, float], int], None], interval: float,
                 read: Callable[[], dict[str, float]], done: Callable[[], None],
                 step: int = 0):  # fmt: skip
        self.log, self.interval, self.step = log, interval, step
        self.read, self.done = read, done
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ampsweep-system", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        try:
            self._read()  # NVML's start-up and the first CPU count, off the training thread
            while not self._stop.wait(self.interval):
                self._sample()
            self._sample()
        finally:
            with contextlib.suppress(Exception):
                self.done()

    def _read(self) -> dict[str, float]:
        try:
            return self.read()
        except Exception:  # a failed reading must not end sampling, nor the run
            return {}

    def _sample(self) -> None:
        values = self._read()
        if values:
            self.log({store.SYSTEM_PREFIX + k: v for k, v in values.items()}, self.step)
            self.step += 1
