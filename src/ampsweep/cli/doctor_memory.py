"""``ampsweep doctor --memory [--modes M,...] [--verify] [OVERRIDES]``: what each mode saves of a
training step's peak against fp32 on this model, why, and the configs that shrink what
dominates; with ``--verify``, each config trained and judged by the step peak it measured.

The configuration is trained (untracked, as configured: ``trainer.max_steps`` sets the length)
in fp32 and in each mode examined; each run measures its step's peak part by part
(``mem/<part>_mib``). The finding and its prescriptions are the report's (``report.memory``:
a larger batch in fp32's peak, a pure mode, FSDP), each with its predicted peak. A prescription
is fixed when its own run's step peak stays within its limit (``Fix.verdict``): fp32's peak for
a larger batch, the mode's own for the rest. FSDP's needs several processes: said, not run.
"""

from __future__ import annotations

from collections.abc import Callable

from ampsweep import console
from ampsweep.measure import capacity
from ampsweep.precision import modes
from ampsweep.report import memory


class MemoryDoctor:
    """The memory examination, on the doctor's configuration (``load``: its overrides plus
    the given ones, composed and resolved) and output (``say``)."""

    def __init__(self, load: Callable, precision: Callable, examined: list[str], say: Callable):
        self.load, self.precision, self.examined, self.say = load, precision, examined, say

    def measure(self, overrides: list[str]) -> tuple[capacity.Breakdown | None, str]:
        """Train with ``overrides``, untracked: its step's parts, or None and why not."""
        from ampsweep.engine.build import build
        from ampsweep.engine.loop import fit
        from ampsweep.tracking import store

        cfg = self.load(overrides)
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
        fixed_all = True
        for mode in self.examined:
            bd, why = self.measure(self.precision(mode))
            if bd is None:
                self.say(f"  {mode}: no step memory ({why})")
                fixed_all = False
                continue
            self.say(f"  {memory.saved(ref, bd, '')}")
            for fix in memory.fixes(ref, bd):
                fixed_all &= self.check(mode, fix, verify)
        return 0 if fixed_all or not verify else 1

    def check(self, mode: str, fix: memory.Fix, verify: bool) -> bool:
        """Say the prescription; with ``verify``, run it and say whether it fixed the peak."""
        self.say(f"    prescription for {mode}: {' '.join(fix.overrides)}")
        if not verify:
            return True
        if fix.predicted_mib is None:
            self.say("      not verified here: it runs trainer.nproc processes (ampsweep train)")
            return True
        name = next(o.split("=", 1)[1] for o in fix.overrides if o.startswith("precision="))
        rest = [o for o in fix.overrides if not o.startswith("precision=")]
        bd, why = self.measure([*self.precision(name), *rest])
        fixed, words = fix.verdict(bd.total if bd is not None else None)
        self.say(f"      {words if bd is not None else f'NOT verified: {why}'}")
        return fixed


def run(doc, args, say: Callable) -> int:
    """``doctor --memory`` on the doctor's configuration: the modes given (``--modes`` or a
    precision= override), else bf16; those this device cannot run left out, as the doctor
    does."""
    from ampsweep.engine.build import select_device

    given = args.modes or any(o.split("=", 1)[0] == "precision" for o in args.overrides)
    names = doc.modes if given else ["bf16"]
    cfg = doc._load(["precision=fp32"])
    device = select_device(cfg.trainer.device).type
    for m in [n for n in names if device not in modes.MODES[n].devices]:
        console.note(f"{m} does not run on {device}: left out")
    names = [n for n in names if device in modes.MODES[n].devices]
    label = f"{cfg.model.name} on {cfg.dataset.name}, {device}; modes: {', '.join(names)}"
    say(f": {label}", bold="ampsweep doctor --memory")
    return MemoryDoctor(doc._load, doc._precision, names, say).run(args.verify)
