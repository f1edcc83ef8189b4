"""``ampsweep predict --gpu NAME [OVERRIDES]``: what each precision mode would buy this model on
a GPU, predicted on any machine, no GPU needed.

The configured model and batch (the overrides ``ampsweep train`` takes) are built on the CPU,
one training step is traced on the meta device (``measure.trace``), and the roofline times it
per mode on the named GPU (``measure.prediction``): each mode's step time, its speed-up against
fp32 and TF32, the layers that take the time and what bounds each. Nothing is trained or
recorded. Beside it, fp8's layer filter (``engine.fp8.fp8_filter``): per Linear layer and fp8
recipe, the predicted speed-up against bf16, torchao's own auto-filter's choice, and the
``precision.fp8.keep_bf16=[...]`` that keeps the layers predicted to lose in bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

from rich.markup import escape

from ampsweep import console
from ampsweep.config.schema import ConfigError
from ampsweep.precision.modes import BASELINE, MODES

if TYPE_CHECKING:  # named only: the engine imports torch
    from ampsweep.engine.fp8 import FilterAdvice, LayerAdvice

DEFAULT_GPU = "h100"
TOP = 10


def add_parser(sub) -> None:
    p = sub.add_parser(
        "predict",
        help="predict each precision mode's step time and speed-up on a GPU (no GPU needed)",
        description="Trace one training step of the configured model and batch (Hydra "
        "overrides, as for train) and predict, by a roofline per kernel, each precision "
        "mode's step time and speed-up against fp32 and TF32 on the GPU named.",
    )
    p.add_argument(
        "--gpu", default=DEFAULT_GPU, help=f"the GPU: h100, a100, l4, ... (default {DEFAULT_GPU})"
    )
    p.add_argument(
        "--gpu-spec", metavar="FILE", help="any other GPU, described in a JSON or YAML file"
    )
    p.add_argument("--format", choices=["table", "json"], default="table", dest="fmt")
    p.add_argument("--top", type=int, default=TOP, help=f"layers shown (default {TOP})")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    from ampsweep.measure import roofline

    try:
        gpu = roofline.load_gpu_spec(args.gpu_spec) if args.gpu_spec else None
        gpu = gpu or roofline.gpu_spec(args.gpu)
        if args.top < 1:
            raise ConfigError(f"--top {args.top}: must be >= 1, e.g. --top {TOP}")
        cfg = plan(list(args.overrides))
    except (ConfigError, ValueError) as err:
        console.error(str(err))
        return 2
    from ampsweep.measure.prediction import predict

    try:
        model, fp8 = describe(cfg, gpu)
    except ConfigError as err:  # e.g. a precision.fp8.keep_bf16 name of no Linear layer
        console.error(str(err))
        return 2
    prediction = predict(gpu, model)
    if args.fmt == "json":
        data = {**as_json(prediction, cfg), "fp8_filter": fp8_json(fp8)}
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        print_prediction(prediction, cfg, args.top)
        print_fp8_advice(fp8, args.top)  # which layers fp8 is predicted to speed up
    return 0


def plan(overrides: list[str]):
    """The configuration as ``train`` would compose it, in fp32 on the CPU: the step is traced
    once in fp32 and every mode's formats are applied to it. Raises ConfigError."""
    from ampsweep.config.compose import load
    from ampsweep.config.sweeps import is_hydra_override
    from ampsweep.engine import components

    kept = [o for o in overrides if not is_hydra_override(o)]
    precision = [o for o in kept if o.split("=")[0].lstrip("+~") == "precision"]
    if precision:
        raise ConfigError(
            f"{precision[0]}: ampsweep predict predicts every precision mode at once: drop it"
        )
    fixed = ["precision=fp32", "trainer.device=cpu", "trainer.compile=false", "tracking=none"]
    return components.resolve(load([*kept, *fixed]))


def describe(cfg, gpu):
    """Build the model and a batch, trace one step, and say what the prediction needs; with
    fp8's layer filter on ``gpu`` (``fp8_advice``)."""
    from ampsweep.engine.build import build
    from ampsweep.engine.capacity import batch_of
    from ampsweep.engine.fp8 import plan as fp8_plan
    from ampsweep.engine.measured import traced_model

    setup = build(cfg)
    x, y = batch_of(setup, cfg.trainer.batch_size)
    try:
        converted: frozenset[str] | None = frozenset(
            fp8_plan(setup.model, x, cfg.precision.fp8, "tensorwise").converted
        )
        fp8 = fp8_advice(setup.model, x, cfg, gpu)
    except (RuntimeError, NotImplementedError):  # a model that runs neither on meta nor CPU
        converted, fp8 = None, []
    model = traced_model(setup.model, x, y, setup.objective, setup.optimizer, converted, cfg)
    return model, fp8


# A recorded run's overrides that are not the model, data and batch: the mode (every one is
# predicted), where it was recorded, Hydra's own settings and the run's callbacks.
NOT_THE_WORKLOAD = ("precision", "tracking", "hydra", "trainer.callbacks")


def for_report(gpu, overrides: list[str]) -> str:
    """The prediction a report gives for the configuration a run recorded (its ``overrides``
    tag), as one finding: the verdict, labelled as predicted; or why there is none."""
    from ampsweep.measure.prediction import predict

    kept = [o for o in overrides if not o.lstrip("+~").split("=")[0].startswith(NOT_THE_WORKLOAD)]
    try:
        model, _ = describe(plan(kept), gpu)
    except ConfigError as err:  # e.g. a run of a project's own config folder
        return f"No prediction for an {gpu.label}: the run's config does not compose here ({err})."
    verdict = predict(gpu, model).verdict()
    return f"Predicted, not measured (ampsweep predict --gpu {gpu.key}): {verdict}."


def as_json(prediction, cfg) -> dict:
    from ampsweep.measure.prediction import tf32_mode

    gpu = prediction.gpu
    modes = {}
    for name, m in prediction.modes.items():
        modes[name] = {
            "step_ms": m.step_s * 1e3,
            "speedup_vs_fp32": prediction.speedup(name),
            "speedup_vs_tf32": prediction.speedup(name, tf32_mode()),
            "shares": prediction.shares(name),
            "kernels": m.kernels,
            "layers": [
                {"name": la.name, "type": la.type, "ms": la.seconds * 1e3,
                 "math_ms": la.math_s * 1e3, "gflop": la.flops / 1e9, "bound": la.bound,
                 "fp8": la.fp8}
                for la in m.top(len(m.layers))
            ],
        }  # fmt: skip
    return {
        "predicted": True,
        "gpu": {"key": gpu.key, "label": gpu.label, "bandwidth_tbs": gpu.bandwidth,
                "sms": gpu.sms, "tflops": {k: getattr(gpu, k) for k in
                                           ("fp32", "tf32", "fp16", "bf16", "fp8")}},
        "config": {"model": cfg.model.name, "dataset": cfg.dataset.name,
                   "batch_size": cfg.trainer.batch_size},
        "modes": modes,
        "cannot_run": prediction.cannot,
        "verdict": prediction.verdict(),
    }  # fmt: skip


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.{max(0, 2 - math.floor(math.log10(ms)))}f}" if ms > 0 else "0"


def print_prediction(prediction, cfg, top: int) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from ampsweep.measure.prediction import tf32_mode

    out = console.console
    gpu = prediction.gpu
    out.print(
        f"[bold]Predicted[/] (a roofline per kernel, not measured) for {escape(cfg.model.name)} "
        f"on {escape(cfg.dataset.name)}, batch {cfg.trainer.batch_size}, on an {gpu.label} "
        f"({gpu.bandwidth:g} TB/s, {gpu.sms} SMs)"
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("mode", "step ms", "vs fp32", "vs TF32", "GEMMs", "compute", "memory", "launch"):
        table.add_column(col, justify="left" if col == "mode" else "right", no_wrap=True)
    for name, m in prediction.modes.items():
        shares = prediction.shares(name)
        vs_tf32 = prediction.speedup(name, tf32_mode())
        table.add_row(
            name,
            _ms(m.step_s),
            f"{prediction.speedup(name):.2f}x",
            "-" if vs_tf32 is None else f"{vs_tf32:.2f}x",
            f"{shares['math']:.0%}",
            *(f"{shares.get(bound, 0):.0%}" for bound in ("compute", "memory", "launch")),
        )
    out.print(table)
    for name, why in prediction.cannot.items():
        out.print(f"{name}: not predicted: {escape(why)}")
    print_layers(prediction, top)
    out.print(escape(prediction.verdict()))


def print_layers(prediction, top: int) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    base = prediction.modes[BASELINE]
    gains = {m: prediction.speedup(m) or 0.0 for m in prediction.modes}
    best = prediction.modes[max(gains, key=gains.__getitem__)]
    shown = [base] if best is base else [base, best]
    console.console.print(f"Top {top} layers by {BASELINE} time")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", no_wrap=True)
    table.add_column("type", no_wrap=True)
    table.add_column("GFLOP", justify="right")
    for m in shown:
        table.add_column(f"{m.mode} ms", justify="right")
        table.add_column("bound")
    for layer in base.top(top):
        cells = [escape(layer.name), escape(layer.type), f"{layer.flops / 1e9:,.3g}"]
        for m in shown:
            mine = m.layers.get(layer.name)
            fp8 = " (fp8)" if mine and mine.fp8 else ""
            cells += ["-", ""] if mine is None else [_ms(mine.seconds), mine.bound + fp8]
        table.add_row(*cells)
    console.console.print(table)


# ---------------------------------------------------------------- fp8's layer filter


def fp8_advice(model, x, cfg, gpu) -> list[FilterAdvice]:
    """The filter of each fp8 mode on ``model`` (fp32, any device) with a batch like ``x``,
    at the config's batch size; none on a GPU without fp8 tensor cores."""
    from ampsweep.engine.fp8 import fp8_filter, plan

    if gpu.peak("fp8") is None:
        return []
    fp8 = cfg.precision.fp8
    recipes = dict.fromkeys(m.fp8 for m in MODES.values() if m.fp8)
    return [
        fp8_filter(plan(model, x, fp8, recipe), gpu, cfg.trainer.batch_size, fp8.keep_bf16)
        for recipe in recipes
    ]


def fp8_json(advice: list[FilterAdvice]) -> dict:
    """``{"fp8_tensorwise": {...}, ...}``: each mode's layers, override and verdict."""
    return {f"fp8_{a.recipe}": a.table() for a in advice}


def _time_ms(la: LayerAdvice) -> float:
    return (la.bf16_s or 0.0) * 1e3


def print_fp8_advice(advice: list[FilterAdvice], top: int) -> None:
    """One table: the layers fp8 could take, the ``top`` by bf16 time first, a speed-up and
    torchao's choice per recipe; then each recipe's verdict with its override."""
    from rich import box
    from rich.table import Table

    if not advice:
        return
    layers = sorted(zip(*(a.layers for a in advice), strict=True), key=lambda ls: -_time_ms(ls[0]))
    console.console.print(
        f"fp8 per Linear layer (predicted against bf16 on the {escape(advice[0].gpu)}; torchao: "
        "whether its auto-filter converts the layer)"
    )
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("layer", no_wrap=True)
    table.add_column("M x K x N", justify="right", no_wrap=True)
    table.add_column("bf16 ms", justify="right")
    for a in advice:
        table.add_column(f"{a.recipe}", justify="right", no_wrap=True)
        table.add_column("torchao")
    for row in layers[:top]:
        first = row[0]
        cells = [escape(first.name), f"{first.m}x{first.k}x{first.n}"]
        cells.append("-" if first.bf16_s is None else f"{_time_ms(first):.3g}")
        for la in row:
            gain = "-" if la.speedup is None else f"{la.speedup:.2f}x {'fp8' if la.fp8 else 'bf16'}"
            cells += [gain, {True: "fp8", False: "bf16", None: "-"}[la.torchao]]
        table.add_row(*cells)
    console.console.print(table)
    if len(layers) > top:
        console.console.print(f"({len(layers) - top} more Linear layers: --top {len(layers)})")
    out = [f"{ls[0].name}: {ls[0].why}" for ls in layers if ls[0].speedup is None]
    if out:  # out of fp8 whatever the GPU
        console.console.print(escape("kept out by the model or the config: " + "; ".join(out)))
    for a in advice:
        console.console.print(escape(a.verdict()))
