"""``ampsweep doctor [--modes M,...] [--verify] [--config-dir DIR] [OVERRIDES]``: when a
precision mode fails on a model, say where and why, write the fix as config, and prove it.

1. **Probe** (``measure.probe``): a few micro-batches at fp32 with hooks on every module,
   held against each format's range: the modules that overflow fp16's forward pass, the
   share of the gradient fp16 loses without loss scaling and the scale that keeps it, the
   updates a pure half-precision model would round away.
2. **Trials**: the configuration trained (untracked, as configured: ``trainer.max_steps`` sets
   the length) in fp32 and in each mode, each with the non-finite locator
   (``measure.numerics``): where a mode's first inf/NaN began, and whether its score (the
   task's: accuracy, perplexity) held against fp32's.
3. **Prescriptions**, one per mode that failed or lost quality: ``precision.keep_fp32`` for a
   module that overflows or whose half-precision kernel fails (tried again, adding modules
   until the trial is finite, at most ``ROUNDS`` times), a loss scale for fp16 that flushes
   gradients, fp32 master weights for a pure one that lost its score or its updates (the
   autocast mode for one that went non-finite), standardised targets for a regression whose
   head overflowed with large targets (the sweep then trains fp32 on them too). Each is
   written as a precision option (``precision/doctor_<mode>.yaml``) and all of them as one
   experiment (``experiment/doctor.yaml``) under the user's ``--config-dir`` (else
   outputs/doctor/conf).
4. ``--verify``: that experiment launched as one sweep (fp32, each failing mode and each
   prescription: a parent run with its children, and the report), then a verdict for each
   prescription: fixed (finite, its score within the task's tolerance of fp32's) or not, and
   its speed.

What a trial found and the prescription's verdict: ``cli.prescription``. ``cli.main`` imports
this module to build every command's parser, so what only the doctor needs (Hydra's compose,
torch through the engine and the probe, OmegaConf, the train command) is imported in the
methods that use it.
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

from rich.markup import escape

from ampsweep import console
from ampsweep.cli import doctor_memory
from ampsweep.cli.doctor_fp8 import Fp8Gatekeeper, launch_settings
from ampsweep.cli.prescription import (
    Prescription,
    Trial,
    fp32_advice,
    launch,
    peak_cost,
    pure_fix,
    standardising,
    targets_advice,
    typed,
    verdict,
    write_experiment,
)
from ampsweep.config.compose import override_key
from ampsweep.config.schema import ConfigError
from ampsweep.measure.capacity import STEP_PEAK
from ampsweep.precision import modes
from ampsweep.tracking import store

ROUNDS = 3  # keep_fp32 refinements: each adds the module the last trial named
PROBE_BATCHES = 2
EXPERIMENT = "doctor"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="find where a precision mode fails on this model and prescribe the fix",
        description="Probe every module's value ranges at fp32, train the configuration in "
        "each precision mode with the non-finite locator, and prescribe a config for each mode "
        "that failed or lost quality (written as an experiment); --verify runs fp32, the "
        "failing modes and the prescriptions as one sweep and says whether each fixed it.",
    )
    p.add_argument(
        "--modes",
        help="modes to examine, comma-separated (default: the "
        "precision=... override if given, else every half-precision mode this "
        "device runs)",
    )
    p.add_argument("--verify", action="store_true", help="run the prescriptions as a sweep")
    p.add_argument(
        "--memory",
        action="store_true",
        help="what each mode saves of a training step's peak, why, and what shrinks it "
        "(--modes default: bf16; with --verify, the prescriptions run as a sweep, each judged "
        "by its run's step peak)",
    )
    p.add_argument(
        "--config-dir",
        "-cd",
        help="your config folder (also where the "
        "prescriptions are written; default outputs/doctor/conf)",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(func=cmd_doctor)


def say(text: str, bold: str = "") -> None:
    """A line at the console; ``bold`` (plain text) leads it. Nothing in it is markup: module
    names and overrides are full of brackets."""
    lead = f"[bold]{escape(bold)}[/]" if bold else ""
    console.console.print(lead + escape(text))


# ---------------------------------------------------------------- the command


def cmd_doctor(args: argparse.Namespace) -> int:
    try:
        doc = Doctor(list(args.overrides), args.config_dir, args.modes)
        if args.memory:  # cli.doctor_memory: the memory examination, on the same config
            return doctor_memory.run(doc, args, say)
        return doc.run(args.verify)
    except ConfigError as err:
        console.error(str(err))
        return 2


class Doctor:
    def __init__(self, overrides: list[str], config_dir: str | None, modes_arg: str | None):
        from ampsweep.config.compose import search_entry
        from ampsweep.config.sweeps import expand_sweep

        for o in overrides:
            if len(expand_sweep([o])) > 1:
                raise ConfigError(
                    f"{o}: ampsweep doctor examines one configuration: give one value (the "
                    "modes to examine go in --modes)"
                )
        self.search = [search_entry(config_dir)] if config_dir else []
        self.folder = Path(config_dir).expanduser() if config_dir else Path("outputs/doctor/conf")
        given = [o for o in overrides if o.split("=", 1)[0].lstrip("+") == "precision"]
        # precision.* settings (keep_fp32, the scaler's) are for the modes examined: fp32, the
        # baseline, runs without them (keep_fp32 would mean nothing there)
        self.tuning = [o for o in overrides if o.lstrip("+").startswith("precision.")]
        self.rest = [o for o in overrides if o not in given and o not in self.tuning]
        self.modes = self._modes(modes_arg, given)

    def _modes(self, modes_arg: str | None, given: list[str]) -> list[str]:
        if modes_arg:
            names = [m.strip() for m in modes_arg.split(",") if m.strip()]
        elif given:
            names = [given[-1].split("=", 1)[1]]
        else:
            names = [m.name for m in modes.MODES.values() if m.half and not m.fp8]
        unknown = [n for n in names if n not in modes.MODES or n == modes.BASELINE]
        if unknown:
            choices = ", ".join(m for m in modes.MODES if m != modes.BASELINE)
            raise ConfigError(
                f"--modes {','.join(names)}: {unknown[0]} is not a mode to "
                f"examine: choose from {choices}"
            )
        return names

    def run(self, verify: bool) -> int:
        from ampsweep.engine.build import preflight, select_device

        base_cfg = self._load(["precision=fp32"])
        device = select_device(base_cfg.trainer.device)
        runnable = [m for m in self.modes if device.type in modes.MODES[m].devices]
        preflight([self._load(self._precision(m)) for m in runnable])  # every refusal first
        for m in sorted(set(self.modes) - set(runnable)):
            console.note(
                f"{m} does not run on {device.type}: left out (its fix: "
                f"precision={modes.MODES[m].fallback})"
            )
        label = f"{base_cfg.model.name} on {base_cfg.dataset.name}, {device.type}"
        say(f": {label}; modes: {', '.join(runnable)}", bold="ampsweep doctor")
        found = self._probe(base_cfg)
        base = self.trial("fp32", ["precision=fp32"])
        say(f"  fp32: {base.result(None)}")
        if not base.finite:
            if base.origin is not None:  # where fp32's own failure began, and its kind
                say(f"    {base.origin.sentence()}")
            raise_or = "--verify needs it" if verify else "nothing to compare with"
            console.error(
                f"fp32 itself does not train on this config ({base.result(None)}): {raise_or}: "
                f"fix the config first ({fp32_advice(base.origin)})"
            )
            return 1
        trials = {m: self.trial(m, self._precision(m)) for m in runnable}
        for m, t in trials.items():
            state = "held" if t.held(base) else "FAILED"
            say(f"  {m}: {state}: {t.result(base)}")
            if t.origin is not None:
                say(f"    {t.origin.sentence()}")
        rx = [p for m, t in trials.items() if (p := self.prescribe(m, t, base, found))]
        self._say_safe(trials, base, found)
        if not rx:
            failed = [m for m, t in trials.items() if not t.held(base)]
            if failed:  # each said why above: not something a precision setting fixes
                say(f"{', '.join(failed)} failed, and no precision setting fixes it: nothing "
                    "to prescribe.")  # fmt: skip
                return 1
            say(f"No mode failed or lost {base.metric.label}: nothing to prescribe.")
            return 0
        say("prescriptions:", bold="")
        for p in rx:
            note = f" ({p.note})" if p.note else ""
            say(f": {' '.join(p.overrides)}{note}", bold=f"  {p.mode}")
            say(f"    why: {p.problem}")
            if p.trial is not None:  # against fp32 on the same data
                ref = p.reference or base
                state = "held" if p.trial.held(ref) else "still FAILS"
                say(f"    its trial {state}: {p.trial.result(ref)}")
        command = self.write(rx, base_cfg)
        say(f"launch it: {command}")
        if not verify:
            return 0
        return self.verify(rx)

    # ---------------------------------------------------------------- steps

    def _precision(self, mode: str, *more: str) -> list[str]:
        """The precision overrides of a trial of ``mode``: the user's settings, then ``more``."""
        return [f"precision={mode}", *self.tuning, *more]

    def _load(self, extra: list[str]):
        from ampsweep.config.compose import load
        from ampsweep.engine import components

        quiet = ["tracking=none", "trainer.progress=false", "trainer.checkpoint_every=0"]
        return components.resolve(load([*self.rest, *extra, *quiet], search=self.search))

    def _probe(self, cfg):
        from ampsweep.engine.build import build
        from ampsweep.engine.distributed import unwrap
        from ampsweep.measure.hooks import HookError
        from ampsweep.measure.probe import probe

        setup = build(cfg)
        batches = list(itertools.islice(setup.train_batches.epoch(0), PROBE_BATCHES))
        try:
            found = probe(
                unwrap(setup.model),
                batches,
                setup.objective,
                setup.diagnostics.loss_weight,
                setup.optimizer,
            )
        except HookError as err:
            raise ConfigError(f"ampsweep doctor: {err}") from None
        least = found.forward_headroom("fp16")
        words = []
        if least is not None:
            words.append(f"fp16 forward headroom 2^{least[1]:+.1f} (least: {least[0] or 'model'})")
        words.append(f"fp16 without scaling flushes {found.grad_underflow():.1%} of the gradient")
        if any(modes.MODES[m].fp8 for m in self.modes):
            sat = found.fp8_saturating()
            words.append(
                "fp8: "
                + (
                    ", ".join(f"{n} {w} {v:.3g} > {lim:g}" for n, w, v, lim in sat[:3])
                    + " unscaled (torchao scales each tensor first)"
                    if sat
                    else "every Linear layer within e4m3/e5m2 even unscaled"
                )
            )
        lost = found.update_lost.get("bf16", {}).get("(all)")
        if lost is not None:
            words.append(f"pure bf16 rounds away {lost:.1%} of the updates")
        say(f"  probe (fp32, {len(batches)} batches): " + "; ".join(words))
        return found

    def trial(self, mode: str, precision: list[str]) -> Trial:
        """Train the configuration with ``precision`` overrides, untracked."""
        from ampsweep.engine.build import build
        from ampsweep.engine.loop import fit
        from ampsweep.measure.numerics import Diverged

        t = Trial(mode, precision)
        setup = build(self._load(precision))  # a refusal is the command's: one line, exit 2
        try:
            summary = fit(setup, lambda metrics, step: None)
        except Diverged as err:
            t.status, t.error, summary = "diverged", str(err), {}
        except Exception as err:
            t.status, t.error, summary = "failed", store.one_line(err), {}
        t.origin, t.nonfinite = setup.locator.origin, setup.locator.nonfinite_steps
        t.metric = setup.objective.task.score
        score = summary.get(t.metric.name)
        t.score = score if isinstance(score, float) and math.isfinite(score) else None
        t.steps = int(summary.get("train/steps", 0))
        t.skipped = float(summary.get("amp/skipped_steps", 0.0))
        t.samples_per_s = summary.get("perf/samples_per_s")
        t.peak_mib = summary.get(STEP_PEAK)
        return t

    def prescribe(self, mode: str, t: Trial, base: Trial, found) -> Prescription | None:
        """The fix for a mode whose trial failed or lost accuracy (None: it held, or no
        config change can be named)."""
        m = modes.MODES[mode]
        if m.pure and (pure := pure_fix(mode, t, base, found.update_lost.get(m.dtype, {}))):
            pure = self._tried(pure, base)
            pure.note = "; ".join(x for x in (peak_cost(pure, t), pure.note) if x)
            return pure
        gate = Fp8Gatekeeper(self._load, self._precision, self.trial, say)
        if m.fp8 and (fp8_fix := gate.prescribe(mode, t, base)):
            return fp8_fix  # the layers fp8 cannot carry, whether or not the trial held
        if t.held(base):
            return None
        origin = t.origin
        if origin is not None and origin.cause in ("divergence", "computation"):
            console.note(f"{mode}: not the format, no precision setting fixes it: {origin.fix()}")
            return None
        if origin is not None and origin.large_targets:  # the data's fix, else the head's
            return self._standardised(mode, t, base) or self._keep_fp32(mode, t, base)
        if origin is not None and origin.keep():
            return self._keep_fp32(mode, t, base)
        if m.dtype == "fp16" and found.grad_underflow() > 0.001:
            scale = found.suggested_scale()
            problem = (
                f"{t.result(base)}; without enough loss scaling fp16 flushes "
                f"{found.grad_underflow():.1%} of the gradient values to zero (below 2^-24); "
                f"a scale of {typed(scale)} keeps all but {found.grad_underflow(scale):.2%} of them"
            )
            rx = {"name": "fp16", "scaler": {"init_scale": scale}}
            return self._tried(Prescription(mode, problem, rx), base)
        console.note(
            f"{mode}: {t.result(base)}, with no non-finite value and no range problem the probe "
            "can see: run longer (trainer.epochs) or repeat (sweep.repeats=3) to tell a real "
            "loss from noise"
        )
        return None

    def _keep_fp32(self, mode: str, t: Trial, base: Trial) -> Prescription:
        """keep_fp32 for the module the trial named, then for each module the next trial
        names, until the trial is finite (at most ROUNDS trials). The user's own keep_fp32
        patterns come first."""
        keep: list[str] = list(self._given_keep())
        first = t.origin
        assert first is not None  # asked only of a trial that located its failure
        trial, problem = t, f"{t.result(base)}; {first.sentence()}"
        for _ in range(ROUNDS):
            origin = trial.origin
            name = origin.keep() if origin is not None else ""
            if not name or name in keep:
                break
            keep.append(name)
            trial = self.trial(
                mode, self._precision(mode, f"precision.keep_fp32=[{','.join(keep)}]")
            )
            if trial.held(base):
                break
        note = (
            "or precision=bf16, which has fp32's range"
            if (first.kind == "forward" and modes.MODES[mode].dtype == "fp16")
            else ""
        )
        rx = Prescription(mode, problem, {"name": mode, "keep_fp32": keep}, note, trial)
        return rx

    def _standardised(self, mode: str, t: Trial, base: Trial) -> Prescription | None:
        """Standardised targets for a regression whose head overflowed with large targets,
        tried with fp32 on the same targets (the score is then in their standard deviations);
        None where the data set has no such setting (what to do in it is said)."""
        cfg = self._load(["precision=fp32"])
        data = standardising(cfg.dataset.args)
        if not data:
            console.note(f"{mode}: {targets_advice(cfg.dataset.name)}")
            return None
        assert t.origin is not None  # large_targets
        problem = f"{t.result(base)}; {t.origin.sentence()}"
        note = f"every run on them, fp32 too: {base.metric.name} in their standard deviations"
        if modes.MODES[mode].dtype == "fp16":
            note += "; or precision=bf16, which has fp32's range"
        rx = Prescription(mode, problem, {"name": mode}, note, data=data)
        rx.reference = self.trial("fp32", ["precision=fp32", *data])
        return self._tried(rx, base)

    def _given_keep(self) -> list[str]:
        for o in self.tuning:
            key, _, value = o.lstrip("+").partition("=")
            if key == "precision.keep_fp32":
                return [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        return []

    def _tried(self, rx: Prescription, base: Trial) -> Prescription:
        rx.trial = self.trial(rx.mode, rx.overrides)
        return rx

    def _say_safe(self, trials: dict[str, Trial], base: Trial, found) -> None:
        safe = [m for m, t in trials.items() if t.held(base)]
        if not safe:
            return
        rooms = []
        for m in safe:
            least = found.forward_headroom(modes.MODES[m].dtype)
            if least is not None:
                rooms.append(f"{m} (forward headroom 2^{least[1]:.0f})")
            else:
                rooms.append(m)
        say(f"safe on this model: {', '.join(rooms)}")

    # ---------------------------------------------------------------- the experiment

    def write(self, rx: list[Prescription], cfg) -> str:
        """Each prescription as a precision option, all as experiment=doctor; the command
        that launches it."""
        rest, experiment = self._launch_overrides(rx)
        path, command = write_experiment(self.folder, rx, cfg, rest, experiment, EXPERIMENT)
        say(f"written: {path} and {len(rx)} precision option(s) beside it")
        return command

    def _launch_overrides(self, rx: list[Prescription]) -> tuple[list[str], str]:
        """The user's overrides for the launch (those of a key a prescription's data override
        sets replaced by it), and the experiment they named (which the doctor's experiment
        includes: a command takes one experiment=)."""
        data = [o for p in rx for o in p.data]
        keys = {"experiment", *(o.split("=", 1)[0] for o in data)}
        named = [o for o in self.rest if override_key(o) == "experiment"]
        rest = [o for o in self.rest if override_key(o) not in keys]
        rest += launch_settings(self.tuning) + data
        return rest, named[-1].split("=", 1)[1] if named else ""

    def verify(self, rx: list[Prescription]) -> int:
        rest, _ = self._launch_overrides(rx)
        code, runs = launch(self.folder, EXPERIMENT, rest, "precision")
        base = runs.get("fp32")
        if base is None or base.status != store.FINISHED:
            console.error("doctor --verify: the fp32 run of the sweep did not finish: no verdict")
            return code or 1
        say("")
        say(" (the sweep's own runs, against its fp32 run):", bold="verdict")
        fixed_all = True
        for p in rx:
            judge = p.trial.metric if p.trial is not None else None  # the task's score
            fixed, words = verdict(runs.get(p.option), runs.get(p.mode), base, judge)
            fixed_all &= fixed
            say(f"  {p.option} ({' '.join(p.overrides)}): {words}")
            if p.gate:
                say(f"    {p.gate}")
        return 0 if fixed_all else 1
