#!/usr/bin/env python
"""What a run costs beyond its training steps: what recording adds to a whole run, and where.

  python scripts/bench_fixed_cost.py            # 5 repetitions, sweeps of 6 jobs (~6 min)
  python scripts/bench_fixed_cost.py --quick    # a dry run: 1 repetition, sweeps of 3 jobs
  python scripts/bench_fixed_cost.py --where    # only: where the seconds of one run go

Measured with model logging, data sets and system metrics on (the defaults), cnn on digits,
CPU, in a temporary folder with its own SQLite store (created before the timing: a new store's
schema migrations are a one-off cost, printed as "new store"):

  standalone, tracked  ampsweep train (the default run: 10 epochs), as a process
  standalone, untracked  the same with tracking=none
  tracked / untracked  the median over --pairs pairs of the ratio of the two, run back to back
                     in alternating order (the machine's drift cancels)
  imports            python -c "import torch, mlflow, hydra": the floor of any run
  1-step run         ampsweep train trainer.max_steps=1, as a process
  1-step, untracked  the same with tracking=none                            (for comparison)
  1-step, own model  the same tracked run of examples/shapes (its model and data set named by
                     _target_, whose provenance the run records), from a copy of that folder
  new store          the 1-step run into a store that does not exist yet, less the 1-step run
  per job            of an in-process sweep of 1-step jobs, beyond training: (sweep of N jobs
                     - sweep of 1 job) / (N - 1), less a job's training (its perf/wall_s)
  model, per job     what logging the model adds to a job in a sweep: the same sweep with
                     tracking.log_model=false, the difference / N
  model, logging     logging one model, timed in this process (warm): what it costs at the
                     end of each run
  store calls        calls into MLflow's store by one 1-step job (counted, not timed)

--where runs one standalone tracked run (in a subprocess, imports included) with a timer
around each phase of it and prints them in order: imports, the store's start-up, the run's
records, training, the model's logging (signature, files, upload, linked metrics) and the end.

Wall-clock times are medians over --reps repetitions (best and worst beside them); the load
average is printed at the start and the end: on a shared machine, trust the paired ratios and
the CPU seconds (user + system of each process) more than single wall times.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))  # run from a checkout without installing

DEFAULT_RUN = ["trainer.progress=false"]  # ampsweep train as typed, less the progress bar
ONE_STEP = ["trainer.max_steps=1", "trainer.progress=false"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--reps", type=int, default=5, help="repetitions of each timing (default 5)")
    p.add_argument("--jobs", type=int, default=6, help="jobs in the timed sweeps (default 6)")
    p.add_argument("--pairs", type=int, default=5, help="standalone pairs (default 5)")
    p.add_argument("--quick", action="store_true", help="dry run: 1 repetition, 3-job sweeps")
    p.add_argument("--where", action="store_true", help="only the phases of one tracked run")
    p.add_argument("--timeline", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p.parse_args()


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


CPU: dict[str, list[float]] = collections.defaultdict(list)  # CPU seconds of each process
CPU_RATIOS: list[float] = []  # standalone pairs: tracked / untracked CPU seconds


def timed(cmd: list[str], cwd: Path, label: str | None = None) -> float:
    """Wall seconds of a command; its CPU seconds (user + system, all threads) go to CPU."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("MLFLOW_TRACKING_URI", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        sys.exit(f"failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr[-3000:]}")
    if label:
        CPU[label].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def ampsweep(*args: str) -> list[str]:
    return [sys.executable, "-m", "ampsweep", *args]


def prepared_store(folder: Path) -> str:
    from ampsweep.tracking import store

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    store.prepare(uri)
    return uri


def sweep_cmd(uri: str, jobs: int, *extra: str) -> list[str]:
    seeds = ",".join(str(i) for i in range(jobs))
    return ampsweep("train", "-m", f"trainer.seed={seeds}", f"tracking.uri={uri}",
                    "tracking.experiment=bench", *ONE_STEP, *extra)  # fmt: skip


def training_seconds(uri: str) -> list[float]:
    """perf/wall_s of every child run in the store (a job's training, evaluation included)."""
    from ampsweep.tracking import store

    client = store.client_for(uri)
    exp = client.get_experiment_by_name("bench")
    runs = client.search_runs([exp.experiment_id], f"tags.`{store.PARENT}` != ''", max_results=1000)
    return [r.data.metrics["perf/wall_s"] for r in runs if "perf/wall_s" in r.data.metrics]


def measure_processes(args, tmp: Path) -> dict[str, list[float]]:
    results: dict[str, list[float]] = collections.defaultdict(list)
    for rep in range(args.reps):
        folder = tmp / f"rep{rep}"
        folder.mkdir()
        uri = prepared_store(folder)
        imports = [sys.executable, "-c", "import torch, mlflow, hydra"]
        results["imports"].append(timed(imports, folder, "imports"))
        run = ampsweep("train", f"tracking.uri={uri}", *ONE_STEP)
        results["1-step run"].append(timed(run, folder, "1-step run"))
        untracked = ampsweep("train", "tracking=none", *ONE_STEP)
        results["1-step, untracked"].append(timed(untracked, folder, "1-step, untracked"))
        project = folder / "shapes"  # a user's project: their own model and data set
        shutil.copytree(REPO / "examples" / "shapes", project)
        own = ampsweep("train", "--config-dir", "conf", "model=shape_net", "dataset=shapes",
                       f"tracking.uri={uri}", *ONE_STEP)  # fmt: skip
        results["1-step, own model"].append(timed(own, project, "1-step, own model"))
        fresh = folder / "new_store"  # the store is created (and migrated) by the run
        fresh.mkdir()
        new = ampsweep("train", f"tracking.uri=sqlite:///{fresh / 'mlflow.db'}", *ONE_STEP)
        results["new store"].append(timed(new, fresh) - results["1-step run"][-1])
        for label, extra in (("with model", ()), ("without model", ("tracking.log_model=false",))):
            sub = folder / label.replace(" ", "_")
            sub.mkdir()
            one_uri, many_uri = prepared_store(sub / "one"), prepared_store(sub / "many")
            t1 = timed(sweep_cmd(one_uri, 1, *extra), sub / "one")
            tn = timed(sweep_cmd(many_uri, args.jobs, *extra), sub / "many")
            train = statistics.median(training_seconds(many_uri))
            results[f"sweep of 1 ({label})"].append(t1)
            results[f"sweep of {args.jobs} ({label})"].append(tn)
            if label == "with model":
                results["per job"].append((tn - t1) / (args.jobs - 1) - train)
                results["a job's training"].append(train)
        model = results[f"sweep of {args.jobs} (with model)"][-1]
        plain = results[f"sweep of {args.jobs} (without model)"][-1]
        results["model, per job"].append((model - plain) / args.jobs)
        print(f"  repetition {rep + 1}/{args.reps} done ({load_line()})", flush=True)
    return results


def measure_standalone(args, tmp: Path) -> tuple[dict[str, list[float]], list[float]]:
    """The default run as a user types it, tracked and untracked, in pairs run back to back
    (in alternating order, so that neither always runs first); the ratio of each pair (of the
    CPU seconds too: in CPU_RATIOS)."""
    folder = tmp / "standalone"
    folder.mkdir()
    uri = prepared_store(folder)
    variants = {
        "standalone, tracked": ampsweep("train", f"tracking.uri={uri}", *DEFAULT_RUN),
        "standalone, untracked": ampsweep("train", "tracking=none", *DEFAULT_RUN),
    }
    results: dict[str, list[float]] = collections.defaultdict(list)
    ratios = []
    for pair in range(args.pairs):
        order = list(variants) if pair % 2 == 0 else list(reversed(variants))
        wall = {name: timed(variants[name], folder, name) for name in order}
        for name, seconds in wall.items():
            results[name].append(seconds)
        ratios.append(wall["standalone, tracked"] / wall["standalone, untracked"])
        CPU_RATIOS.append(CPU["standalone, tracked"][-1] / CPU["standalone, untracked"][-1])
        print(f"  pair {pair + 1}/{args.pairs}: tracked {wall['standalone, tracked']:.2f} s, "
              f"untracked {wall['standalone, untracked']:.2f} s, ratio {ratios[-1]:.3f} "
              f"(CPU {CPU_RATIOS[-1]:.3f}; {load_line()})", flush=True)  # fmt: skip
    return results, ratios


# ---------------------------------------------------------------- where the seconds go

# The phases of a run, as (module, attribute): each is timed, wherever it runs.
PHASES = [
    ("hydra._internal.hydra", "Hydra.compose_config"),
    ("ampsweep.cli.train", "validate"), ("ampsweep.tracking.store", "prepare"),
    ("ampsweep.tracking.store", "client_for"),
    ("ampsweep.cli.train", "run_hydra"), ("ampsweep.runner.job", "Job.plan"),
    ("ampsweep.engine.build", "build_planned"), ("ampsweep.runner.job", "Job.open"),
    ("ampsweep.runner.job", "Job._tags"), ("ampsweep.tracking.recorder", "MlflowRecorder.start"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.log_params"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.log_text"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.set_tags"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.log_inputs"),
    ("ampsweep.tracking.system_metrics", "SystemMetrics._run"),
    ("ampsweep.tracking.system_metrics", "SystemMetrics._sample"),
    ("ampsweep.runner.job", "Job.train"), ("ampsweep.engine.loop", "fit"),
    ("ampsweep.runner.job", "Job.close"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.log_artifact"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.stop_system_metrics"),
    ("ampsweep.engine.checkpoint", "snapshot"), ("ampsweep.runner.ending", "RunEnd.finish"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.log_model"),
    ("ampsweep.tracking.logged_model", "log"),
    ("ampsweep.tracking.logged_model", "signature_output"),
    ("ampsweep.engine.checkpoint", "ModelSnapshot.predict"),
    ("mlflow.pytorch", "save_model"),
    ("ampsweep.tracking.recorder", "MlflowRecorder._link_metrics"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.end"),
    ("ampsweep.tracking.recorder", "MlflowRecorder.flush"),
]  # fmt: skip


def timeline(argv: list[str]) -> int:
    """One ``ampsweep`` command in this process, as ``ampsweep.cli.main.run`` runs it, each
    phase timed; the phases printed in the order they began."""
    import importlib
    import threading

    t0 = time.perf_counter()
    from ampsweep.cli import main as cli

    events: list[tuple[float, float, str, str]] = []

    def timer(name: str, fn):
        @functools.wraps(fn)
        def timed_call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                thread = threading.current_thread().name
                events.append((start - t0, time.perf_counter() - start, name, thread))

        return timed_call

    def phase(name: str, step):
        start = time.perf_counter()
        result = step()
        events.append((start - t0, time.perf_counter() - start, name, "MainThread"))
        return result

    # What a run imports (torch, Hydra, MLflow), as the command imports it, before the timers
    phase("imports", lambda: [importlib.import_module(m) for m, _ in PHASES])
    for module, attr in PHASES:
        owner = importlib.import_module(module)
        *path, last = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, last, timer(attr, getattr(owner, last)))
    sys.argv = ["ampsweep", *argv]
    code = phase("cli.main", lambda: cli.main(argv))
    phase("exit: threads joined, exit handlers", lambda: (threading._shutdown(), atexit()))
    print(f"{'start':>7} {'seconds':>8}  phase (thread other than the main one in brackets)")
    for start, seconds, name, thread in sorted(events):
        if seconds >= 0.003:
            where = "" if thread == "MainThread" else f" [{thread}]"
            print(f"{start:7.3f} {seconds:8.3f}  {name}{where}")
    print(f"{time.perf_counter() - t0:7.3f}           the whole process, after Python's start")
    return code


def atexit() -> None:
    import atexit as handlers

    handlers._run_exitfuncs()


def measure_where(tmp: Path) -> None:
    folder = tmp / "where"
    folder.mkdir()
    uri = prepared_store(folder)
    for label, extra in (("a 1-step run", ONE_STEP), ("the default run", DEFAULT_RUN)):
        print(f"\nwhere the seconds of {label} go (ampsweep train {' '.join(extra)}, tracked):")
        cmd = [sys.executable, __file__, "--timeline", "train", f"tracking.uri={uri}", *extra]
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        env.pop("MLFLOW_TRACKING_URI", None)
        res = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
        out = res.stdout
        print(out[out.index("  start") :].rstrip())  # the run's own output left out


def measure_in_process(tmp: Path) -> tuple[float, collections.Counter]:
    """Logging one model, warm; and the store calls of one 1-step job."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from ampsweep.config.compose import load
    from ampsweep.engine.build import build
    from ampsweep.engine.checkpoint import snapshot
    from ampsweep.runner.job import run_job
    from ampsweep.tracking import store
    from ampsweep.tracking.recorder import MlflowRecorder

    folder = tmp / "in_process"
    folder.mkdir()
    os.chdir(folder)
    uri = prepared_store(folder)
    cfg = load([f"tracking.uri={uri}", *ONE_STEP])
    with contextlib.redirect_stdout(io.StringIO()):
        run_job(cfg)  # warm: imports and first-use costs
    setup = build(cfg)
    times = []
    for _ in range(3):
        rec = MlflowRecorder.start(cfg.tracking, "bench-log-model", uri=uri)
        model = snapshot(setup.model, setup.val_batches)
        start = time.perf_counter()
        rec.log_model(model, 1)
        times.append(time.perf_counter() - start)
        rec.end(store.FINISHED)

    calls: collections.Counter = collections.Counter()
    originals = {}
    for name in dir(SqlAlchemyStore):
        fn = getattr(SqlAlchemyStore, name)
        if name.startswith("_") or not callable(fn) or name == "sanitize_metric_value":
            continue
        originals[name] = fn

        def counted(*a, _name=name, _fn=fn, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        setattr(SqlAlchemyStore, name, functools.wraps(fn)(counted))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run_job(cfg)
    finally:
        for name, fn in originals.items():
            setattr(SqlAlchemyStore, name, fn)
    return statistics.median(times), calls


def main() -> int:
    args = parse_args()
    if args.timeline is not None:
        return timeline(args.timeline)
    if args.where:
        print(f"at start: {load_line()}")
        with tempfile.TemporaryDirectory() as tmp:
            measure_where(Path(tmp))
        print(f"at end:   {load_line()}")
        return 0
    if args.quick:
        args.reps, args.jobs, args.pairs = 1, 3, 1
    print(f"ampsweep fixed-cost benchmark: cnn on digits, CPU, {args.reps} repetition(s), "
          f"sweeps of {args.jobs} one-step jobs; python {sys.version.split()[0]}")  # fmt: skip
    print(f"at start: {load_line()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results, ratios = measure_standalone(args, Path(tmp))
        results.update(measure_processes(args, Path(tmp)))
        log_model_s, calls = measure_in_process(Path(tmp))
    print(f"at end:   {load_line()}")
    print()
    header = f"{'measure':<30} {'median':>8} {'best':>8} {'worst':>8}"
    print(header)
    print("-" * len(header))
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:<30} {median:>7.2f}s {min(values):>7.2f}s {max(values):>7.2f}s")
    print(f"{'model, logging (in process)':<30} {log_model_s:>7.2f}s")
    ratio = statistics.median(ratios)
    print(
        f"{'tracked / untracked (paired)':<30} {ratio:>7.3f}x {min(ratios):>7.3f}x "
        f"{max(ratios):>7.3f}x"
    )
    print(f"{'  the same in CPU seconds':<30} {statistics.median(CPU_RATIOS):>7.3f}x "
          f"{min(CPU_RATIOS):>7.3f}x {max(CPU_RATIOS):>7.3f}x")  # fmt: skip
    print()
    for name, values in CPU.items():  # depends less on the machine's load than wall time
        print(f"CPU seconds of {name}: median {statistics.median(values):.2f} (user + system)")
    print()
    print(
        f"store calls of one 1-step job: {sum(calls.values())} "
        f"({', '.join(f'{n} {k}' for k, n in calls.most_common())})"
    )
    print()
    print(
        "per job = (sweep of N - sweep of 1) / (N - 1) - a job's training (perf/wall_s); "
        "model, per job = (sweep of N with the model - without) / N."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
