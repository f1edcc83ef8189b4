"""``ampsweep doctor --memory [--modes M,...] [--verify] [OVERRIDES]``: what each mode saves of a
training step's peak against fp32 on this model, why, and the configs that shrink what
dominates; with ``--verify``, each config run as a job of one sweep and judged by the step
peak it measured.

The configuration is trained (untracked, as configured: ``trainer.max_steps`` sets the length)
in fp32 and in each mode examined; each run measures its step's peak part by part
(``mem/<part>_mib``). The finding and its prescriptions are the report's (``report.memory``:
a larger batch in fp32's peak, a pure mode, FSDP), each with its predicted peak. They are
written as the options of a config group (``doctor_memory/``: fp32, each mode and each
prescription, a job each) and ``experiment/doctor_memory.yaml``, which sweeps them, under the
user's ``--config-dir`` (else outputs/doctor/conf); ``--verify`` launches that sweep as the
numerics doctor launches its own (``prescription.launch``). A prescription is fixed when its
run's step peak stays within its limit (``Fix.verdict``): fp32's peak for a larger batch, the
mode's own for a pure mode, and under FSDP, per rank, the mode's own less the share of the
weights, gradients and optimizer state a rank no longer holds. FSDP's job runs its ranks as
processes, so a sweep with it is launched with ``hydra/launcher=ampsweep_local``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace

from ampsweep import console
from ampsweep.cli.prescription import choice_of, launch, write_option, write_sweep
from ampsweep.config.compose import override_key
from ampsweep.config.schema import ConfigError
from ampsweep.measure import capacity
from ampsweep.precision import modes
from ampsweep.report import memory
from ampsweep.tracking import store

EXPERIMENT = "doctor_memory"  # the experiment that verifies, and the group of its jobs
GROUP = f"+{EXPERIMENT}"  # appended to the defaults: its options override the experiment's
NPROC, STRATEGY = "trainer.nproc", "trainer.strategy"
LOCAL = "hydra/launcher=ampsweep_local"  # jobs in processes of their own (ranks, for nproc)
SUBMITIT = "hydra_plugins.hydra_submitit_launcher"  # what ampsweep_local needs (the cluster extra)


@dataclass
class Job:
    """One job of the verifying sweep: its option of the group, the overrides it stands for,
    and the prescription it verifies (None: fp32 or a mode, the sweep's own comparison)."""

    option: str
    overrides: list[str]
    fix: memory.Fix | None = None
    mode: str = ""

    def body(self, run_name: str) -> dict:
        """The option's config: the overrides as keys (``precision=X``: its name)."""
        from omegaconf import OmegaConf

        dotted = [
            f"precision.name={v}" if k == "precision" else f"{k}={v}"
            for k, v in (o.lstrip("+").split("=", 1) for o in self.overrides)
        ]
        body = OmegaConf.to_container(OmegaConf.from_dotlist(dotted))
        assert isinstance(body, dict)  # dotted keys compose a mapping
        return {**body, "tracking": {"run_name": run_name}}

    @property
    def nproc(self) -> int:
        return int(choice_of(self.overrides, NPROC) or 1)


def option_of(fix: memory.Fix) -> str:
    """A prescription's option: its mode, then each other key's value, with the key's last
    part where the value alone says little (``bf16_batch_size_48``, ``bf16_fsdp_nproc_2``,
    ``bf16_pure_master_weights``)."""
    words = []
    for o in fix.overrides:
        key, value = o.split("=", 1)
        last = key.rsplit(".", 1)[-1]
        if key == "precision" or value.isalpha() and value not in ("true", "false"):
            words.append(value)
        else:
            words.append(last if value == "true" else f"{last}_{value}")
    return "_".join(words)


def sharded(fix: memory.Fix, bd: capacity.Breakdown) -> memory.Fix:
    """FSDP's prescription with the peak a rank is predicted to hold (the report names none):
    the mode's own less what ``trainer.nproc`` ranks shard of its weights, gradients and
    optimizer state. Its limit is the mode's own peak less half that saving: in backward a
    rank also holds a layer's gathered parameters and unsharded gradients (for the
    reduce-scatter), which the prediction leaves out. Another prescription as it is."""
    ranks = int(choice_of(list(fix.overrides), NPROC) or 1)
    if fix.predicted_mib is not None or ranks < 2:
        return fix
    saving = sum(bd.parts.get(p, 0.0) for p in memory.WEIGHTS) * (1 - 1 / ranks)
    limit_of = f"{bd.mode} less half the predicted saving, per rank"
    return replace(
        fix, predicted_mib=bd.total - saving, limit_mib=bd.total - saving / 2, limit_of=limit_of
    )


class MemoryDoctor:
    """The memory examination, on the doctor's configuration (``load``: its overrides plus
    the given ones, composed and resolved) and output (``say``); ``doc``: the ``Doctor``,
    whose folder and overrides the verifying sweep takes."""

    def __init__(self, doc, examined: list[str], device: str, say: Callable):
        self.doc, self.examined, self.device, self.say = doc, examined, device, say

    def measure(self, overrides: list[str]) -> tuple[capacity.Breakdown | None, str]:
        """Train with ``overrides``, untracked: its step's parts, or None and why not."""
        from ampsweep.engine.build import build
        from ampsweep.engine.loop import fit

        cfg = self.doc._load(overrides)
        setup = build(cfg)
        try:
            summary = fit(setup, lambda metrics, step: None)
        except Exception as err:  # a failed run is this examination's finding, not a crash
            return None, store.one_line(err)
        bd = capacity.breakdown(summary, cfg.precision.name, cfg.trainer.batch_size)
        if bd is None or capacity.STEP_PEAK not in summary:
            return None, "it measured no step peak"
        return bd, ""

    def run(self, verify: bool) -> int:
        ref, why = self.measure(["precision=fp32"])
        if ref is None:
            console.error(f"doctor --memory: fp32's run gave no step memory ({why}): no baseline")
            return 1
        self.say(f"  fp32: step peak {memory.mib(ref.total)} at batch {ref.batch}")
        # by option: a prescription that is a mode examined too (bf16_pure) runs once
        jobs, measured_all = {"fp32": Job("fp32", ["precision=fp32"])}, True
        for mode in self.examined:
            bd, why = self.measure(self.doc._precision(mode))
            if bd is None:
                self.say(f"  {mode}: no step memory ({why})")
                measured_all = False
                continue
            self.say(f"  {memory.saved(ref, bd, '')}")
            jobs.setdefault(mode, Job(mode, self.doc._precision(mode)))
            for fix in memory.fixes(ref, bd):
                job = self.prescribed(mode, sharded(fix, bd))
                jobs[job.option] = job
        code = 0 if measured_all or not verify else 1
        if not any(j.fix for j in jobs.values()):
            return code
        sweeps = self.write(list(jobs.values()))
        return (self.verify(list(jobs.values()), sweeps) or code) if verify else 0

    def prescribed(self, mode: str, fix: memory.Fix) -> Job:
        """Say ``fix`` for ``mode``, with its prediction; its job (the user's precision
        settings kept)."""
        name = choice_of(list(fix.overrides), "precision")
        rest = [o for o in fix.overrides if not o.startswith("precision=")]
        job = Job(option_of(fix), [*self.doc._precision(name), *rest], fix, mode)
        shown = ""
        if fix.predicted_mib:
            per = " per rank" if job.nproc > 1 else ""
            shown = f" (predicted {memory.mib(fix.predicted_mib)}{per})"
        self.say(f"    prescription for {mode}: {' '.join(fix.overrides)}{shown}")
        return job

    def runnable(self, job: Job) -> str:
        """Why this machine cannot run ``job`` in the verifying sweep ("": it can)."""
        if job.nproc < 2:
            return ""
        if importlib.util.find_spec(SUBMITIT) is None:
            return (
                f"its {NPROC}={job.nproc} processes need {LOCAL}: pip install 'ampsweep[cluster]'"
            )
        if self.device == "cuda":
            import torch

            if torch.cuda.device_count() < job.nproc:
                return f"it needs {job.nproc} GPUs, this machine has {torch.cuda.device_count()}"
        return ""

    def write(self, jobs: list[Job]) -> list[tuple[str, list[str]]]:
        """Each job as an option of the group, and the sweeps of them as experiments: one of
        the jobs of one process each, run in this process, and one for each other process
        count, whose launcher starts that many processes a job (a launcher's processes are
        the sweep's, not a job's); each experiment's name and the overrides it is launched
        with (the user's, less those of a key an option sets, which go into the experiment:
        an override on the command line would beat every option's own)."""
        from omegaconf import OmegaConf

        cfg = self.doc._load(["precision=fp32"])
        for job in jobs:
            about = [f"the same as: {' '.join(job.overrides)}"]
            if job.fix is not None:
                about.insert(0, f"prescription for {job.mode}: {job.fix.why}")
            body = job.body(f"{job.option}-{cfg.model.name}-{cfg.dataset.name}")
            write_option(self.doc.folder / EXPERIMENT, job.option, body, cfg, about)
        keys = {override_key(o) for j in jobs for o in j.overrides}
        moved = [o for o in self.doc.rest if override_key(o) in keys]
        named = [o for o in self.doc.rest if override_key(o) == "experiment"]
        user = [o for o in self.doc.rest if o not in moved and o not in named]
        experiment = named[-1].split("=", 1)[1] if named else ""
        sweeps = []
        for nproc in sorted({j.nproc for j in jobs if not self.runnable(j)}):
            options = [j.option for j in jobs if j.nproc == nproc and not self.runnable(j)]
            given = [o.lstrip("+") for o in moved]
            name, rest = EXPERIMENT, list(user)
            what = "fp32, the modes examined and their memory prescriptions"
            if nproc > 1:
                name, rest = f"{EXPERIMENT}_{NPROC.split('.')[-1]}_{nproc}", [*user, LOCAL]
                if self.device == "cuda":  # a GPU a rank (the launcher's default is none)
                    rest.append(f"hydra.launcher.gpus_per_node={nproc}")
                given.append(f"{NPROC}={nproc}")
                what = f"the memory prescriptions that run {NPROC}={nproc} processes"
            settings = OmegaConf.to_container(OmegaConf.from_dotlist(given))
            assert isinstance(settings, dict)  # dotted keys compose a mapping
            path, command = write_sweep(
                self.doc.folder, name, {GROUP: options}, settings, rest, experiment, cfg, what
            )
            self.say(f"written: {path}, over {len(options)} option(s) of {EXPERIMENT}/")
            self.say(f"launch it: {command}")
            sweeps.append((name, rest))
        return sweeps

    def verify(self, jobs: list[Job], sweeps: list[tuple[str, list[str]]]) -> int:
        """The sweeps, then a verdict per prescription from its own run's step peak."""
        runs = {}
        for name, rest in sweeps:
            runs.update(launch(self.doc.folder, name, rest, GROUP)[1])
        self.say("")
        self.say(" (each prescription's own run in the sweep, its step peak):", bold="verdict")
        fixed_all = True
        for job in jobs:
            if job.fix is None:
                continue
            shown = f"  {job.option} ({' '.join(job.fix.overrides)}): "
            if why := self.runnable(job):
                self.say(f"{shown}not verified here: {why}")
                continue
            run = runs.get(job.option)
            if run is None or run.status != store.FINISHED:
                fixed_all = False
                self.say(f"{shown}NOT verified: {run.error if run else 'it did not run'}")
                continue
            fixed, words = job.fix.verdict(run.summary.get(capacity.STEP_PEAK))
            fixed_all &= fixed
            self.say(shown + words)
        return 0 if fixed_all else 1


def check(overrides: list[str]) -> None:
    """Refuse what the memory examination cannot use: it trains one process, and prescribes
    FSDP's processes itself. Raises ConfigError."""
    for o in overrides:
        key = override_key(o)
        if key in (NPROC, STRATEGY):
            raise ConfigError(
                f"{o}: doctor --memory measures a step in one process and prescribes "
                f"{STRATEGY}=fsdp {NPROC}=2 itself where it shrinks the peak: drop {key}"
            )


def run(doc, args, say: Callable) -> int:
    """``doctor --memory`` on the doctor's configuration: the modes given (``--modes`` or a
    precision= override), else bf16; those this device cannot run left out, as the doctor
    does."""
    from ampsweep.engine.build import select_device

    check(args.overrides)
    given = args.modes or any(o.split("=", 1)[0] == "precision" for o in args.overrides)
    names = doc.modes if given else ["bf16"]
    cfg = doc._load(["precision=fp32"])
    device = select_device(cfg.trainer.device).type
    for m in [n for n in names if device not in modes.MODES[n].devices]:
        console.note(f"{m} does not run on {device}: left out")
    names = [n for n in names if device in modes.MODES[n].devices]
    label = f"{cfg.model.name} on {cfg.dataset.name}, {device}; modes: {', '.join(names)}"
    say(f": {label}", bold="ampsweep doctor --memory")
    return MemoryDoctor(doc, names, device, say).run(args.verify)
