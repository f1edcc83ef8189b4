"""The machine's load while a run trains: MLflow's ``system/...`` metrics, sampled on a
background thread and logged through the run's own recorder (the UI's System metrics tab)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ampsweep.tracking import store


class SystemMetrics:
    """The machine's load, sampled every ``interval`` seconds on a background thread with
    MLflow's own collectors (CPU and memory; disk and network; every GPU NVML sees, when
    ``nvidia-ml-py`` is installed and a driver answers) and logged as MLflow's ``system/...``
    metrics, one step per sample.

    Unlike ``mlflow.start_run(log_system_metrics=True)`` it logs through the run's own
    buffered writer (no extra client polling the run), and takes a last sample when stopped,
    so a run shorter than the interval still has its point."""

    def __init__(
        self, log: Callable[[dict[str, float], int], None], interval: float, step: int = 0
    ):
        self.log, self.interval, self.step = log, interval, step
        self._monitors: list = []
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
        try:  # NVML's start-up and the first CPU count, off the training thread
            self._monitors = collectors()
        except Exception:  # no reading must end the run
            self._monitors = []
        while not self._stop.wait(self.interval):
            self._sample()
        self._sample()

    def _sample(self) -> None:
        values = read(self._monitors)
        if values:
            self.log({store.SYSTEM_PREFIX + k: v for k, v in values.items()}, self.step)
            self.step += 1


def collectors() -> list:
    """MLflow's collectors available here; the GPU's only where NVML starts."""
    import psutil
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


def read(monitors: list) -> dict[str, float]:
    """One sample of the machine's load from ``monitors``, by MLflow's names."""
    values: dict[str, float] = {}
    for monitor in monitors:
        try:
            monitor.collect_metrics()
            values.update(monitor.aggregate_metrics())
        except Exception:  # noqa: S112 - one failed reading must not end sampling, nor the run
            continue
        finally:
            monitor.clear_metrics()
    return values
