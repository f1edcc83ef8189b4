#!/usr/bin/env python
"""What ampsweep's runner costs over a plain hand-written AMP loop.

  python scripts/bench_overhead.py                      # fp32 and bf16, cnn on digits, CPU
  python scripts/bench_overhead.py --precisions fp32,fp16,bf16 --device cuda --model resnet18 \\
      --dataset synthetic --batch-size 256 --steps 200  # the same on a GPU
  python scripts/bench_overhead.py --quick              # a dry run of a few seconds
  python scripts/bench_overhead.py --steps 1200 --reps 5   # long runs only

Variants, per precision mode, each run in-process (``engine.build.build`` then
``engine.loop.fit``, exactly what ``ampsweep train`` runs after composing the config; building
is not timed):

  plain loop       a hand-written loop: autocast, GradScaler, AdamW, the same model, data,
                   batch size and shuffling, preloaded tensors indexed on the device
  runner           ampsweep's loop, tracking=none, dataset.preload=true
  runner+mlflow    the same, logging to MLflow (a temporary SQLite store), final flush timed,
                   with system metrics sampled while it trains (tracking.system_metrics, every
                   tracking.system_metrics_interval s); the data sets are recorded before and
                   the model logged after the timed span (both once per run, not per step).
  runner+loader    the same as "runner" but dataset.preload=false (a DataLoader per epoch)

Every run does the same work: ``--steps`` optimizer steps, then one evaluation of the
validation split. Two throughputs are printed: "wall" (training samples over the whole timed
span: logging, one-off costs such as the FLOP count and the first-step activation meter,
and the final evaluation all included) and "step" (from the median time of one step, which
excludes everything done between steps). Repetitions interleave the variants (in a rotated
order) so that a change of machine load hits all of them; ratios are printed as the median of
the per-repetition ratios, and the ratio of the best runs. Targets, judged on the paired median:
runner >= 0.98 x plain loop, runner+mlflow >= 0.98 x runner, judged on the median of the
ratios of runs made back to back. Two run lengths by default: 300 steps (15 repetitions), where
the one-off work of a run is a visible share, and 1,200 steps (5 repetitions), where it is not.

  python scripts/bench_overhead.py --components      # what each piece costs, timed alone
  python scripts/bench_overhead.py --interleaved     # runner and plain steps, alternated

``--interleaved`` runs the runner (``fit``, tracking off) with a callback that takes, after each
of its steps, one step of the plain loop on a twin of its model, optimizer and data: the two
loops alternate step by step in one run, so the machine's drift hits both alike, and two
plain loops compared so agree within 1%. It prints the ratio of the median steps (each timed
after its batch is gathered) and of the median "full" steps (a plain step with its gather; a
runner step from the end of one plain step to the start of the next, its batch, bookkeeping and
callbacks in) with what the runner adds a step in microseconds, and exits 1 when the latter
ratio is below 0.98. One-off work (the FLOP count after training, the final evaluation) is not
in it: ``--components`` times that.

On a virtual machine whose speed drifts by tens of percent from one run to the next, paired
whole runs cannot resolve a gap of 2%. ``--components`` times, each on its own and many times
over, the work the runner adds to the plain loop's step (what ``engine.loop.fit`` does beside
the AMP step: the non-finite check of its callbacks, the running totals, the divergence watch,
the step view, timer and first-step meter), the one-off work of a run (the FLOP count and the
memory measurement after training) and what recording adds (buffering a log step's metrics,
the final write of a run's metrics into SQLite, one system-metrics sample), against one plain
step, and what they add to runs of each ``--steps`` length. The list follows ``fit``: a piece
added there belongs here too. Alone is not in place: between the model's kernels the same
Python has cost more than its pieces timed alone (docs/benchmarks.md), and on CUDA a piece that
reads a value back syncs an idle queue, cheaper than inside a real step. So the sum is a floor
on the overhead, and what to look at first when whole runs show a gap.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ampsweep.config.compose import load  # noqa: E402
from ampsweep.engine import build, data, loop, models  # noqa: E402
from ampsweep.engine.checkpoint import snapshot  # noqa: E402
from ampsweep.engine.data.batches import epoch_order  # noqa: E402
from ampsweep.engine.loop import fit  # noqa: E402
from ampsweep.measure.cost import StepTimer  # noqa: E402
from ampsweep.measure.numerics import NonfiniteWatch  # noqa: E402
from ampsweep.precision import policy  # noqa: E402
from ampsweep.precision.policy import found_inf  # noqa: E402
from ampsweep.tracking import store as mlflow_store  # noqa: E402
from ampsweep.tracking import system_metrics  # noqa: E402
from ampsweep.tracking.recorder import MlflowRecorder, NullRecorder  # noqa: E402

VARIANTS = ["plain loop", "runner", "runner+mlflow", "runner+loader"]
TARGETS = {  # (numerator, denominator, target)
    "runner / plain loop": ("runner", "plain loop", 0.98),
    "tracking on / off": ("runner+mlflow", "runner", 0.98),
    "DataLoader / preload": ("runner+loader", "runner", None),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--batch-size", type=int, default=64)
    # Many short interleaved runs rather than a few long ones: on a shared or virtual machine
    # the speed drifts over seconds, and a ratio of two runs made back to back cancels it.
    p.add_argument("--steps", help="optimizer steps per run, one or more run lengths "
                   "(default 300,1200; 1200 with --interleaved)")  # fmt: skip
    p.add_argument("--reps", help="interleaved repetitions of each run length "
                   "(default 15,5; 5 with --interleaved)")  # fmt: skip
    p.add_argument("--override", action="append", default=[], help="extra config overrides")
    p.add_argument("--components", action="store_true",
                   help="time each piece the runner and recording add, alone")  # fmt: skip
    p.add_argument("--interleaved", action="store_true",
                   help="the runner's steps against plain steps on a twin, alternated step by "
                   "step in one run (default here: --steps 1200 --reps 5)")  # fmt: skip
    p.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("AMPSWEEP_BENCH_QUICK") == "1",
        help="dry run: 8 steps, 1 repetition, a tiny model (also AMPSWEEP_BENCH_QUICK=1)",
    )
    args = p.parse_args()
    default_steps, default_reps = ("1200", "5") if args.interleaved else ("300,1200", "15,5")
    args.steps, args.reps = args.steps or default_steps, args.reps or default_reps
    return args


def overrides(args, mode: str, steps: int, extra: list[str]) -> list[str]:
    out = [
        f"precision={mode}",
        f"model={args.model}",
        f"dataset={args.dataset}",
        f"trainer.device={args.device}",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.max_steps={steps}",
        "trainer.epochs=100000",  # max_steps ends the run
        "trainer.eval_every=100000",  # one evaluation, at the end (the plain loop does the same)
        "trainer.progress=false",
        "dataset.preload=true",
        "tracking=none",
        *args.override,
        *extra,
    ]
    if args.quick:
        out += ["model.width=4", "model.depth=1"]
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the plain loop


def plain_loop(cfg, steps: int) -> tuple[float, float]:
    """A hand-written AMP loop on the same model, data and batches. (wall s, median step ms)"""
    t = cfg.trainer
    device = build.select_device(t.device)
    cfg = build.resolve(cfg)
    spec = policy.resolve_mode(cfg.precision.name, device)
    half = policy.TORCH_DTYPES[spec.dtype]
    policy.set_tf32(spec.tf32)
    torch.manual_seed(t.seed)
    splits = data.load(cfg.dataset)
    param_dtype = half if spec.pure else torch.float32
    (xt, yt), (xv, yv) = splits.train, splits.val
    xt, yt = xt.to(device, param_dtype), yt.to(device)
    xv, yv = xv.to(device, param_dtype), yv.to(device)
    model = models.build_model(cfg.model, splits.input_shape, splits.num_classes)
    model = model.to(device, param_dtype)
    o = cfg.optimizer
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=tuple(o.args["betas"]),
        eps=o.args["eps"],
        weight_decay=o.weight_decay,
        fused=(device.type == "cuda") or None,
    )
    scaler = torch.amp.GradScaler(device.type, enabled=spec.scaler)
    bs, n = t.batch_size, len(yt)
    step_ms: list[float] = []
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: read once at the end
    sync(device)
    start = time.perf_counter()
    step, epoch = 0, 0
    while step < steps:
        order = epoch_order(n, t.seed, epoch).to(device)  # the runner's shuffling
        for i in range(n // bs):
            idx = order[i * bs : (i + 1) * bs]
            x, y = xt[idx], yt[idx]
            # The step is timed from here, after its batch is gathered, as the runner's
            # StepTimer times it (its batch comes from the iterator before the timer starts).
            t0 = time.perf_counter()
            if device.type == "cuda":
                events.append(_event_pair())
            plain_step(model, opt, scaler, device, half, spec.autocast, x, y)
            step += 1
            if device.type == "cuda":
                events[-1][1].record()
            else:
                step_ms.append((time.perf_counter() - t0) * 1e3)
            if step == steps:
                break
        epoch += 1
    model.eval()
    correct = torch.zeros((), device=device, dtype=torch.long)
    with torch.inference_mode(), torch.autocast(device.type, dtype=half, enabled=spec.autocast):
        for i in range(0, len(yv), bs):
            correct += (model(xv[i : i + bs]).argmax(1) == yv[i : i + bs]).sum()
    correct.item()
    sync(device)
    wall = time.perf_counter() - start
    step_ms += [a.elapsed_time(b) for a, b in events]
    warm = step_ms[t.timing_warmup_steps :] or step_ms
    return wall, statistics.median(warm) if warm else float("nan")


def plain_step(model, opt, scaler, device, half, autocast: bool, x, y) -> None:
    """One step of a hand-written AMP loop."""
    with torch.autocast(device.type, dtype=half, enabled=autocast):
        loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _event_pair() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


# ---------------------------------------------------------------- the runner


def runner(cfg, store: str | None) -> tuple[float, float]:
    setup = build.build(cfg)  # untimed, as the plain loop's set-up is
    recorder = NullRecorder()
    if store:
        cfg.tracking.uri = store
        recorder = MlflowRecorder.start(cfg.tracking, "bench", uri=store)
        recorder.log_inputs(setup.data_inputs)
    t = cfg.tracking
    if t.system_metrics:  # sampled on a background thread while the steps run: timed
        recorder.start_system_metrics(t.system_metrics_interval)
    sync(setup.device)
    start = time.perf_counter()
    summary = fit(setup, recorder.log_metrics)
    recorder.flush()  # the run's metrics have landed in the store
    sync(setup.device)
    wall = time.perf_counter() - start
    recorder.stop_system_metrics()
    if store and t.log_model:  # after the training it records: not timed
        recorder.log_model(snapshot(setup.model, setup.val_batches), int(summary["train/steps"]))
    recorder.end(mlflow_store.FINISHED)
    return wall, summary.get("perf/step_time_ms", float("nan"))


def run_variant(args, variant: str, mode: str, steps: int, store: str):
    extra = ["dataset.preload=false"] if variant == "runner+loader" else []
    if variant == "runner+mlflow":
        extra = ["tracking=mlflow", "tracking.experiment=bench_overhead"]
    cfg = load(overrides(args, mode, steps, extra))
    if variant == "plain loop":
        return plain_loop(cfg, steps)
    return runner(cfg, store if variant == "runner+mlflow" else None)


# ---------------------------------------------------------------- step by step, interleaved


class PlainTwin(loop.Callback):
    """After each of the runner's steps, one plain step (``plain_step``, its batch gathered as
    the plain loop gathers it) on a twin of the runner's model, optimizer and data: both loops
    then run under the same machine state, step for step."""

    def __init__(self, twin):
        self.twin, self.device, self.seed = twin, twin.device, twin.cfg.trainer.seed
        self.half, self.autocast = twin.policy.compute_dtype, twin.policy.mode.autocast
        self.x, self.y = twin.train_batches.x, twin.train_batches.y
        self.bs = twin.cfg.trainer.batch_size
        # (entered, started, left): the plain work with its gather from entered, the step
        # alone from started. Only one append follows ``left``: whatever this callback does
        # after it is timed as the runner's (a list append costs microseconds there).
        self.spans: list[tuple[float, float, float]] = []

    def after_step(self, state) -> None:
        entered = time.perf_counter()
        per_epoch = len(self.y) // self.bs
        epoch, i = divmod(state.step - 1, per_epoch)
        if i == 0:
            self.order = epoch_order(len(self.y), self.seed, epoch).to(self.device)
        idx = self.order[i * self.bs : (i + 1) * self.bs]
        x, y = self.x[idx], self.y[idx]
        t = self.twin
        start = time.perf_counter()
        plain_step(t.model, t.optimizer, t.scaler, self.device, self.half, self.autocast, x, y)
        sync(self.device)
        self.spans.append((entered, start, time.perf_counter()))


def interleaved(args, mode: str, steps: int) -> tuple[float, float, float, float]:
    """One run of ``steps``: (plain step, runner step, plain full step, runner full step), medians
    in ms. "full": a plain step with its gather; a runner step from the end of one plain step
    to the start of the next (its batch, bookkeeping and callbacks in)."""
    cfg = load(overrides(args, mode, steps, []))
    runner_setup, plain = build.build(cfg), PlainTwin(build.build(cfg))
    summary = fit(runner_setup, lambda metrics, step: None, callbacks=[plain])
    warm = cfg.trainer.timing_warmup_steps
    spans = plain.spans[warm:]
    runner_full = [(b[0] - a[2]) * 1e3 for a, b in itertools.pairwise(spans)]
    plain_full = [(left - entered) * 1e3 for entered, _, left in spans]
    plain_step = [(left - started) * 1e3 for _, started, left in spans]
    return (statistics.median(plain_step), summary["perf/step_time_ms"],
            statistics.median(plain_full), statistics.median(runner_full))  # fmt: skip


def report_interleaved(args, lengths: list[int], reps_of: list[int]) -> bool:
    """Print the interleaved rounds; whether every median full-step ratio meets 0.98."""
    target, met = TARGETS["runner / plain loop"][2], True
    for mode in args.precisions.split(","):
        interleaved(args, mode, 8)  # warm up
        for steps, reps in zip(lengths, reps_of, strict=True):
            rounds = [interleaved(args, mode, steps) for _ in range(reps)]
            for p, r, pf, rf in rounds:
                print(f"  {mode:>9} {steps:>5} steps: plain step {p:.3f} ms, runner {r:.3f} "
                      f"ms; with batch and bookkeeping {pf:.3f} and {rf:.3f} ms")  # fmt: skip
            step = statistics.median(p / r for p, r, _, _ in rounds)
            full = statistics.median(pf / rf for _, _, pf, rf in rounds)
            added = statistics.median((rf - pf) * 1e3 for _, _, pf, rf in rounds)
            met &= full >= target
            verdict = "meets" if full >= target else "BELOW"
            print(f"{mode:<10} {steps:>5} steps: runner / plain loop {step:.3f} (steps), "
                  f"{full:.3f} (with batch and bookkeeping: {added:+.0f} us a step), target "
                  f"{target:.2f} on the latter: {verdict}", flush=True)  # fmt: skip
    return met


# ---------------------------------------------------------------- the pieces, alone


def per_call_us(fn, calls: int) -> float:
    """The median over 5 rounds of ``calls`` calls of ``fn``: microseconds per call."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def components(args, mode: str, store: str) -> tuple[float, dict, dict, dict]:
    """(one plain step, the runner's per-step pieces, its one-off pieces, recording's pieces),
    in microseconds, on a built run of ``mode`` warmed up by 30 plain steps."""
    calls = 20 if args.quick else 2000
    cfg = load(overrides(args, mode, 30, []))
    s = build.build(cfg)
    model, opt, scaler, policy_, device = s.model, s.optimizer, s.scaler, s.policy, s.device
    x, y = next(iter(s.train_batches.epoch(0)))

    def amp_step():  # what the plain loop does per step
        with policy_.autocast():
            loss = s.objective(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(30):  # warm: kernels, caches, the allocator
        amp_step()
    step_us = per_call_us(lambda: (amp_step(), sync(device)), max(1, calls // 10))
    # Once per run, after training: timed on its first call in this process, as a run pays it
    # (the first mode's; FLOP counting is warm for the next)
    start = time.perf_counter()
    loop._measured(s, step_us / 1e3)  # noqa: SLF001
    one_off = {"FLOP count and memory after training": (time.perf_counter() - start) * 1e6}
    # A step's tensors as fit's callbacks see them: unscaled gradients, before the update.
    with policy_.autocast():
        loss = s.objective(model(x), y)
    scaler.scale(loss).backward()
    loss = loss.detach()  # as fit hands it on: to the step view, the totals and the watch
    scaler.unscale_(opt)
    skipped = found_inf(scaler, opt)
    view = loop.StepView(1, model, opt, scaler, [(x, y)], [loss], skipped, lambda m, n: None)
    scaled = scaler.is_enabled()
    totals = loop.Totals(device, loop.TrainState(), StepTimer(device, 1), model, scaled)
    watch = NonfiniteWatch(cfg.trainer.max_nonfinite_steps, 1.0, scaler)
    timer = StepTimer(device, 1)

    def callbacks():
        for callback in s.callbacks:
            callback.before_update(view)
        sync(device)

    def totals_add():
        totals.add_loss(loss)
        totals.add_skipped(skipped)

    def watch_observe():
        watch.observe(loss, skipped, scaler)
        watch._window.clear()  # noqa: SLF001 - settled at log steps, not per step

    def view_timer_meter():
        timer.start()
        with totals.meter.record(enabled=False):
            loop.StepView(1, model, opt, scaler, [(x, y)], [loss], skipped, None)
        timer.stop()

    log_every = cfg.trainer.log_every

    def log_step():  # a log step's reading of the totals and settling of the watch
        for _ in range(log_every):
            totals.add_loss(loss)
            watch.observe(loss, skipped, scaler)
        totals.take_metrics(s.schedule, scaler)
        watch.check(1)

    totals_us, watch_us = per_call_us(totals_add, calls), per_call_us(watch_observe, calls)
    # a log step's own work: the log step less the per-step pieces it repeats
    log_us = per_call_us(log_step, max(1, calls // log_every)) - log_every * (totals_us + watch_us)
    per_step = {
        "the callbacks' checks (" + ", ".join(type(c).__name__ for c in s.callbacks) + ")":
            per_call_us(callbacks, calls),
        "running totals (loss, skipped steps)": totals_us,
        "divergence watch": watch_us,
        "step view, timer, first-step meter (off)": per_call_us(view_timer_meter, calls),
        f"a log step's metrics and checks, over its {log_every} steps": log_us / log_every,
    }  # fmt: skip
    opt.zero_grad(set_to_none=True)
    # Recording: a log step's metrics buffered; their write into a SQLite store, timed for 100
    # log steps written at once (a 1,000-step run's final flush) and given per log step; one
    # system-metrics sample.
    rec_cfg = load(overrides(args, mode, 30, ["tracking=mlflow", "tracking.experiment=parts"]))
    recorder = MlflowRecorder.start(rec_cfg.tracking, "parts", uri=store)
    points = {"train/loss": 1.0, "train/lr": 1e-3, "amp/loss_scale": 1.0}
    step = iter(range(10**9))
    buffered = per_call_us(lambda: recorder.log_metrics(points, next(step)), calls)
    recorder.flush()  # what that buffered, written
    logged = 100  # log steps written at once: the final flush of a 1,000-step run
    for _ in range(logged):
        recorder.log_metrics(points, next(step))
    start = time.perf_counter()
    recorder.flush()
    recording = {
        "metrics of a log step, buffered": buffered,
        "their write into the store, per log step": (time.perf_counter() - start) * 1e6 / logged,
    }
    sampler = system_metrics.SystemMetrics(lambda metrics, n: None, 1.0)
    sampler._monitors = system_metrics.collectors()  # noqa: SLF001 - what its thread sets up first
    every = rec_cfg.tracking.system_metrics_interval
    recording[f"one system-metrics sample (every {every:g} s)"] = per_call_us(
        sampler._sample,  # noqa: SLF001 - what its thread runs every interval
        20,
    )
    recorder.end(mlflow_store.FINISHED)
    return step_us, per_step, one_off, recording


def report_components(args, lengths: list[int], store: str) -> None:
    for mode in args.precisions.split(","):
        step_us, per_step, one_off, recording = components(args, mode, store)
        cfg = load(overrides(args, mode, 30, []))
        log_every, every = cfg.trainer.log_every, cfg.tracking.system_metrics_interval
        print(f"\n{mode}: one plain step {step_us:,.0f} us")
        for title, parts in (("per step", per_step), ("per run", one_off),
                             ("recording", recording)):  # fmt: skip
            for name, us in parts.items():
                print(f"  {title:<10} {name:<58} {us:>10,.1f} us")
        added = sum(per_step.values())
        per_log = sum(v for k, v in recording.items() if "log step" in k)
        sample = next(v for k, v in recording.items() if "system-metrics" in k)
        for steps in lengths:
            plain = steps * step_us
            runner = steps * added + sum(one_off.values())
            recording_us = steps / log_every * per_log + (plain / 1e6 / every + 1) * sample
            print(f"  {steps:>5} steps: the pieces alone add {runner / plain:.2%} to the plain "
                  f"loop's steps, recording {recording_us / (plain + runner):.2%} to the "
                  "runner's")  # fmt: skip


# ---------------------------------------------------------------- report


def load_line() -> str:
    try:
        one, five, _ = os.getloadavg()
        return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"
    except OSError:
        return "load average unavailable"


def main() -> int:
    args = parse_args()
    modes = args.precisions.split(",")
    lengths = [8] if args.quick else [int(n) for n in args.steps.split(",")]
    reps_of = [1] if args.quick else [int(n) for n in args.reps.split(",")]
    if len(reps_of) != len(lengths):
        sys.exit(f"--reps {args.reps}: one count per run length of --steps {args.steps}")
    print(
        f"ampsweep overhead benchmark: model={args.model} dataset={args.dataset} "
        f"batch={args.batch_size} device={args.device} steps={lengths} reps={reps_of} "
        "(interleaved)"
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, python "
        f"{platform.python_version()}, {platform.processor() or platform.machine()}"
    )
    if args.device == "cuda" and torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}")
    print(f"at start: {load_line()}")
    if args.interleaved:  # nothing is recorded
        met = report_interleaved(args, lengths, reps_of)
        print(f"at end:   {load_line()}")
        return 0 if met or args.quick else 1
    if args.components:
        with tempfile.TemporaryDirectory() as tmp:
            report_components(args, lengths, f"sqlite:///{Path(tmp) / 'mlflow.db'}")
        print(f"at end:   {load_line()}")
        return 0
    results: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        os.environ.setdefault("MLFLOW_TRACKING_URI", store)  # nothing lands in ./outputs
        for steps, reps in zip(lengths, reps_of, strict=True):
            for mode in modes:
                for variant in VARIANTS:  # warm up: imports, caches, the store's tables
                    run_variant(args, variant, mode, min(steps, 4), store)
                for rep in range(reps):
                    order = VARIANTS[rep % len(VARIANTS) :] + VARIANTS[: rep % len(VARIANTS)]
                    for variant in order:
                        wall, step_ms = run_variant(args, variant, mode, steps, store)
                        results.setdefault((mode, steps, variant), []).append((wall, step_ms))
                        print(
                            f"  rep {rep + 1}/{reps} {mode:>9} {steps:>5} steps {variant:<14} "
                            f"{wall:7.2f} s {steps * args.batch_size / wall:9.1f} samples/s",
                            flush=True,
                        )
    print(f"at end:   {load_line()}")
    print()
    header = (
        f"{'precision':<10} {'variant':<14} {'steps':>5} {'wall: best':>11} {'median':>9} "
        f"{'worst':>9} {'step: median':>13}"
    )
    print(header)
    print("-" * len(header))
    for steps in lengths:
        for mode in modes:
            for variant in VARIANTS:
                runs = results[(mode, steps, variant)]
                tput = [steps * args.batch_size / w for w, _ in runs]
                step = statistics.median(s for _, s in runs)
                print(
                    f"{mode:<10} {variant:<14} {steps:>5} {max(tput):>11.1f} "
                    f"{statistics.median(tput):>9.1f} {min(tput):>9.1f} "
                    f"{args.batch_size * 1e3 / step:>13.1f}"
                )
    print()
    header = (
        f"{'precision':<10} {'steps':>5} {'ratio':<22} {'best':>6} {'median':>6} {'step':>6} "
        f"{'target':>7}  verdict (on the paired median)"
    )
    print(header)
    print("-" * len(header))
    failed = False
    for steps in lengths:
        for mode in modes:
            for name, (num, den, target) in TARGETS.items():
                a, b = results[(mode, steps, num)], results[(mode, steps, den)]
                best = min(w for w, _ in b) / min(w for w, _ in a)
                wall = statistics.median(bw / aw for (aw, _), (bw, _) in zip(a, b, strict=True))
                step = statistics.median(bs / as_ for (_, as_), (_, bs) in zip(a, b, strict=True))
                verdict = "-"
                if target is not None:
                    verdict = "meets target" if wall >= target else "BELOW target"
                    failed |= wall < target
                shown = f"{target:.2f}" if target else "-"
                print(
                    f"{mode:<10} {steps:>5} {name:<22} {best:>6.3f} {wall:>6.3f} {step:>6.3f} "
                    f"{shown:>7}  {verdict}"
                )
    print()
    print(
        "wall: samples/s over each whole run (logging, one-off costs and the final evaluation "
        "included); best/median/worst over the repetitions. step: from each run's median step "
        "time. Ratios: best = ratio of the best runs; median = median over the repetitions of the "
        "ratio of two runs made back to back (paired: what the verdict uses, since it cancels "
        "the machine's drift); step = the same for the median step times."
    )
    return 1 if failed and not args.quick else 0


if __name__ == "__main__":
    sys.exit(main())
