"""How a job is stopped: SIGTERM / Ctrl-C, and the scheduler's requeue signal before it
preempts a job or the job reaches its time limit (``StopRequest``); which SLURM job this is."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

from ampsweep import console


class StopRequest:
    """SIGTERM / Ctrl-C while a job runs, and the scheduler's warning before it preempts a
    job or the job reaches its time limit.

    While the training loop runs (``deferred``), the first signal only sets ``requested``: the
    loop sees it at the next step boundary, writes a checkpoint and raises Interrupted, so a
    signal never lands in the middle of an optimizer update. So is one that arrives while a
    run's end (FAILED, KILLED) is being recorded, which must not be cut short. Elsewhere, or on
    a second signal, SIGTERM / Ctrl-C raise KeyboardInterrupt at once. The job then ends KILLED
    and the command exits non-zero.

    ``requeue_signal`` (in a submitit SLURM job: USR2, which SLURM sends ``signal_delay_s``
    before the time limit or a preemption) is always deferred: the job stops at its next step
    boundary with a checkpoint (the first one, if it comes before training), its run ends
    KILLED, and ``hand_over`` gives the job back to submitit, which requeues it; the requeued
    job resumes the run from the checkpoint. Only rank 0 takes it, as only rank 0 requeues.
    """

    def __init__(self, requeue_signal: signal.Signals | None = None) -> None:
        self.requested = False
        self.requeue = False  # the scheduler will stop the job: checkpoint and requeue
        self.deferring = False
        self.requeue_signal = requeue_signal
        self._previous: dict = {}
        self._submitit_handler: Any = None

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signal.signal's rule
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            if self.requeue_signal is not None:
                previous = signal.signal(self.requeue_signal, self._handle_requeue)
                self._previous[self.requeue_signal] = self._submitit_handler = previous
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.deferring and not self.requested:
            self.requested = True
            console.error(f"{name}: stopping after this step, with a checkpoint")
            return
        raise KeyboardInterrupt(name)

    def _handle_requeue(self, signum, frame) -> None:
        if not self.requeue:
            console.error(
                f"{signal.Signals(signum).name}: SLURM will stop this job (preemption or its "
                "time limit): stopping after this step with a checkpoint, to be requeued"
            )
        self.requeue = self.requested = True

    def hand_over(self) -> str | None:
        """After the job stopped for the requeue signal: submitit's own handler pickles the
        task again, requeues the job (``scontrol requeue``) and exits (SystemExit). When it
        will not requeue (``max_num_timeout`` time limits reached) it says why: returned."""
        from submitit.core.utils import UncompletedJobError  # an optional extra (slurm)

        handler = self._submitit_handler
        if not callable(handler):
            return "no submitit handler to requeue the job"
        try:
            handler(self.requeue_signal, None)
        except UncompletedJobError as err:
            return str(err)
        return None

    @contextlib.contextmanager
    def deferred(self):
        """The first SIGTERM / Ctrl-C inside only sets ``requested``; a second one stops."""
        before, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = before


def job_id_from_env(environ=None) -> str | None:
    """This SLURM job's id as squeue shows it (``12_3`` for an array task), or None."""
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in env:
        return None
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def requeue_signal(environ=None) -> signal.Signals | None:
    """The signal SLURM sends a submitit job before preempting it or at its time limit
    (``--signal=USR2@<signal_delay_s>``; submitit's handler then requeues the job), or None
    outside a submitit SLURM job."""
    env = os.environ if environ is None else environ
    if env.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    return getattr(signal, "SIG" + env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
