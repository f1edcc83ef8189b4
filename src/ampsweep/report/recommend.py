"""The report's first line: the mode to use for this model on this device, and why; or, where
the evidence cannot decide, the question that is open and the run that would close it.

A mode is recommended only when its quality held against the baseline (its score within the
score's tolerance, in the score's direction: ``report.quality``; over repeats, the whole
interval), its runs went right numerically (``numerics.went_wrong``), and it is faster
than the baseline on a device whose timings mean something (a GPU, not an emulated fp8 run).
Three things leave the question open instead: a baseline that has not learned (accuracy near
chance, perplexity near the unigram baseline's), timings from a CPU, and intervals that cannot
tell a mode from the baseline yet.
"""

from __future__ import annotations

import shlex

from ampsweep.precision import modes
from ampsweep.precision.modes import BASELINE
from ampsweep.report import numerics, quality, stats
from ampsweep.report.findings import describe_device
from ampsweep.report.model import Recommendation, Row, how_much, is_number, ratio_range
from ampsweep.tracking.store import FINISHED

# How many times as long a baseline that has not learned is suggested to train.
LONGER = 4
# Overrides of the sweep that a single run of the chosen mode leaves out.
SWEEP_ONLY = ("precision", "sweep.repeats", "trainer.seed", "hydra.")
EMULATE = "precision.fp8.emulate"


def recommend(
    rows: list[Row],
    device: dict[str, str],
    baseline_mode: str = BASELINE,
    sweep_command: str = "",
    trained: dict[str, str] | None = None,
) -> Recommendation:
    """The recommendation for the first configuration of ``rows`` (a report's summary: one row
    per configuration and mode) that has a baseline to compare with. ``trained``: the
    baseline's ``trainer.epochs`` and ``trainer.max_steps`` params (how long it trained), which
    a suggestion to train longer multiplies."""
    group = _first_group(rows)
    base = next((r for r in group if r.precision == baseline_mode), None)
    if base is None:
        return Recommendation(
            None,
            f"no mode finished beside a {baseline_mode} run of the same config, so none can be "
            "compared.",
            _sweep(sweep_command, {"precision": f"{baseline_mode},bf16"}),
            open_question=f"how each mode compares with {baseline_mode}",
        )
    others = [r for r in group if r.precision != baseline_mode]
    where = f" for {base.configuration}{_on(device)}"
    unlearned = quality.not_learned(base)
    if unlearned:
        return Recommendation(
            None,
            f"{unlearned}, so no mode can be judged against it{where}. Train longer "
            f"({LONGER} times the epochs and steps, or a higher learning rate) and sweep again.",
            _sweep(sweep_command, _longer(trained or {})),
            evidence={"baseline": unlearned},
            open_question="whether the baseline learns at all at this run length",
        )
    wrong = [r.mode for r in others if numerics.went_wrong(r)]
    ruled_out = f" {', '.join(wrong)} went wrong numerically (see the findings)." if wrong else ""
    verdicts = {r.mode: quality.verdict(r) for r in others if not numerics.went_wrong(r)}
    held = [r for r in others if verdicts.get(r.mode) == "held"]
    unsure = [r for r in others if verdicts.get(r.mode) == "open"]
    if device.get("device") == "cpu":
        gpu_command = _on_gpu(sweep_command, any(r.emulated for r in group))
        return _cpu(held, unsure, base, gpu_command, device, ruled_out)
    return _gpu(others, held, unsure, base, where, sweep_command, ruled_out)


def _gpu(others, held, unsure, base, where, sweep_command, ruled_out) -> Recommendation:
    """On a device whose timings mean something: the fastest of the ``others`` modes that held
    their quality, or why none can be named yet."""
    baseline_mode = base.mode
    busy = [r for r in held if is_number(r.speedup) and not r.emulated and r.contended]
    if busy:  # a contended timing is no verdict (``measure.contention``)
        ruled_out += (
            f" The timings of {', '.join(r.mode for r in busy)} were contended (other "
            "processes busy on the machine): left out of the speed verdict."
        )
    timed = [r for r in held if is_number(r.speedup) and not r.emulated and not r.contended]
    faster = sorted((r for r in timed if _speed_verdict(r) == "higher"), key=lambda r: -r.speedup)
    if faster:
        best, *rest = faster
        runner = rest[0] if rest else None
        return _use(best, runner, base, where, sweep_command, ruled_out)
    if busy and not timed:
        names = ", ".join(r.mode for r in busy)
        return Recommendation(
            None,
            f"{names} held quality against {baseline_mode}{where}, but every timing that would "
            "compare their speed was contended: other processes competed for the machine "
            "while they were timed. Rerun the sweep on an idle machine.",
            _sweep(sweep_command, {}),
            evidence={r.mode: _evidence_line(r, base) for r in busy},
            open_question=f"whether {names} is faster than {baseline_mode} on an idle machine",
        )
    wide = [r for r in timed + unsure if _open(r)]
    if wide:
        needed = max(_needed(r) for r in wide)
        names = ", ".join(r.mode for r in wide)
        return Recommendation(
            None,
            f"{names} cannot yet be told from {baseline_mode}{where}: the intervals over "
            f"{min(r.n for r in wide)} run(s) per mode are too wide to judge.{ruled_out} About "
            f"{needed} runs per mode would narrow them at this spread.",
            _sweep(sweep_command, {"sweep.repeats": str(needed)}),
            evidence={r.mode: _evidence_line(r, base) for r in wide},
            open_question=f"whether {names} is faster than {baseline_mode} with "
            f"{quality.label(wide)} held",
        )
    saving = min(held, key=lambda r: r.activation_ratio or 1.0, default=None)
    also = ""
    if saving is not None and is_number(saving.activation_ratio) and saving.activation_ratio < 1:
        also = (
            f" If memory is what you need, {saving.mode} held quality: "
            f"{_evidence_line(saving, base)}."
        )
    return Recommendation(
        baseline_mode,
        f"no mode was faster than {baseline_mode} with its quality held{where}.{ruled_out}{also}",
        _single(sweep_command, base),
        evidence={r.mode: _evidence_line(r, base) for r in others},
        runner_up=saving.mode if saving is not None and also else None,
    )


def _first_group(rows: list[Row]) -> list[Row]:
    compared = [r for r in rows if r.status == FINISHED and r.baseline]
    if not compared:
        return []
    where = compared[0].configuration
    return [r for r in compared if r.configuration == where]


def _on(device: dict[str, str]) -> str:
    return {"cpu": " on this CPU", "cuda": " on this GPU"}.get(device.get("device", ""), "")


def _speed_verdict(r: Row) -> str | None:
    """``stats.compare`` on the speed-up's interval; a single run: higher when above 1."""
    est = r.ci.get("speedup")
    if est is None or not est.has_interval:
        assert r.speedup is not None  # a timed row
        return "higher" if r.speedup > 1 else "lower"
    return stats.compare(est, 1.0)


def _open(r: Row) -> bool:
    """An interval (speed or quality) that contains "no difference" and is too wide."""
    tolerance = r.score.tolerance if r.score is not None else 0.0
    for name, null, target, ratio in (
        ("speedup", 1.0, stats.PRECISION_WANTED, True),
        ("quality_change", 0.0, tolerance, False),
    ):
        est = r.ci.get(name)
        verdict = stats.compare(est, null)
        needed = stats.repeats_needed(est, target, ratio)
        if verdict == "too wide":
            return True
        # an indistinguishable verdict has an interval, and the number of runs it needs
        if verdict == "indistinguishable" and est is not None and needed is not None:
            if needed > est.n:
                return True
    return False


def _needed(r: Row) -> int:
    speed = stats.repeats_needed(r.ci.get("speedup"), stats.PRECISION_WANTED, ratio=True)
    tolerance = r.score.tolerance if r.score is not None else 0.0
    change = stats.repeats_needed(r.ci.get("quality_change"), tolerance)
    return min(max(n for n in (speed, change, stats.MIN_REPEATS) if n), stats.MAX_REPEATS)


def _mem(r: Row) -> str:
    parts = []
    if is_number(r.activation_ratio):
        parts.append(
            f"{ratio_range(r.activation_ratio, r.ci.get('activation_ratio'))} the activation memory"
        )
    if is_number(r.peak_ratio):
        parts.append(f"{ratio_range(r.peak_ratio, r.ci.get('peak_ratio'))} the peak memory")
    if is_number(r.max_batch_ratio):
        parts.append(f"{ratio_range(r.max_batch_ratio, r.ci.get('max_batch_ratio'))} the batch")
    return ", ".join(parts) or "no memory measured"


def _scaler(r: Row) -> str:
    mode = modes.get(r.precision)
    if mode is None:
        return ""
    return "with a GradScaler (on by default)" if mode.scaler else "no loss scaler needed"


def _evidence_line(r: Row, base: Row) -> str:
    speed = ""
    if is_number(r.speedup) and not r.emulated:
        speed = f"{how_much(r.speedup)} ({ratio_range(r.speedup, r.ci.get('speedup'))}), "
    n = f", n={r.n}" if r.n > 1 else ", a single run"
    return f"{speed}{quality.words(r, base)}, {_mem(r)}{n}"


def _use(best: Row, runner: Row | None, base: Row, where: str, command: str, ruled_out: str):
    evidence = {best.mode: _evidence_line(best, base)}
    second = ""
    assert best.speedup is not None  # the modes compared are timed
    if runner is not None:
        assert runner.speedup is not None
        evidence[runner.mode] = _evidence_line(runner, base)
        second = f" Runner-up: {runner.mode}, {how_much(runner.speedup)}."
    scaler = _scaler(best)
    single = " (a single run per mode: sweep.repeats=3 gives each an interval)"
    return Recommendation(
        best.mode,
        f"{best.mode} is {how_much(best.speedup)} than {base.mode}{where} with its "
        f"quality held: {evidence[best.mode]}; {scaler}{single if best.n == 1 else ''}."
        f"{second}{ruled_out}",
        _single(command, best),
        evidence=evidence,
        runner_up=runner.mode if runner else None,
    )


def _cpu(held, unsure, base, gpu_command, device, ruled_out) -> Recommendation:
    kept = "; ".join(f"{r.mode}: {quality.words(r, base)}, {_mem(r)}" for r in held)
    kept = f" Quality held for {kept}." if held else ""
    if unsure:
        names = ", ".join(r.mode for r in unsure)
        kept += f" The quality of {names} cannot be judged yet (intervals too wide)."
    busy = [r for r in held if r.contended]
    if busy:
        ruled_out += (
            f" (The timings of {', '.join(r.mode for r in busy)} were also contended by "
            "other busy processes.)"
        )
    return Recommendation(
        None,
        f"{describe_device(device)} has no tensor cores, so its timings say nothing about "
        f"which mode is faster on a GPU for {base.configuration}.{kept}{ruled_out} Run the "
        "same sweep on a GPU.",
        gpu_command,
        evidence={r.mode: _evidence_line(r, base) for r in held},
        open_question="which mode is fastest on the GPU this model will train on",
    )


def _longer(trained: dict[str, str]) -> dict[str, str]:
    """Overrides that train ``LONGER`` times as long: each length limit the baseline ran with
    (its epochs, and its max steps when it had one), multiplied; a limit the sweep's command
    set is replaced, so none caps the longer run at the old length."""
    changes = {}
    for key in ("trainer.epochs", "trainer.max_steps"):
        value = trained.get(key, "")
        if value.isdigit() and int(value) > 0:
            changes[key] = str(int(value) * LONGER)
    return changes or {"trainer.epochs": "<more>"}


def _on_gpu(command: str, emulated: bool) -> str:
    """The sweep's own command on a CUDA GPU. fp8's emulation is for a CPU without fp8
    hardware, and a GPU that has it must run fp8 itself: an emulation the command asked for is
    dropped, one its config files set (an emulated run, no such override) is turned off."""
    changes = {"trainer.device": "cuda"}
    if emulated and not any(_key(w) == EMULATE for w in _tokens(command)):
        changes[EMULATE] = "false"
    return _sweep(command, changes, drop=(EMULATE,))


def _key(word: str) -> str:
    """The key of an override (``+key=value``, ``~key``: ``key``)."""
    return word.split("=", 1)[0].lstrip("+~")


def _tokens(command: str) -> list[str]:
    words = shlex.split(command) if command else ["ampsweep", "train", "-m"]
    return words if "-m" in words or "--multirun" in words else [*words[:2], "-m", *words[2:]]


def _sweep(command: str, changes: dict[str, str], drop: tuple[str, ...] = ()) -> str:
    """The sweep's own command with ``changes`` (``key=value`` overrides) made to it, and the
    overrides of the keys in ``drop`` left out."""
    words = [w for w in _tokens(command) if _key(w) not in (*changes, *drop)]
    return shlex.join([*words, *(f"{k}={v}" for k, v in changes.items())])


def _single(command: str, row: Row) -> str:
    """One run of ``row``'s mode with its precision settings and the sweep's other settings:
    ``ampsweep train precision=bf16_pure precision.master_weights=true model=...``; what only
    a sweep takes (``-m``, the seeds, repeats, a list of values) is left out."""
    words = [
        w
        for w in _tokens(command)[2:]
        if w not in ("-m", "--multirun")
        and not w.split("=", 1)[0].startswith(SWEEP_ONLY)
        and "," not in w.split("=", 1)[-1]
    ]
    mode = [f"precision={row.precision}", *row.precision_overrides]
    return shlex.join(["ampsweep", "train", *mode, *words])
