#!/usr/bin/env python
"""What locating non-finite steps costs a run whose steps are all finite.

  python scripts/bench_locator.py                               # cnn on digits, CPU
  python scripts/bench_locator.py --model mlp --precisions fp32,fp16,bf16 --repeats 7
  python scripts/bench_locator.py --device cuda --model resnet18 --dataset synthetic \\
      --batch-size 256 --steps 200                              # the same on a GPU
  python scripts/bench_locator.py --quick                       # a dry run of a few seconds

The locator (``diagnostics.locate_nonfinite``, on by default) reads one flag per optimizer
step: with a GradScaler the scaler's own inf check (which ``scaler.step`` reads anyway), and
without one the loss and the gradients' total norm (one pass over the gradients). Only a
non-finite step is replayed. Each repetition runs the same config with the locator on and off
back to back (in alternating order, so a change of machine load hits both), in-process
(``engine.build.build`` then ``engine.loop.fit``, tracking off, building not timed). Printed:
the median step time of each and the median of the per-repetition ratios on/off (target:
<= 1.02, i.e. within the noise of a step).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))  # run from a checkout without installing

import torch  # noqa: E402

from ampsweep.config.compose import load  # noqa: E402
from ampsweep.engine.build import build  # noqa: E402
from ampsweep.engine.loop import fit  # noqa: E402


def step_ms(args: argparse.Namespace, precision: str, locate: bool) -> float:
    cfg = load([
        f"model={args.model}", f"dataset={args.dataset}", f"precision={precision}",
        f"trainer.device={args.device}", f"trainer.batch_size={args.batch_size}",
        f"trainer.max_steps={args.steps}", "trainer.epochs=1000", "trainer.progress=false",
        "trainer.timing_warmup_steps=5", "tracking=none", "dataset.preload=true",
        f"diagnostics.locate_nonfinite={str(locate).lower()}",
    ])  # fmt: skip
    setup = build(cfg)
    summary = fit(setup, lambda metrics, step: None)
    assert summary["numerics/nonfinite_steps"] == 0, "a non-finite step: pick a stable config"
    return summary["perf/step_time_ms"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--precisions", default="fp32,fp16,bf16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a dry run: 20 steps, 2 repeats")
    args = p.parse_args()
    if args.quick:
        args.steps, args.repeats = 20, 2
    threads = torch.get_num_threads()
    print(f"bench_locator: {args.model} on {args.dataset}, {args.device}, batch "
          f"{args.batch_size}, {args.steps} steps x {args.repeats} repeats; torch "
          f"{torch.__version__}, {platform.processor() or platform.machine()}, {threads} "
          f"threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '-')}")  # fmt: skip
    print(f"{'mode':<8} {'on ms':>8} {'off ms':>8} {'on/off':>7}  (median of paired ratios)")
    worst = 0.0
    for precision in args.precisions.split(","):
        on, off, ratios = [], [], []
        for i in range(args.repeats):
            order = (True, False) if i % 2 == 0 else (False, True)
            times = {locate: step_ms(args, precision, locate) for locate in order}
            on.append(times[True])
            off.append(times[False])
            ratios.append(times[True] / times[False])
        ratio = statistics.median(ratios)
        worst = max(worst, ratio)
        print(f"{precision:<8} {statistics.median(on):>8.3f} {statistics.median(off):>8.3f} "
              f"{ratio:>7.3f}")  # fmt: skip
    print(f"target on/off <= 1.02: {'met' if worst <= 1.02 else 'NOT met'} (worst {worst:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
