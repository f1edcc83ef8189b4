"""The updates a half-precision weight rounds away: an optimizer step taken in fp32 on shadow
copies of the weights, from the run's own optimizer state, and the share of each parameter's
non-zero update smaller than half a unit in the last place of the weight in bf16 or fp16
(round to nearest keeps the weight as it was). The numerics probe (``measure.probe``) reports
it before training for every format; ``LostUpdates`` measures it on a pure half run's own steps.
Nothing of the run changes: the step is taken by a fresh optimizer over the copies.
"""

from __future__ import annotations

import torch

from ampsweep.measure import names
from ampsweep.precision.modes import FORMATS

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
            }  # fmt: skip
            for g in optimizer.param_groups
        ]
        shadow_opt = type(optimizer)(groups)
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
