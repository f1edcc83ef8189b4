"""The Python API: ``ampsweep.train`` and ``ampsweep.sweep`` for notebooks and scripts.

Both run the ``ampsweep train`` command itself (``cli.train.cmd_train``) with a
``CommandContext`` that collects the jobs' outcomes, so a run started from Python is composed,
checked, trained and recorded exactly as from the command line (the same MLflow runs, tags,
artifacts, sweep parent and report). What differs is the answer: a result object instead of
an exit code, and an exception where the command would exit non-zero before training.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ampsweep.config.schema import ConfigError
from ampsweep.config.score import Score, of_metrics
from ampsweep.report.model import Recommendation
from ampsweep.runner.context import CommandContext, JobOutcome
from ampsweep.tracking import store


class TrainError(RuntimeError):
    """A run that started but did not finish (it is recorded FAILED or KILLED).

    Its message is ``"<run name> ended <status>: <reason>"``; ``outcome`` holds the job's
    outcome (``run_id``, ``status``, ``error``, ``summary``) for a closer look."""

    def __init__(self, outcome: JobOutcome):
        super().__init__(f"{outcome.name} ended {outcome.status}: {outcome.error}")
        self.outcome = outcome


@dataclass
class TrainResult:
    """One finished run.

    Attributes:
        run_id: its MLflow run id (``None`` with ``tracking=none``): open it with
            ``mlflow.get_run``, load its model from ``runs:/<run_id>/model``.
        name: its run name, ``<precision>-<model>-<dataset>`` unless ``tracking.run_name``.
        summary: the final numbers, as in its ``summary.json``: ``val/loss``, ``val/acc`` (or
            ``val/perplexity``), ``perf/samples_per_s``, ``mem/activation_mib``, ...
    """

    run_id: str | None  # None with tracking=none
    name: str
    summary: dict[str, float]  # the final numbers: val/loss, val/acc or val/perplexity, perf/...
    # What training logged, per metric: (optimizer step, value) in order (train/loss at each
    # log step, val/* at each evaluation, amp/loss_scale, ...); with tracking=none too
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # The config as it ran, as plain nested data (``config["precision"]["name"]``)
    config: dict = field(default_factory=dict)

    def curve(self, metric: str) -> tuple[list[int], list[float]]:
        """The steps and values of one metric, ready to plot: ``plt.plot(*r.curve("val/acc"))``.

        Raises:
            ValueError: the run logged no point of ``metric``, with why and what to set (too
                few steps for ``trainer.log_every``, or a metric it never logs).
        """
        points = self.history.get(metric, [])
        if not points:
            raise ValueError(self._no_points(metric))
        return [s for s, _ in points], [v for _, v in points]

    def _no_points(self, metric: str) -> str:
        trainer = self.config.get("trainer", {})
        steps, every = self.summary.get("train/steps"), trainer.get("log_every")
        if metric.startswith("train/") and steps is not None and every and steps < every:
            return (
                f"{metric}: no point logged: the run trained {int(steps)} steps and logs "
                f"every {every} (trainer.log_every): set trainer.log_every={max(1, int(steps))}"
            )
        logged = ", ".join(sorted(self.history)) or "none"
        return f"{metric}: this run logged no such metric; it logged: {logged}"

    @property
    def score(self) -> Score | None:
        """The task's score and how it is judged (with the run's ``task.tolerance``): its value
        is ``summary[r.score.name]``; ``r.score.held(r.summary[...], other.summary[...])``
        says whether it held against another run's. None for a score the run did not log."""
        found = of_metrics(self.summary)
        tolerance = self.config.get("task", {}).get("tolerance")
        if found is None or tolerance is None:
            return found
        return replace(found, tolerance=float(tolerance))


@dataclass
class SweepResult:
    """A sweep and its report, as ``ampsweep report`` reads it from the store.

    Attributes:
        parent_run_id: the sweep's MLflow parent run, which holds the report and the charts.
        rows: one ``report.model.Row`` per child run, compared with the baseline mode
            (``precision``, ``val_acc``, ``speedup``, ``status``, ...; ``score``: the task's
            score each is judged by, ``quality`` its value).
        findings: the report's findings, one plain sentence each.
        runs: the jobs that finished in this call (skipped jobs' runs are in ``rows``).
        recommendation: the mode to use and why, with its command, or the open question and
            the run that would answer it (the report's first line).
    """

    parent_run_id: str
    rows: list  # report.model.Row: one per child run, compared with the baseline mode
    findings: list[str]
    runs: list[TrainResult] = field(default_factory=list)  # the jobs that finished here
    # The mode to use and why, with the command (or the open question and the run that would
    # answer it): report.model.Recommendation, the report's first line
    recommendation: Recommendation | None = None
    # One row per configuration and mode, repeats summarised (means, 95% intervals in ``ci``);
    # the same as ``rows`` when nothing was repeated
    summary: list = field(default_factory=list)


def train(overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> TrainResult:
    """Train one configuration, as ``ampsweep train [--config-dir DIR] OVERRIDES``.

    The run is composed, checked, trained and recorded exactly as from the command line.

    Args:
        overrides: Hydra overrides, e.g. ``["precision=bf16", "trainer.epochs=3"]``.
        config_dir: a config folder of your own (``--config-dir``), whose group files sit
            beside ampsweep's (``conf/model/my_net.yaml`` for ``model=my_net``).

    Returns:
        The finished run: its MLflow run id, name and final numbers.

    Raises:
        ConfigError: the command is refused before it runs (one line: the key, the value
            and the fix).
        TrainError: the run failed (recorded FAILED, with the reason in its ``error`` tag).
    """
    command = CommandContext()
    code, printed = _run(_args(overrides, config_dir), command)
    if not command.outcomes:
        raise ConfigError(_last_error(printed, code))
    outcome = command.outcomes[-1]
    if outcome.status != store.FINISHED:
        if outcome.exit_code == 2 and outcome.run_id is None:
            raise ConfigError(outcome.error or _last_error(printed, code))
        raise TrainError(outcome)
    return _result(outcome)


def sweep(
    overrides: Sequence[str] = (), config_dir: str | Path | None = None, baseline: str = "fp32"
) -> SweepResult:
    """Run a sweep, as ``ampsweep train -m [--config-dir DIR] OVERRIDES``: one MLflow parent
    run with a child per job, and its report.

    Args:
        overrides: Hydra overrides with sweeps in them, e.g. ``["experiment=precision_sweep"]``
            or ``["precision=fp32,bf16", "sweep.repeats=3"]``.
        config_dir: a config folder of your own (``--config-dir``).
        baseline: the mode every row is compared with.

    Returns:
        The parent run id, the report's recommendation, rows and findings (failed jobs are
        rows with their status and error).

    Raises:
        ConfigError: the command is refused before it runs, or tracking is off (a sweep's
            report is read back from MLflow).
    """
    from ampsweep.report.sweeps import build_report

    command = CommandContext()
    code, printed = _run(["-m", *_args(overrides, config_dir)], command)
    if command.sweep is None:
        raise ConfigError(
            _last_error(printed, code)
            if code
            else "ampsweep.sweep: this sweep was not recorded (tracking=none): a sweep's "
            "report is read from MLflow: use tracking=mlflow, or ampsweep.train per job"
        )
    info = command.sweep
    report = build_report(store.client_for(info.uri), info.parent_run_id, baseline)
    runs = [_result(o) for o in command.outcomes if o.status == store.FINISHED]
    return SweepResult(
        info.parent_run_id,
        report.rows,
        report.findings,
        runs,
        report.recommendation,
        report.summary,
    )


def _result(outcome: JobOutcome) -> TrainResult:
    return TrainResult(
        outcome.run_id, outcome.name, outcome.summary, outcome.history, outcome.config
    )


def _args(overrides: Sequence[str], config_dir: str | Path | None) -> list[str]:
    if isinstance(overrides, str):
        raise TypeError("overrides: give a list of strings, e.g. ['precision=fp16']")
    where = ["--config-dir", str(Path(config_dir).expanduser().resolve())] if config_dir else []
    return [*where, *overrides]


def _run(args: list[str], command: CommandContext) -> tuple[int, str]:
    """Run the train command; its exit code and what it printed on stderr (which still
    reaches the caller's stderr as it is printed)."""
    from ampsweep.cli.train import cmd_train

    tee = _Tee(sys.stderr)
    with contextlib.redirect_stderr(tee):
        code = cmd_train(args, command)
    return code, tee.seen.getvalue()


def _last_error(printed: str, code: int) -> str:
    lines = [ln.removeprefix("error: ") for ln in printed.splitlines() if ln.startswith("error:")]
    return lines[-1] if lines else f"ampsweep train exited with code {code}"


class _Tee(io.TextIOBase):
    def __init__(self, stream):
        self.stream, self.seen = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.seen.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False
