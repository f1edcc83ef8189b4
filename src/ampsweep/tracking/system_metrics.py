"""The machine's load while a run trains: MLflow's ``system/...`` metrics, sampled on a
background thread and logged through the run's own recorder (the UI's System metrics tab)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psutil

from ampsweep.tracking import store


class SystemMetrics:
    """The machine's load, sampled on a background thread with MLflow's own collectors (CPU
    and memory; disk and network; every GPU NVML sees, when ``nvidia-ml-py`` is installed and
    a driver answers) and logged as MLflow's ``system/...`` metrics, one step per sample.

    Unlike ``mlflow.start_run(log_system_metrics=True)`` it logs through the run's own
    buffered writer (no extra client polling the run), and takes a last sample when stopped,
    so a run shorter than the interval still has its point."""

    def __init__(self, log: Callable[[dict[str, float], int], None], interval: float, step=0):
        self.log, self.interval, self.step = log, interval, step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitors: list = []
        self._ready = threading.Event()

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
        self._monitors = _collectors()  # NVML's start-up, off the training thread
        while not self._stop.wait(self.interval):
            self._sample()
        self._sample()

    def _sample(self) -> None:
        values: dict[str, float] = {}
        for monitor in self._monitors:
            try:
                monitor.collect_metrics()
                values.update(monitor.aggregate_metrics())
            except Exception:  # noqa: S112 - one failed reading must not end sampling
                continue
            finally:
                monitor.clear_metrics()
        if values:
            self.log({store.SYSTEM_PREFIX + k: v for k, v in values.items()}, self.step)
            self.step += 1


def _collectors() -> list:
    """MLflow's collectors available here; the GPU's only where NVML starts."""
    # Imported here, on the sampler's thread, not at the top: the recorder imports this module
    # and app.job the recorder, and a run with tracking=none imports no MLflow at all
    # (scripts/bench_fixed_cost.py --startup, "tracking=none").
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    psutil.cpu_percent()  # the first reading only starts the count
    monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor  # needs nvidia-ml-py

        monitors.append(GPUMonitor())  # raises without nvidia-ml-py or without a GPU
    except Exception:
        pass
    return monitors
