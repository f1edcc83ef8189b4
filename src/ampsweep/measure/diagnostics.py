"""Gradient-underflow diagnostics: how much of the gradient fp16 cannot hold, and what the
loss scaler rescues.

Every ``diagnostics.every`` optimizer steps (0, the default, turns it off: it costs one extra
forward and backward), right after ``scaler.unscale_`` in the loop, ``Diagnostics.measure``
looks at two sets of parameter gradients of the same micro-batch:

* the *reference*: the true gradient, recomputed in fp32 without autocast, of the same loss
  (times ``trainer.loss_multiplier`` and over the accumulation steps, exactly what one
  micro-batch's backward carries), at the current weights. Measuring it, not the run's own
  gradients, gives every precision mode the same meaning: in fp16 without scaling the
  tiny values are already gone from the run's gradients (so they would show no underflow at
  all), and in fp16 with a scaler the run's gradients only hold what the scaler let survive.
* the run's own gradients as the optimizer will apply them (after ``unscale_``).

Metrics (fractions in [0, 1]):

``amp/grad_underflow_frac``
    share of the reference's non-zero values that fp16 rounds to zero: ``|g| <= 2^-25``, half
    of fp16's smallest subnormal 2^-24 (round-to-nearest sends values up to half of it to
    zero and values above it up to 2^-24). What fp16 without loss scaling loses.
``amp/grad_subnormal_frac``
    share with ``|g| < 2^-14``, fp16's smallest normal: held with fewer significant bits, or
    lost (includes the underflowing ones).
``amp/grad_underflow_frac_scaled``, ``amp/grad_subnormal_frac_scaled``
    runs with a scaler: the same after multiplying by the current loss scale S, i.e. what is
    still lost (or imprecise) with the scaler. The scaler rescues the difference.
``amp/grad_zero_frac``
    share of the run's own gradient values that are exactly zero.
``amp/grad_flushed_frac``
    share of the reference's non-zero values that are exactly zero in the run's own
    gradients: gradient that this run actually lost (near 0 in fp32/bf16; the measured loss
    in fp16_noscale). Exact with ``trainer.grad_accum_steps=1`` and no dropout; with
    accumulation the run's gradient sums several micro-batches and the comparison is
    approximate.

The thresholds apply to parameter gradients. In autocast modes the activation gradients
inside the backward pass are fp16 too and underflow the same way; the parameter gradients
are computed from them, so a flush upstream shows up as ``grad_flushed_frac`` downstream.
"""

from __future__ import annotations

import csv
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from ampsweep.config.schema import DiagnosticsConfig
from ampsweep.measure.cost import LossFn, cross_entropy
from ampsweep.precision.modes import FORMATS

# |x| <= this rounds to 0 in fp16 (half of the smallest subnormal 2^-24)
FP16_ZERO_AT = FORMATS["fp16"].min_subnormal / 2
FP16_MIN_NORMAL = FORMATS["fp16"].min_normal

# Per-parameter counters, summed over measurements.
COUNTS = (
    "numel",
    "ref_nonzero",
    "underflow",
    "subnormal",
    "underflow_scaled",
    "subnormal_scaled",
    "zero",
    "flushed",
)
METRICS = {
    "amp/grad_underflow_frac": ("underflow", "ref_nonzero"),
    "amp/grad_subnormal_frac": ("subnormal", "ref_nonzero"),
    "amp/grad_underflow_frac_scaled": ("underflow_scaled", "ref_nonzero"),
    "amp/grad_subnormal_frac_scaled": ("subnormal_scaled", "ref_nonzero"),
    "amp/grad_zero_frac": ("zero", "numel"),
    "amp/grad_flushed_frac": ("flushed", "ref_nonzero"),
}
SCALED = ("amp/grad_underflow_frac_scaled", "amp/grad_subnormal_frac_scaled")


class Diagnostics:
    """Measures gradient underflow every ``cfg.every`` steps; keeps per-layer totals."""

    def __init__(
        self,
        cfg: DiagnosticsConfig | None = None,
        loss_weight: float = 1.0,
        loss: LossFn = cross_entropy,
    ):
        cfg = cfg or DiagnosticsConfig()
        self.every, self.per_layer, self.loss_weight = cfg.every, cfg.per_layer, loss_weight
        self.loss = loss  # the run's loss (its objective)
        self.names: list[str] = []
        self.totals: torch.Tensor | None = None  # (layers, len(COUNTS)) float64, on the CPU
        self.measurements = 0
        self.scaled = False

    def due(self, step: int) -> bool:
        """Whether to measure at this optimizer step (1-based). One comparison when off."""
        return self.every > 0 and step % self.every == 0

    def before_update(self, view) -> None:
        """The training loop's hook (``engine.loop.Callback``): at a due step, measure on the
        step's last micro-batch and log the fractions."""
        if self.due(view.step):
            x, y = view.micro_batches[-1]
            view.log(self.measure(view.module, view.scaler, x, y, self.loss), view.step)

    def after_step(self, state) -> None: ...

    def measure(
        self,
        module: torch.nn.Module,
        scaler: torch.amp.GradScaler,
        x: torch.Tensor,
        y: torch.Tensor,
        loss: LossFn = cross_entropy,
    ) -> dict[str, float]:
        """Measure this step's gradients (call between ``unscale_`` and ``step``) on the plain
        module (not compiled, not DDP: its parameters are the run's). ``loss(logits, y)``: the
        run's loss (the training loop's objective)."""
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        reference = reference_grads(module, named, x, y, self.loss_weight, loss)
        scale = scaler.get_scale() if scaler.is_enabled() else None  # one sync
        self.scaled = scale is not None
        rows = [_counts(p, ref, scale) for (_, p), ref in zip(named, reference, strict=True)]
        counts = torch.stack(rows).to("cpu", torch.float64)  # one more sync, for all layers
        if self.totals is None:
            self.names = [n for n, _ in named]
            self.totals = torch.zeros_like(counts)
        self.totals += counts
        self.measurements += 1
        return _fractions(counts.sum(0), self.scaled)

    # ---------------------------------------------------------------- the per-layer table

    def table(self) -> list[dict]:
        """One row per parameter: its counters summed over every measurement, as fractions."""
        if self.totals is None:
            return []
        rows: list[dict[str, Any]] = []  # a layer's name, its size and its fractions
        for name, counts in zip(self.names, self.totals, strict=True):
            row = {"layer": name, "numel": int(counts[0]) // max(1, self.measurements)}
            row.update({k.split("/", 1)[1]: v for k, v in _fractions(counts, self.scaled).items()})
            rows.append(row)
        total = {"layer": "(all)", "numel": sum(r["numel"] for r in rows)}
        frac = _fractions(self.totals.sum(0), self.scaled)
        total.update({k.split("/", 1)[1]: v for k, v in frac.items()})
        return rows + [total]

    def write_tables(self, folder: Path) -> list[Path]:
        """``grad_underflow.csv``, ``.json`` and ``.md`` in ``folder``; none if never measured."""
        rows = self.table()
        if not rows or not self.per_layer:
            return []
        folder.mkdir(parents=True, exist_ok=True)
        columns = list(rows[0])
        buf = io.StringIO()
        writer = csv.DictWriter(buf, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        paths = [folder / "grad_underflow.csv", folder / "grad_underflow.json"]
        paths[0].write_text(buf.getvalue())
        meta = {"measurements": self.measurements, "every": self.every, "layers": rows}
        paths[1].write_text(json.dumps(meta, indent=2))
        paths.append(folder / "grad_underflow.md")
        paths[2].write_text(markdown_table(rows, self.measurements))
        return paths

    def log_artifacts(self, recorder) -> None:
        """Write the per-layer tables and log them under the run's ``diagnostics/`` folder."""
        with tempfile.TemporaryDirectory() as tmp:
            for path in self.write_tables(Path(tmp)):
                recorder.log_artifact(path, "diagnostics")


def reference_grads(
    module: torch.nn.Module,
    named: list[tuple[str, torch.nn.Parameter]],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_weight: float,
    loss: LossFn = cross_entropy,
) -> tuple[torch.Tensor, ...]:
    """The fp32 gradient of the weighted loss on ``(x, y)`` at the current weights.

    No autocast; half-precision parameters (pure modes) are upcast. Nothing of the run's state
    changes: gradients go to detached leaves, buffers are copies, the RNG is restored.
    """
    params = {n: p.detach().float().requires_grad_() for n, p in named}
    buffers = {
        n: b.detach().clone().float() if b.is_floating_point() else b.detach().clone()
        for n, b in module.named_buffers()
    }
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autocast(x.device.type, enabled=False):
        inputs = x.float() if x.is_floating_point() else x
        logits = torch.func.functional_call(module, {**params, **buffers}, (inputs,))
        weighted = loss(logits, y) * loss_weight
        return torch.autograd.grad(weighted, list(params.values()), allow_unused=True)


def _counts(param: torch.Tensor, ref: torch.Tensor | None, scale: float | None):
    """The COUNTS of one parameter, as a float tensor on its device (no sync)."""
    grad, numel = param.grad, param.numel()
    if ref is None:  # the parameter does not reach the loss
        ref = torch.zeros_like(param, dtype=torch.float32)
    a = ref.abs()
    nonzero = (a > 0) & torch.isfinite(a)
    values = [
        torch.tensor(float(numel), device=a.device),
        nonzero.sum(),
        (nonzero & (a <= FP16_ZERO_AT)).sum(),
        (nonzero & (a < FP16_MIN_NORMAL)).sum(),
    ]
    if scale is not None:  # |g * S| below the threshold  <=>  |g| below threshold / S
        values += [
            (nonzero & (a <= FP16_ZERO_AT / scale)).sum(),
            (nonzero & (a < FP16_MIN_NORMAL / scale)).sum(),
        ]
    else:
        values += [torch.zeros((), device=a.device)] * 2
    zero = grad == 0 if grad is not None else torch.ones_like(a, dtype=torch.bool)
    values += [zero.sum(), (nonzero & zero).sum()]
    return torch.stack([v.float() for v in values])


def _fractions(counts: torch.Tensor, scaled: bool) -> dict[str, float]:
    c = dict(zip(COUNTS, counts.tolist(), strict=True))
    out = {}
    for metric, (num, den) in METRICS.items():
        if metric in SCALED and not scaled:
            continue
        out[metric] = c[num] / c[den] if c[den] else 0.0
    return out


def markdown_table(rows: list[dict], measurements: int) -> str:
    columns = list(rows[0])
    lines = [
        f"Gradient underflow per layer, pooled over {measurements} measurement(s). Fractions "
        "of the reference (fp32) gradient's non-zero values; zero_frac of all values.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
