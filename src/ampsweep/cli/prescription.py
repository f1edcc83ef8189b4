"""What ``ampsweep doctor`` finds and prescribes: a mode's ``Trial`` (how its training
ended, its score against fp32's, its non-finite steps), the ``Prescription`` written for a mode
that failed (and the experiment that verifies them all, ``write_experiment``), and the
``verdict`` on a prescription's run in the verifying sweep.

A prescription that changes the data (a regression's targets standardised) changes the score's
unit: every run of the verifying sweep, fp32 included, trains on the changed data, and its own
trial is compared with an fp32 trial on the same data."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampsweep.config.compose import override_key
from ampsweep.config.score import ACCURACY, Score, of_metrics
from ampsweep.measure.names import NONFINITE_STEPS
from ampsweep.precision import modes
from ampsweep.report.probe import autocast_mode
from ampsweep.tracking import store

if TYPE_CHECKING:  # named only: the doctor's trials import torch where they run
    from ampsweep.measure.replay import Origin

SKIP_RATE = 0.05  # a scaler skipping more than this share of steps is not just settling
# The steps a dynamic scaler skips while it backs off from its initial scale to one the
# gradients fit (GradScaler's 65536 halves to 256 in 8): ordinary, whatever the run's length
BACKOFF_STEPS = 8


def ordinary_backoff(skipped: float, steps: float) -> bool:
    """Whether ``skipped`` of ``steps`` is what a scaler skips as it settles: the backoff
    from its initial scale, then the rare probe of a higher one."""
    return skipped <= BACKOFF_STEPS + SKIP_RATE * steps


@dataclass
class Trial:
    mode: str
    overrides: list[str]  # the precision overrides it ran with
    status: str = "finished"  # finished | diverged | failed
    error: str = ""
    metric: Score = ACCURACY  # the task's score (val/acc, val/perplexity, ...)
    score: float | None = None
    nonfinite: int = 0
    steps: int = 0
    skipped: float = 0.0
    samples_per_s: float | None = None
    peak_mib: float | None = None  # its measured step's peak (mem/step_peak_mib)
    origin: Origin | None = None  # where its first non-finite value began

    @property
    def finite(self) -> bool:
        return self.status == "finished" and self.nonfinite == 0

    def held(self, base: Trial) -> bool:
        """Finite (a dynamic scaler's few early skips allowed) with the score within the
        report's tolerance of the baseline's."""
        settling = (
            self.steps
            and ordinary_backoff(self.skipped, self.steps)
            and self.nonfinite <= self.skipped
        )
        if self.status != "finished" or (self.nonfinite and not settling):
            return False
        if self.score is None or base.score is None:
            return self.score is None
        return self.metric.held(self.score, base.score)

    def result(self, base: Trial | None) -> str:
        if self.status == "diverged":  # the error's advice is the origin, said on its own
            return f"diverged: {self.error.split('): ', 1)[0]})"
        if self.status != "finished":
            return f"{self.status}: {self.error}"
        score = "no score" if self.score is None else f"{self.metric.name} {self.score:.4g}"
        if base is not None and base is not self and self.score is not None and base.score:
            change = self.metric.change(self.score, base.score)
            score += f" ({self.metric.show_change(change)} vs fp32)" if change is not None else ""
        bad = f", {self.nonfinite} non-finite step(s)" if self.nonfinite else ""
        return f"{score}{bad}"


@dataclass
class Prescription:
    mode: str  # the mode that failed
    problem: str  # what went wrong, with where
    precision: dict  # the precision section of the fix: name, keep_fp32, scaler, fp8.keep_bf16
    note: str = ""  # an alternative, or a caveat
    trial: Trial | None = None  # the prescription's own trial
    gate: str = ""  # an fp8 prescription's own numerics gate (cli.doctor_fp8), in words
    # overrides of the data (``dataset.standardize_targets=true``) that every run of the
    # verifying sweep takes, fp32 included, and the fp32 trial on that data (the reference)
    data: list[str] = field(default_factory=list)
    reference: Trial | None = None

    @property
    def option(self) -> str:
        return f"doctor_{self.mode}"

    @property
    def overrides(self) -> list[str]:
        out = [*self.data, f"precision={self.precision['name']}"]
        if self.precision.get("master_weights"):
            out.append("precision.master_weights=true")
        if self.precision.get("keep_fp32"):
            out.append(f"precision.keep_fp32=[{','.join(self.precision['keep_fp32'])}]")
        if self.precision.get("fp8", {}).get("keep_bf16"):
            out.append(f"precision.fp8.keep_bf16=[{','.join(self.precision['fp8']['keep_bf16'])}]")
        if "init_scale" in self.precision.get("scaler", {}):
            out.append(
                f"precision.scaler.init_scale={typed(self.precision['scaler']['init_scale'])}"
            )
        return out


def typed(x: float) -> str:
    """``16777216`` rather than ``1.67772e+07``: what a user would type."""
    return f"{x:.0f}" if float(x).is_integer() else f"{x:g}"


def choice_of(overrides: list[str], key: str) -> str:
    """The value ``overrides`` give ``key`` (``+key=`` too), or ""."""
    for o in overrides:
        if override_key(o) == override_key(key):
            return o.split("=", 1)[1]
    return ""


def verdict(run, failing, base, judge: Score | None = None) -> tuple[bool, str]:
    """Whether the prescription's run fixed the failure, in words with its speed; ``judge``:
    the task's score (default: the known score whose metric the fp32 run logged)."""
    if run is None or run.status != store.FINISHED:
        why = run.error if run is not None else "it did not run"
        return False, f"NOT fixed: {why}"
    s, b = run.summary, base.summary
    judge = judge or of_metrics(b) or ACCURACY
    metric = judge.name
    score, ref = s.get(metric), b.get(metric)
    nonfinite = int(s.get(NONFINITE_STEPS, 0))
    ok_score = isinstance(score, float) and math.isfinite(score) and isinstance(ref, float)
    if ok_score:
        ok_score = judge.held(score, ref)
    skipped, steps = float(s.get("amp/skipped_steps", 0)), float(s.get("train/steps", 1))
    finite = nonfinite == 0 or (nonfinite <= skipped and ordinary_backoff(skipped, steps))
    speed = ""
    rate, ref_rate = s.get("perf/samples_per_s"), b.get("perf/samples_per_s")
    if rate and ref_rate:
        speed = f"; {rate / ref_rate:.2f}x fp32's speed"
        if failing is not None and failing.summary.get("perf/samples_per_s"):
            speed += f", {rate / failing.summary['perf/samples_per_s']:.2f}x the failing mode's"
    shown = f"{metric} {score:.4g} vs fp32 {ref:.4g}" if ok_score or score else metric
    if finite and ok_score:
        return True, f"fixed: finite, {shown} ({judge.within()}){speed}"
    problem = f"{nonfinite} non-finite step(s)" if not finite else f"{shown}: not within fp32's"
    return False, f"NOT fixed: {problem}{speed}"


def fp32_advice(origin: Origin | None) -> str:
    """What to change when fp32 itself does not train, from where its failure began: the
    located origin's own fix (a divergence's learning rate, a broken module's code), else the
    usual first steps."""
    if origin is not None and origin.fix():
        kind = {"divergence": "a divergence", "computation": "a broken computation"}
        return f"{kind.get(origin.cause, 'where it began')}: {origin.fix()}"
    return "lower optimizer.lr, trainer.grad_clip=1.0, ..."


# ---------------------------------------------------------------- a pure mode

LOST_UPDATES = 0.5  # a layer losing more than half its updates in a pure mode needs fixing


def pure_fix(mode: str, t: Trial, base: Trial, lost: dict[str, float]) -> Prescription | None:
    """The fix for a pure mode (``lost``: the probe's share of each parameter's updates its
    weights' format rounds away, ``(all)`` the model's): where its trial stayed finite but
    lost the task's score, or a layer loses most of its updates, fp32 master weights
    (``precision.master_weights``), which keep every update; where it went non-finite, the
    autocast mode of its dtype, since master weights leave the format's range as it is (an
    fp16 overflow stays one). None where it held and no layer loses its updates."""
    m = modes.MODES[mode]
    autocast = autocast_mode(m.dtype)
    if not t.finite:
        where = f"; {t.origin.sentence()}" if t.origin is not None else ""
        note = f"autocast computes in {m.dtype} where it is safe and keeps fp32 weights"
        return Prescription(mode, f"{t.result(base)}{where}", {"name": autocast}, note)
    worst = sorted(((k, v) for k, v in lost.items() if k != "(all)"), key=lambda x: -x[1])
    if t.held(base) and not (worst and worst[0][1] > LOST_UPDATES):
        return None
    layers = ", ".join(f"{k} {v:.0%}" for k, v in worst[:3] if v > 0)
    if layers:
        why = f"{m.dtype} weights round away the updates of {layers}"
    else:  # finite, its score short of fp32's: what a pure mode adds to autocast's numerics
        share = f" ({lost['(all)']:.1%} of one probed step's)" if "(all)" in lost else ""
        why = f"finite, so not the range: {m.dtype} weights round away small updates{share}"
    problem = f"{t.result(base)}; {why} (smaller than half a unit in the weight's last place)"
    note = (
        f"fp32 copies of the weights and the optimizer's state in fp32 keep every update, as "
        f"much weight memory as fp32; or precision={autocast} (autocast, fp32 weights)"
    )
    if m.dtype == "bf16" and importlib.util.find_spec("torchao") is not None:
        note += "; or keep bf16 weights with torchao's AdamW(bf16_stochastic_round=True)"
    return Prescription(mode, problem, {"name": mode, "master_weights": True}, note)


def peak_cost(rx: Prescription, failing: Trial) -> str:
    """What the prescription's trial held at its step's peak against the failing mode's
    (``step peak 1.2 MiB, bf16_pure's 0.9 MiB``); "" where either measured none."""
    mine = rx.trial.peak_mib if rx.trial is not None else None
    if mine is None or failing.peak_mib is None:
        return ""
    return f"step peak {mine:.3g} MiB, {failing.mode}'s {failing.peak_mib:.3g} MiB"


# ---------------------------------------------------------------- a regression's targets

STANDARDIZE = "standardize_targets"  # a data set's setting: targets as (y - mean) / std


def standardising(dataset_args: dict) -> list[str]:
    """The override that standardises a regression's targets, where the data set has that
    setting and it is off; none where it has no such setting."""
    return [f"dataset.{STANDARDIZE}=true"] if dataset_args.get(STANDARDIZE) is False else []


def targets_advice(dataset: str) -> str:
    """What to do where the data set cannot standardise its targets itself."""
    return (
        f"dataset={dataset} has no {STANDARDIZE} setting: standardise the targets in the data "
        "set, (y - mean) / std with the training split's mean and std (a prediction is then "
        f"mean + std * output), or give it a {STANDARDIZE} argument, which the doctor "
        "prescribes and verifies"
    )


# ---------------------------------------------------------------- the experiment


def write_experiment(
    folder: Path, rx: list[Prescription], cfg, rest: list[str], experiment: str, name: str
) -> tuple[Path, str]:
    """Each prescription as a precision option, all as ``experiment=<name>`` (over the user's
    own ``experiment``, if any); its path and the command that launches it. A prescription's
    data overrides go to every run of the sweep, and its failing mode, which on that data is
    the prescription itself, is not run again."""
    from omegaconf import OmegaConf

    for p in rx:
        body = {
            "precision": p.precision,
            "tracking": {"run_name": f"{p.option}-{cfg.model.name}-{cfg.dataset.name}"},
        }
        lines = [f"{p.mode}: {p.problem}", f"the same as: {' '.join(p.overrides)}"]
        write_option(folder / "precision", p.option, body, cfg, lines)
    failing = dict.fromkeys(p.mode for p in rx if not p.data)
    swept = ["fp32", *failing, *(p.option for p in rx)]
    sweep: dict[str, Any] = {}
    data = [o for p in rx for o in p.data]
    if data:  # on every run: the score is compared on the same targets
        changed = OmegaConf.to_container(OmegaConf.from_dotlist(data))
        assert isinstance(changed, dict)  # dotted keys compose a mapping
        sweep = {str(k): v for k, v in changed.items()}
    about = "fp32, the modes that failed and their prescriptions"
    return write_sweep(folder, name, {"precision": swept}, sweep, rest, experiment, cfg, about)


def written_for(cfg) -> str:
    """What a written file says it was written for: when, and for which model and data."""
    return (
        f"written by ampsweep doctor ({datetime.now():%Y-%m-%d %H:%M}) for "
        f"model={cfg.model.name} on dataset={cfg.dataset.name}"
    )


def write_option(group: Path, option: str, body: dict, cfg, about: list[str]) -> Path:
    """``option`` of the config group in folder ``group``: ``body`` at the config's top
    (``@package _global_``), headed by what it is for (``about``: one line each)."""
    from omegaconf import OmegaConf

    group.mkdir(parents=True, exist_ok=True)
    lines = [f"{group.name}={option}: {written_for(cfg)}", *about]
    header = "# @package _global_\n" + "".join(f"# {line}\n" for line in lines)
    path = group / f"{option}.yaml"
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(body)))
    return path


def write_sweep(
    folder: Path,
    name: str,
    params: dict[str, list[str]],
    body: dict,
    rest: list[str],
    experiment: str,
    cfg,
    about: str,
) -> tuple[Path, str]:
    """``experiment=<name>``: ``body`` and the sweep of ``params`` (a key, its options), over
    the user's own ``experiment`` if any; its path and the command that launches it with the
    overrides ``rest``."""
    from omegaconf import OmegaConf

    (folder / "experiment").mkdir(parents=True, exist_ok=True)
    command = " ".join(
        ["ampsweep", "train", "-m", "--config-dir", str(folder), f"experiment={name}", *rest]
    )
    swept = {key: ",".join(options) for key, options in params.items()}
    sweep: dict[str, Any] = {**body, "hydra": {"sweeper": {"params": swept}}}
    if experiment:  # the user's experiment first, then this sweep over it
        sweep = {"defaults": [experiment, "_self_"], **sweep}
    header = (
        f"# @package _global_\n# experiment={name}: {written_for(cfg)}: {about}.\n"
        f"# Launch: {command}\n"
    )
    path = folder / "experiment" / f"{name}.yaml"
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(sweep)))
    return path, command


def launch(folder: Path, name: str, rest: list[str], key: str) -> tuple[int, dict[str, Any]]:
    """Run ``experiment=<name>`` of ``folder`` as ``ampsweep train -m`` runs it (a parent run
    with a child per job in MLflow, and the report): its exit code and its jobs' outcomes
    (``runner.context.JobOutcome``) by the option each had of the swept ``key``."""
    from ampsweep.cli.train import cmd_train
    from ampsweep.runner.context import CommandContext

    command = CommandContext()
    args = ["-m", "--config-dir", str(folder), f"experiment={name}", *rest]
    code = cmd_train(args, command)
    return code, {choice_of(o.overrides, key): o for o in command.outcomes}
