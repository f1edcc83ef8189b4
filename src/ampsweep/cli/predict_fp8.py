"""What ``ampsweep predict`` shows of fp8's layer filter (``engine.fp8.fp8_filter``): per
Linear layer and fp8 recipe, the predicted speed-up against bf16 on the GPU named, torchao's own
auto-filter's choice beside it, and the ``precision.fp8.keep_bf16=[...]`` that keeps the
layers predicted to lose in bf16, ready to paste."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape

from ampsweep import console
from ampsweep.precision.modes import MODES

if TYPE_CHECKING:  # named only: the engine imports torch
    from ampsweep.engine.fp8 import FilterAdvice, LayerAdvice


def advise(model, x, cfg, gpu) -> list[FilterAdvice]:
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


def as_json(advice: list[FilterAdvice]) -> dict:
    """``{"fp8_tensorwise": {...}, ...}``: each mode's layers, override and verdict."""
    return {f"fp8_{a.recipe}": a.table() for a in advice}


def _time_ms(la: LayerAdvice) -> float:
    return (la.bf16_s or 0.0) * 1e3


def print_advice(advice: list[FilterAdvice], top: int) -> None:
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
