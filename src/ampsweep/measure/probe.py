"""The numerics probe: every module's value ranges at fp32, held against each format's range.

``probe`` runs a few micro-batches forward and backward at fp32 (no autocast, half-precision
parameters upcast), at the weights the run starts from, with hooks on every leaf module (and
every module that holds parameters itself). Per module it records the largest magnitude and
the smallest non-zero magnitude of its outputs, of the gradients flowing back into them, of its
weights and of its weight gradients, with a histogram of their binary exponents. Held against
the format table (``precision.modes.FORMATS``) that gives, per module and format:

* **headroom**: how many powers of two the module's largest output sits below the format's
  largest value (negative: it overflows; fp16's limit is 65504);
* **gradient underflow**: the share of non-zero gradient values fp16 would flush to zero
  without loss scaling (|g| < 2^-25), and the power-of-two loss scale that keeps them, chosen
  one binade below the scale at which the largest gradient would overflow;
* **lost updates**: one optimizer step taken in fp32 from the run's optimizer state, on
  shadow copies of the weights: the share of each parameter's non-zero update that is smaller
  than half a unit in the last place of the weight in bf16 or fp16, which a pure half model's
  rounding throws away (``update_lost_shares``; ``LostUpdates`` measures it on a pure run's
  own steps, as a callback of the training loop).

Nothing of the run changes: the passes use copies of the parameters and buffers, the random
state is restored, the optimizer step is taken on a fresh optimizer over the copies.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ampsweep.measure import names
from ampsweep.measure.hooks import OpWatch, hook_forward, op_name, tensors
from ampsweep.precision.modes import FORMATS

ARTIFACT_JSON, ARTIFACT_MD = names.PROBE_JSON, names.PROBE_MD
FP16 = FORMATS["fp16"]
ZERO_BELOW = FP16.min_subnormal / 2  # |x| < this rounds to zero in fp16
MAX_SCALE = 2.0**24  # the largest loss scale suggested (GradScaler's range in practice)


@dataclass
class Range:
    """The magnitudes seen in one kind of tensor of one module."""

    absmax: float = 0.0
    minnz: float = math.inf  # the smallest non-zero magnitude
    nonzero: int = 0
    nonfinite: int = 0
    exponents: dict[int, int] = field(default_factory=dict)  # floor(log2|x|) -> count

    def add(self, t: torch.Tensor) -> None:
        a = t.detach().float().abs().flatten()
        finite = torch.isfinite(a)
        self.nonfinite += int((~finite).sum())
        a = a[finite & (a > 0)]
        if a.numel() == 0:
            return
        self.absmax = max(self.absmax, float(a.max()))
        self.minnz = min(self.minnz, float(a.min()))
        self.nonzero += a.numel()
        exps = torch.floor(torch.log2(a)).to(torch.int64)
        values, counts = torch.unique(exps, return_counts=True)
        for e, c in zip(values.tolist(), counts.tolist(), strict=True):
            self.exponents[e] = self.exponents.get(e, 0) + c

    def below(self, threshold: float, scale: float = 1.0) -> int:
        """How many non-zero values times ``scale`` are below ``threshold`` (from the
        exponents: a value with exponent e lies in [2^e, 2^(e+1)))."""
        limit = math.log2(threshold / scale)
        return sum(c for e, c in self.exponents.items() if e + 1 <= limit)

    def headroom(self, fmt: str) -> float | None:
        """Powers of two between the largest value and the format's largest (None: no data)."""
        return math.log2(FORMATS[fmt].max / self.absmax) if self.absmax > 0 else None

    def as_dict(self) -> dict:
        return {
            "absmax": self.absmax,
            "minnz": self.minnz if self.nonzero else None,
            "nonzero": self.nonzero,
            "nonfinite": self.nonfinite,
        }


@dataclass
class ModuleRanges:
    name: str
    kind: str  # the module's class
    output: Range = field(default_factory=Range)
    output_grad: Range = field(default_factory=Range)
    weight: Range = field(default_factory=Range)
    weight_grad: Range = field(default_factory=Range)

    def row(self) -> dict:
        grads = self.output_grad.nonzero + self.weight_grad.nonzero
        lost = self.output_grad.below(ZERO_BELOW) + self.weight_grad.below(ZERO_BELOW)
        return {
            "module": self.name,
            "type": self.kind,
            "output": self.output.as_dict(),
            "output_grad": self.output_grad.as_dict(),
            "weight": self.weight.as_dict(),
            "weight_grad": self.weight_grad.as_dict(),
            "headroom_log2": {f: self.output.headroom(f) for f in ("fp16", "bf16", "fp8_e4m3")},
            "fp16_grad_underflow_frac": lost / grads if grads else 0.0,
        }


@dataclass
class Probe:
    """What ``probe`` measured, and what follows from it for each format."""

    modules: list[ModuleRanges]
    batches: int
    update_lost: dict[str, dict[str, float]] = field(default_factory=dict)  # fmt -> param -> share
    # module -> op -> the largest magnitude of the op's outputs, for the ops inside a forward
    # (``attn``'s ``matmul``), which no module's output shows
    ops: dict[str, dict[str, float]] = field(default_factory=dict)

    def _grad_ranges(self) -> list[Range]:
        return [r for m in self.modules for r in (m.output_grad, m.weight_grad)]

    def fp16_overflow(self) -> list[tuple[str, float]]:
        """Modules whose output, or an op inside whose forward, exceeds fp16's largest value:
        (name, largest magnitude)."""
        top = {m.name: m.output.absmax for m in self.modules}
        for name, ops in self.ops.items():
            top[name] = max(top.get(name, 0.0), *ops.values())
        return sorted(((n, v) for n, v in top.items() if v > FP16.max), key=lambda x: -x[1])

    def fp8_saturating(self) -> list[tuple[str, str, float, float]]:
        """The Linear layers whose values an unscaled cast to fp8 would saturate: (module,
        what, largest magnitude, the format's limit), for weights and outputs against e4m3
        (fp8's forward format) and output gradients against e5m2 (its backward format).
        torchao's float8 training scales each tensor (or row) to its own amax before the
        cast, so these saturate only without that scaling; what the scaled cast loses is the
        values far below amax."""
        e4m3, e5m2 = FORMATS["fp8_e4m3"].max, FORMATS["fp8_e5m2"].max
        out = []
        for m in self.modules:
            if m.kind != "Linear":
                continue
            for what, r, limit in (
                ("weight", m.weight, e4m3),
                ("output", m.output, e4m3),
                ("output gradient", m.output_grad, e5m2),
            ):
                if r.absmax > limit:
                    out.append((m.name, what, r.absmax, limit))
        return out

    def forward_headroom(self, fmt: str = "fp16") -> tuple[str, float] | None:
        """The module, or the op inside a module's forward (``attn (its matmul)``), with the
        least headroom in ``fmt``, and that headroom (log2). A module's own output wins a tie
        with the op that made it."""
        rooms = [(m.name, h) for m in self.modules if (h := m.output.headroom(fmt)) is not None]
        least = min(rooms, key=lambda x: x[1]) if rooms else None
        for name, ops in self.ops.items():
            for op, top in ops.items():
                room = math.log2(FORMATS[fmt].max / top) if top > 0 else None
                if room is not None and (least is None or room < least[1] - 1e-9):
                    least = (f"{name or 'model'} (its {op})", room)
        return least

    def grad_underflow(self, scale: float = 1.0) -> float:
        """The share of non-zero gradient values fp16 flushes to zero at loss scale ``scale``."""
        ranges = self._grad_ranges()
        total = sum(r.nonzero for r in ranges)
        lost = sum(r.below(ZERO_BELOW, scale) for r in ranges)
        return lost / total if total else 0.0

    def suggested_scale(self) -> float:
        """The power-of-two loss scale one binade below the one at which the largest gradient
        (of an activation or a weight) would overflow fp16; at most 2^24, at least 1."""
        top = max((r.absmax for r in self._grad_ranges()), default=0.0)
        if top <= 0:
            return 1.0
        return float(min(MAX_SCALE, max(1.0, 2.0 ** (math.floor(math.log2(FP16.max / top)) - 1))))

    def metrics(self) -> dict[str, float]:
        scale = self.suggested_scale()
        out = {
            names.UNDERFLOW: self.grad_underflow(),
            names.INIT_SCALE: scale,
            names.UNDERFLOW_AT_SCALE: self.grad_underflow(scale),
        }
        least = self.forward_headroom("fp16")
        if least is not None:
            out[names.HEADROOM] = least[1]
        for fmt, shares in self.update_lost.items():
            out[names.UPDATE_LOST[fmt]] = shares.get("(all)", 0.0)
        return out

    def tags(self) -> dict[str, str]:
        tags = {}
        over = self.fp16_overflow()
        if over:
            tags[names.FP16_OVERFLOW] = names.pairs([(n or "(model)", v) for n, v in over], ".3g")
        saturating = self.fp8_saturating()
        if saturating:
            tags[names.FP8_SATURATING] = names.pairs(
                [(f"{n}.{w.replace(' ', '_')}", v) for n, w, v, _ in saturating], ".3g"
            )
        lost = {k: v for k, v in self.update_lost.get("bf16", {}).items() if k != "(all)"}
        worst = sorted(((k, v) for k, v in lost.items() if v > 0), key=lambda x: -x[1])[:8]
        if worst:
            tags[names.UPDATE_LOST_LAYERS] = names.pairs(worst, ".2f")
        return tags

    def as_dict(self) -> dict:
        return {
            "batches": self.batches,
            "summary": self.metrics(),
            "fp16_overflow": [
                {"module": n, "absmax": v, "limit": FP16.max} for n, v in self.fp16_overflow()
            ],
            "update_lost": self.update_lost,
            "ops": self.ops,
            "fp8_saturating_unscaled": [
                {"module": n, "what": w, "absmax": v, "limit": lim}
                for n, w, v, lim in self.fp8_saturating()
            ],
            "modules": [m.row() for m in self.modules],
        }

    def markdown(self) -> str:
        lines = [
            f"Numerics probe: {self.batches} micro-batch(es) at fp32. Headroom: powers of two "
            "between a module's largest output and the format's largest value (negative: "
            "overflow). Underflow: share of its non-zero gradient values fp16 flushes to zero "
            "without loss scaling.",
            "",
            "| module | type | output max | fp16 headroom | bf16 headroom | grad max | grad min "
            "| fp16 underflow |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m in self.modules:
            r = m.row()
            grad = [x for x in (m.output_grad, m.weight_grad) if x.nonzero]
            gmax = max((x.absmax for x in grad), default=0.0)
            gmin = min((x.minnz for x in grad), default=math.inf)
            lines.append(
                f"| {m.name or '(model)'} | {m.kind} | {m.output.absmax:.3g} | "
                f"{_fmt(r['headroom_log2']['fp16'])} | {_fmt(r['headroom_log2']['bf16'])} | "
                f"{gmax:.3g} | {gmin:.3g} | {r['fp16_grad_underflow_frac']:.3g} |"
            )
        for fmt, shares in self.update_lost.items():
            lines += ["", f"Updates a pure {fmt} model would round away (share of non-zero):", ""]
            lines += [f"- {k}: {v:.3g}" for k, v in sorted(shares.items(), key=lambda x: -x[1])]
        return "\n".join(lines) + "\n"

    def write(self, folder: Path) -> list[Path]:
        folder.mkdir(parents=True, exist_ok=True)
        json_path, md_path = folder / Path(ARTIFACT_JSON).name, folder / Path(ARTIFACT_MD).name
        json_path.write_text(json.dumps(self.as_dict(), indent=2))
        md_path.write_text(self.markdown())
        return [json_path, md_path]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}"


def _measured(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules the probe reports on: the leaves, and any module holding parameters."""
    return [
        (n, m)
        for n, m in module.named_modules()
        if next(m.children(), None) is None or next(m.parameters(recurse=False), None) is not None
    ]


def probe(
    module: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    objective,
    loss_weight: float = 1.0,
    optimizer: torch.optim.Optimizer | None = None,
) -> Probe:
    """Measure ``module`` on ``batches`` at fp32 (see the module docstring). ``optimizer``:
    the run's, for the lost-update shares (none: not measured)."""
    measured = _measured(module)
    ranges = {n: ModuleRanges(n, type(m).__name__) for n, m in measured}
    params = {
        n: p.detach().float().clone().requires_grad_(p.requires_grad)
        for n, p in module.named_parameters()
    }
    buffers = {
        n: b.detach().clone().float() if b.is_floating_point() else b.detach().clone()
        for n, b in module.named_buffers()
    }
    owner = {n: n.rpartition(".")[0] for n in params}
    for n, p in params.items():
        if owner[n] in ranges:
            ranges[owner[n]].weight.add(p)

    ops: dict[str, dict[str, float]] = {}

    def on_op(name, func, args, kwargs, out):
        for t in tensors(out):
            a = t.detach().abs()
            a = a[torch.isfinite(a)]
            if a.numel():
                seen = ops.setdefault(name, {})
                seen[op_name(func)] = max(seen.get(op_name(func), 0.0), float(a.max()))

    def forward_hook(mod, args, kwargs, out, name):
        watch.paused = True  # the probe's own measuring is not the model's op
        for t in tensors(out):
            ranges[name].output.add(t)
            if t.requires_grad:
                t.register_hook(lambda g, name=name: ranges[name].output_grad.add(g))
        watch.paused = False

    watch = OpWatch(module, on_op)
    handles = []
    try:
        for n, m in measured:
            handles.append(hook_forward(m, functools.partial(forward_hook, name=n), n))
        with watch:
            grads = _passes(module, params, buffers, batches, objective, loss_weight, ranges, owner)
    finally:
        for h in handles:
            h.remove()
    result = Probe([ranges[n] for n, _ in measured], len(batches), ops=ops)
    if optimizer is not None and grads:
        result.update_lost = update_lost_shares(module, optimizer, grads)
    return result


def _passes(module, params, buffers, batches, objective, loss_weight, ranges, owner):
    """Forward and backward at fp32 on every batch; the last batch's parameter gradients."""
    wanted = {n: p for n, p in params.items() if p.requires_grad}
    grads: dict[str, torch.Tensor] = {}
    device = next(iter(params.values())).device if params else torch.device("cpu")
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=False):
        for x, y in batches:
            inputs = x.float() if x.is_floating_point() else x
            out = torch.func.functional_call(module, {**params, **buffers}, (inputs,))
            loss = objective(out, y) * loss_weight
            found = torch.autograd.grad(loss, list(wanted.values()), allow_unused=True)
            grads = {n: g for n, g in zip(wanted, found, strict=True) if g is not None}
            for n, g in grads.items():
                if owner[n] in ranges:
                    ranges[owner[n]].weight_grad.add(g)
    return grads


# -------------------------------------------------- the updates a half weight rounds away

LOST_FORMATS = ("bf16", "fp16")  # the formats a pure mode stores weights in


def half_ulp(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Half a unit in the last place of each weight when stored in ``fmt``: an update smaller
    than this rounds back to the same weight (round to nearest)."""
    f = FORMATS[fmt]
    a = w.abs().clamp(min=f.min_normal)  # subnormal weights: the spacing is the smallest step
    return torch.exp2(torch.floor(torch.log2(a)) - f.mantissa_bits) / 2


def update_lost_shares(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    grads: dict[str, torch.Tensor],
    formats: tuple[str, ...] = LOST_FORMATS,
) -> dict[str, dict[str, float]]:
    """One step of ``optimizer``'s kind, from its state, in fp32 on shadow copies of the
    weights with ``grads``: per format and parameter, the share of the non-zero updates
    smaller than half an ulp of the weight (``(all)``: every parameter together). Empty
    where the optimizer cannot be rebuilt over copies."""
    named = dict(module.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    shadow = {n: p.detach().float().clone() for n, p in named.items()}
    try:
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [shadow[by_id[id(p)]] for p in g["params"]],
            }
            for g in optimizer.param_groups
        ]
        # the optimizer's own class: its parameters, then its settings (in each group)
        make: Callable[..., torch.optim.Optimizer] = type(optimizer)
        shadow_opt = make(groups)
        shadow_opt.load_state_dict(optimizer.state_dict())  # state cast to fp32 copies
    except Exception:  # an optimizer that cannot be rebuilt this way: not measured
        return {}
    before = {n: t.clone() for n, t in shadow.items()}
    for n, t in shadow.items():
        g = grads.get(n)
        t.grad = g.detach().float() if g is not None else None
    shadow_opt.step()
    out: dict[str, dict[str, float]] = {}
    for fmt in formats:
        shares, lost_all, moved_all = {}, 0, 0
        for n, w in before.items():
            delta = shadow[n] - w
            moved = delta != 0
            lost = moved & (delta.abs() < half_ulp(w, fmt))
            m, lo = int(moved.sum()), int(lost.sum())
            if m:
                shares[n] = lo / m
            lost_all, moved_all = lost_all + lo, moved_all + m
        shares["(all)"] = lost_all / moved_all if moved_all else 0.0
        out[fmt] = shares
    return out


class LostUpdates:
    """A pure half-precision run's callback: at its diagnostics steps, the share of the
    update it is about to apply that its weights' format rounds away (``amp/update_lost_frac``;
    per parameter in ``shares``). One extra optimizer step on fp32 copies per measurement."""

    def __init__(self, fmt: str, every: int):
        self.fmt, self.every = fmt, every
        self.shares: dict[str, float] = {}

    def before_update(self, view) -> None:
        if view.step % self.every:
            return
        grads = {n: p.grad for n, p in view.module.named_parameters() if p.grad is not None}
        found = update_lost_shares(view.module, view.optimizer, grads, (self.fmt,))
        if found:
            self.shares = found[self.fmt]
            view.log({names.RUN_UPDATE_LOST: self.shares["(all)"]}, view.step)

    def after_step(self, state) -> None: ...
