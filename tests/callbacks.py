"""Callbacks that tests name in ``trainer.callbacks`` (this folder is on the path of in-process
tests, and ``conftest.callback_env`` puts it on a subprocess's PYTHONPATH).

``SignalAtStep`` stops a run at a known step, so the kill and resume tests never race a clock;
``signal_at_step`` writes the override that asks for it. ``RecordSteps`` writes the steps it
saw, and ``NoHooks`` is a class that is not a callback."""

from __future__ import annotations

import json
import os
import signal as signals
import sys
from pathlib import Path

from ampsweep.engine.loop import Callback


class SignalAtStep(Callback):
    """Send ``signal`` to this process right after optimizer step ``step``; only in job
    ``job`` of a sweep and on rank ``rank`` of a DDP group, when they are given."""

    def __init__(self, step: int, signal: str, job: int | None = None, rank: int | None = None):
        self.step, self.signal = step, signals.Signals[signal]
        self.chosen = (job is None or job == job_num()) and (rank is None or rank == rank_num())

    def after_step(self, state) -> None:
        if self.chosen and state.step == self.step:
            os.kill(os.getpid(), self.signal)


def job_num() -> int | None:
    """This job's number in a sweep (Hydra's runtime), None outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return HydraConfig.get().job.num


def rank_num() -> int:
    """This process's rank in a DDP group (torchrun sets RANK), 0 without one."""
    return int(os.environ.get("RANK", "0"))


def signal_at_step(step: int, signal: str, job: int | None = None, rank: int | None = None):
    """The override that makes a run signal itself at ``step`` (see SignalAtStep)."""
    args = {"step": step, "signal": signal, "job": job, "rank": rank}
    given = "".join(f", {k}: {v}" for k, v in args.items() if v is not None)
    return f"trainer.callbacks=[{{_target_: callbacks.SignalAtStep{given}}}]"


class RecordSteps(Callback):
    """Append each step to ``path`` as a JSON line: what it saw before the update (the step
    and whether the module's gradients are there), then the step after it."""

    def __init__(self, path: str):
        self.path = Path(path)

    def before_update(self, view) -> None:
        grads = all(p.grad is not None for p in view.module.parameters() if p.requires_grad)
        self._write({"before_update": view.step, "grads": grads})

    def after_step(self, state) -> None:
        self._write({"after_step": state.step})

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class RecordDtypes(Callback):
    """Append, per step and rank, the dtype of each named module's output to ``path`` (JSON
    lines): what precision.keep_fp32 changes, as every rank of a DDP run sees it."""

    def __init__(self, path: str, modules: list[str]):
        self.path, self.modules = Path(path), list(modules)
        self.seen: dict[str, str] = {}
        self.hooked = False

    def before_update(self, view) -> None:
        if not self.hooked:  # from the next step's forward pass on
            for name in self.modules:
                view.module.get_submodule(name).register_forward_hook(
                    lambda m, a, out, name=name: self.seen.__setitem__(name, str(out.dtype))
                )
            self.hooked = True
        elif self.seen:
            record = {"rank": rank_num(), "step": view.step, **self.seen}
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


class RecordImports(Callback):
    """Append, once per rank, which of ``modules`` that rank's process has imported to ``path``
    (JSON lines): what each rank of a DDP run loaded to train."""

    def __init__(self, path: str, modules: list[str]):
        self.path, self.modules, self.done = Path(path), list(modules), False

    def after_step(self, state) -> None:
        if not self.done:
            loaded = {name: name in sys.modules for name in self.modules}
            with self.path.open("a") as f:
                f.write(json.dumps({"rank": rank_num(), **loaded}) + "\n")
            self.done = True


class NoHooks:
    """A class without the hooks ``fit`` calls."""

    def __init__(self, every: int = 1):
        self.every = every
