"""Non-finite steps: stopping a run whose loss stays non-finite (``NonfiniteWatch``), and where
a non-finite value first appears (``NonfiniteLocator``: the step that went inf/NaN, replayed with
hooks).

``NonfiniteLocator`` is a callback of the training loop (``engine.loop.fit``). At every
optimizer step, after ``scaler.unscale_`` and before the update, it reads one flag: did this
step's loss or gradients hold inf/NaN? With a GradScaler that flag is the scaler's own inf
check, which ``scaler.step`` reads anyway; without one it is the same check run at a scale of
1 (one fused pass over the gradients per device and dtype, which leaves them as they were),
and the loss: a read of a scalar or two per step. Only on the first
non-finite step does it do more: it replays the step's micro-batches at the weights they
saw (the update has not been applied yet), in the run's autocast, at the run's loss scale,
with hooks on every module, and names where the value began:

* ``forward``: the first module (in the order modules finish) whose output is non-finite
  while its inputs were finite; the output is recomputed in fp32 to say what value the format
  could not hold (a forward overflow: fp16's largest value is 65504);
* ``loss``: every module's output finite, the loss not;
* ``output_grad``: the first non-finite value of the backward pass is the gradient the loss
  passed back to the model's output (the model's head: a regression's large targets, or the
  loss scale, overflow the head's half-precision output gradient);
* ``weight_grad``: the first non-finite value of the backward pass is a parameter's gradient,
  while the gradient flowing into that module's output was finite (a backward overflow of a
  scaled gradient, or a kernel of this device);
* ``input_grad``: it is the gradient flowing into a module's output, so the module(s) that
  consumed that output turned their finite output gradient into a non-finite input gradient;
* ``not_reproduced``: the replay stayed finite; ``not_hookable``: a module takes no hooks.

The replay runs on copies of the parameters and buffers (``torch.func.functional_call``), so
the run's weights, gradients, BatchNorm statistics and random state are untouched. A model with
dropout draws another mask in the replay, so a non-finite value that depends on the mask may
not show again: the origin then says so (``reproduced`` false).

Divergence: ``NonfiniteWatch`` stops a run whose loss stays non-finite, without a sync per step.
A step counts as non-finite when its loss is inf/NaN or the scaler skipped it for inf/NaN
gradients. A dynamic GradScaler that is still lowering its scale is doing its job (an fp16
overflow is expected to clear after a few back-offs), so its skipped steps count only once the
scale has fallen below ``precision.scaler.min_scale``.

Cost: ``observe`` only keeps references to the step's loss (and, with a dynamic scaler, its
skip flag and a copy of the scale): no kernel on the CPU path, nothing read back. ``check``
settles the window in one pass at log steps, right after the ``.item()`` that reads the loss,
when the device queue is already drained, so it adds no stall of its own. The price is that a
run stops up to ``log_every - 1`` steps after it crossed the limit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import torch

from ampsweep.measure.hooks import HookError
from ampsweep.measure.replay import FORMAT_OF, Origin, absmax, replay, sound
from ampsweep.precision.policy import PrecisionPolicy, StaticGradScaler

# GradScaler's own inf check (private: checked on torch 2.14.1;
# tests/unit/measure/test_numerics.py fails if it moves), read here at a scale of 1.
_check_and_unscale = torch._amp_foreach_non_finite_check_and_unscale_

GROWTH = 1e3  # weights or loss this many times their earlier size: the values diverged
HISTORY = 32  # the steps' losses kept (references, nothing read) to tell growth afterwards
SKIP_WINDOW = 16  # more than half of these last steps skipped by the scaler: not training


class NonfiniteLocator:
    """The training loop's callback that locates the run's first non-finite step (see the
    module docstring). ``origin`` is None until one is found; ``nonfinite_steps`` counts them."""

    def __init__(self, policy: PrecisionPolicy, objective, loss_weight: float):
        self.policy, self.objective, self.loss_weight = policy, objective, loss_weight
        self.origin: Origin | None = None
        self.nonfinite_steps = 0
        self._params: list[torch.Tensor] | None = None  # the model's, listed once
        self._check = GradientCheck()
        self._start: tuple[int, torch.Tensor] | None = None  # (step, weight norm), once a run
        self._losses: deque = deque(maxlen=HISTORY)  # (step, detached loss): references only

    def before_update(self, view) -> None:
        """After ``unscale_``, before clipping and the update (the loop's step view)."""
        if self._params is None:
            self._params = list(view.module.parameters())
            self._start = (view.step, _weight_norm(self._params))  # launched, not read
        self._losses.append((view.step, view.losses[-1]))
        if not _nonfinite(view, self._params, self._check):  # read once a step
            return
        self.nonfinite_steps += 1
        if self.origin is not None:
            self.origin.nonfinite_steps = self.nonfinite_steps
            return
        scaler = view.scaler
        scale = float(scaler.get_scale()) if scaler.is_enabled() else None
        origin = self._locate(view.module, view.micro_batches, scale)
        origin = origin or from_gradients(view.module, view.losses) or Origin(0, "not_reproduced")
        origin.step, origin.loss_scale, origin.mode = view.step, scale, self.policy.mode.name
        origin.nonfinite_steps = self.nonfinite_steps
        origin.growth = self._growth(view.step)
        origin.keepable = self.policy.mode.autocast and not _kept(self.policy, origin.module)
        self.origin = origin

    def _locate(self, module, micro_batches, scale: float | None) -> Origin | None:
        """Replay the step's micro-batches up to the first that is non-finite; then the same
        micro-batch unscaled (is it the scale's doing?) and in fp32 (is it the format's?)."""
        weight = self.loss_weight
        try:
            for i, (x, y) in enumerate(micro_batches):
                origin = replay(module, x, y, self.policy, self.objective, weight * (scale or 1))
                if origin is None:
                    continue
                origin.micro_batch = i
                if scale and scale > 1 and origin.kind.endswith("_grad"):
                    unscaled = replay(module, x, y, self.policy, self.objective, weight)
                    origin.unscaled_too = unscaled is not None
                in_fp32 = self.policy.mode.autocast or self.policy.mode.pure
                origin.fp32_too = (
                    replay(module, x, y, self.policy, self.objective, weight, fp32=True) is not None
                    if in_fp32
                    else True  # the run is in fp32 already
                )
                return origin
        except HookError as err:  # the run goes on; its record says why it was not located
            return Origin(step=0, kind="not_hookable", reason=str(err))
        return None

    def _growth(self, step: int) -> str:
        """How the weights or the loss grew before ``step`` ('' if they did not: not a
        divergence). Read only here, after the first non-finite step."""
        words = []
        if self._start is not None and self._params:
            first_step, first = self._start
            now = float(_weight_norm(self._params))
            if not math.isfinite(now) or now > GROWTH * max(float(first), 1e-12):
                words.append(
                    f"the weights grew from {float(first):.1g} to {now:.1g} over "
                    f"{step - first_step} step(s)"
                )
        finite = [(s, v) for s, loss in self._losses if math.isfinite(v := float(loss.sum()))]
        if len(finite) >= 2:
            (s0, v0), (s1, _) = finite[0], finite[-1]
            top = max(abs(v) for _, v in finite)
            if top > GROWTH * max(abs(v0), 1e-12):
                words.append(f"the loss grew from {v0:.2g} to {top:.2g} over {s1 - s0} step(s)")
        return " and ".join(words)

    def after_step(self, state) -> None: ...

    def advice(self) -> str:
        """For the divergence message: where it began and the fix, or ''."""
        if self.origin is None or self.origin.kind == "not_reproduced":
            return ""
        fix = self.origin.fix()
        return self.origin.sentence() + (f"; fix: {fix}" if fix else "")

    def tags(self) -> dict[str, str]:
        return self.origin.tags() if self.origin else {}


class NoLocator:
    """``diagnostics.locate_nonfinite=false``: nothing is read or replayed."""

    origin = None
    nonfinite_steps = 0

    def before_update(self, view) -> None: ...
    def after_step(self, state) -> None: ...
    def advice(self) -> str:
        return ""

    def tags(self) -> dict[str, str]:
        return {}


def from_gradients(module: torch.nn.Module, losses: list[torch.Tensor]) -> Origin | None:
    """The step's own gradients, where a replay stayed finite: the parameters whose gradient
    is not sound, the one nearest the output named (the last in the model's order, which is
    about the first the backward pass computes). None if the loss was not finite or no
    gradient is bad (nothing to tell)."""
    if not all(bool(torch.isfinite(loss.detach()).all()) for loss in losses):
        return None
    bad = [
        (n, p.grad)
        for n, p in module.named_parameters()
        if p.grad is not None and not sound(p.grad)
    ]
    if not bad:
        return None
    name, grad = bad[-1]
    owner = name.rpartition(".")[0]
    kind = type(module.get_submodule(owner)).__name__ if owner else type(module).__name__
    return Origin(
        0,
        "weight_grad",
        owner,
        kind,
        param=name,
        value=absmax(grad),
        dtype=FORMAT_OF.get(grad.dtype, ""),
        reproduced=False,
        bad_params=[n for n, _ in bad],
    )


def _weight_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The norm of all the weights together (a tensor: nothing read back)."""
    with torch.no_grad():  # FSDP's sharded weights: this rank's shard (growth is a ratio)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.detach().float()) for p in local])
        )


def _kept(policy: PrecisionPolicy, name: str) -> bool:
    """Whether the module called ``name`` already runs in fp32 (``precision.keep_fp32`` names
    it or a module that holds it)."""
    parts = name.split(".")
    return any(policy.kept(".".join(parts[:i])) for i in range(1, len(parts) + 1))


def _nonfinite(view, params: list[torch.Tensor], check: GradientCheck) -> bool:
    """Whether this step's loss or gradients held inf/NaN. Each finite step pays this, so it is
    a handful of operations: with a scaler, its own inf check, then the loss (summed over the
    micro-batches), read; without, one ``check`` of the gradients and the losses together. The
    gradients are checked first and always: every rank takes part in FSDP's reduction of the
    flag, whatever its own loss was. Every Python operation counts here: right after the
    step's kernels each costs several times what it does in a tight loop (docs/benchmarks.md),
    so the tensors are listed in one pass, and only without a
    scaler, which is the only case that reads the gradients."""
    losses = view.losses
    if not view.scaler.is_enabled():  # the gradients and the losses in one check, one read
        tensors = [g for p in params if (g := p.grad) is not None]  # each .grad read once
        tensors += losses  # the view's losses are detached
        return check.nonfinite(tensors)
    bad = view.skipped.item() > 0  # the scaler's own check, already made
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
    return bad or not math.isfinite(loss.item())  # the step's sync point (none on the CPU)


class GradientCheck:
    """Whether any of a step's tensors (its gradients, its losses) holds inf/NaN, in one pass:
    GradScaler's own check (``_check_and_unscale``) at a scale of 1, so the tensors are left
    as they were (x * 1 is x). A norm per gradient and their sum cost several times as much
    on the CPU (docs/benchmarks.md); under FSDP, DTensor reduces the flag over the ranks, as
    it does for GradScaler.

    Every step pays this, so the usual case is one call with no Python per tensor: plain
    strided tensors on one device (on the CPU of any dtypes, on CUDA of one). Otherwise (sparse
    gradients, FSDP's DTensors beside plain losses, several devices, a pure-half run's
    gradients beside its fp32 loss on CUDA) one call per device, dtype and tensor type. The
    first call decides, and a later step whose tensors break the single call (the kernel
    refuses them) falls back to the groups for good."""

    def __init__(self):
        self._flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._single: tuple[torch.Tensor, torch.Tensor] | None = None  # (flag, one)
        self._grouped = False  # once grouped, always grouped

    def nonfinite(self, tensors: list[torch.Tensor]) -> bool:
        if self._single is not None:
            flag, one = self._single
            try:
                _check_and_unscale(tensors, flag, one)
            except RuntimeError:  # e.g. a sparse gradient: not seen on the first step
                self._single, self._grouped = None, True
                flag.zero_()  # the call may have stopped part-way
            else:
                return _read(flag)
        groups: dict[tuple[torch.device, torch.dtype, type, bool], list[torch.Tensor]] = {}
        for t in tensors:
            values = t._values() if t.is_sparse else t  # a sparse gradient: its stored values
            # by type too: FSDP's gradients (DTensors) cannot share a call with plain tensors
            groups.setdefault((t.device, t.dtype, type(values), t.is_sparse), []).append(values)
        flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for (device, _, _, _), group in groups.items():
            if device not in flags:  # one flag per device, set by any of its groups
                flags[device] = self._flag(device)
            flag, one = flags[device]
            _check_and_unscale(group, flag, one)
        plain = all(kind is torch.Tensor and not sparse for _, _, kind, sparse in groups)
        # On CUDA one fused launch takes one dtype (the others would go one kernel a tensor):
        # a single call there only where every tensor shares it.
        (device, *_), *rest = groups
        if len(flags) == 1 and plain and not self._grouped and (device.type == "cpu" or not rest):
            self._single = flags[device]
        return any([_read(flag) for flag, _ in flags.values()])  # a list: every flag is reset

    def _flag(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The device's flag (zero) and the scale of 1, made once per device."""
        if device not in self._flags:
            self._flags[device] = torch.zeros(1, device=device), torch.ones(1, device=device)
        return self._flags[device]


def _read(flag: torch.Tensor) -> bool:
    """Whether the check set ``flag``; it is zeroed again only then, so a finite step pays no
    zeroing op."""
    if not bool(flag):
        return False
    flag.zero_()
    return True


# ---------------------------------------------------------------- divergence


class Diverged(RuntimeError):
    """The loss stayed non-finite for ``trainer.max_nonfinite_steps`` consecutive steps."""

    tags = {"diverged": "true"}  # recorded on the run besides the `error` reason


class NonfiniteWatch:
    def __init__(
        self,
        limit: int,
        min_scale: float,
        scaler: torch.amp.GradScaler,
        start: int = 0,
        explain: Callable[[], str] = lambda: "",
    ):
        """``explain``: where the run's first non-finite value began and its fix ('' when
        unknown), said instead of the generic advice (``NonfiniteLocator.advice``)."""
        self.limit, self.min_scale, self.explain = limit, min_scale, explain
        # Only a dynamic scaler lowers its scale; a static one skips without ever recovering.
        self.lowering = scaler.is_enabled() and not isinstance(scaler, StaticGradScaler)
        self.scaled = scaler.is_enabled()
        self.run = self.longest = start  # consecutive non-finite steps, and the most seen
        self._window: list[tuple] = []  # the steps not yet settled (since the last check)
        # the last steps: whether each was lost (a non-finite loss, or skipped by the scaler)
        self.recent: deque[bool] = deque(maxlen=SKIP_WINDOW)
        self.scale: float | None = None  # the dynamic scale at the last settled step

    def observe(self, loss: torch.Tensor, skipped: torch.Tensor, scaler) -> None:
        """After ``scaler.update()``: remember this step (no device work, no sync). ``loss``:
        detached (kept until the next check; the loop's running totals detach it once)."""
        if not self.limit:
            return
        # Private: the public get_scale() is a float, read with a sync each step; the scale
        # stays on the device here (checked on torch 2.14.1; tests/unit/measure/
        # test_numerics.py fails if it moves).
        scale = scaler._scale.clone() if self.lowering else None  # noqa: SLF001
        self._window.append((loss, skipped if self.scaled else None, scale))

    def _settle(self) -> None:
        if not self._window:
            return
        losses, skips, scales = zip(*self._window, strict=True)
        self._window.clear()
        finite = torch.isfinite(torch.stack(losses))
        if not self.scaled and bool(finite.all()):  # the usual window: one read, no list
            self.run = 0
            self.recent.extend([False] * len(losses))
            return
        bad = (~finite).tolist()
        if self.scaled:
            skipped = torch.stack([x.float() for x in skips]).cpu().gt(0).tolist()
            bad = [b or s for b, s in zip(bad, skipped, strict=True)]
        self.recent.extend(bad)
        if self.lowering:
            values = torch.stack(list(scales)).float().cpu()
            self.scale = float(values[-1])
            low = values.lt(self.min_scale).tolist()
            bad = [b and below for b, below in zip(bad, low, strict=True)]
        for b in bad:
            self.run = self.run + 1 if b else 0
            self.longest = max(self.longest, self.run)

    def count(self) -> int:
        """Consecutive non-finite steps up to now (for checkpoints)."""
        self._settle()
        return self.run

    def check(self, step: int) -> None:
        """Raise Diverged once the limit was reached, or once most of the last
        ``SKIP_WINDOW`` steps were lost (skipped by the scaler, or a non-finite loss): a run
        that does not train, whatever its loss did in between (call at log steps)."""
        self._settle()
        if not self.limit:
            return
        if self.longest >= self.limit:
            below = f" with the loss scale below {self.min_scale:g}" if self.lowering else ""
            why = f"loss non-finite for {self.limit} consecutive steps{below}"
        elif len(self.recent) == SKIP_WINDOW and sum(self.recent) > SKIP_WINDOW / 2:
            scale = f", the loss scale down to {self.scale:.2g}" if self.scale is not None else ""
            lost = "were skipped by the scaler" if self.scaled else "had a non-finite loss"
            why = (
                f"{sum(self.recent)} of the last {SKIP_WINDOW} steps {lost}{scale}: the model "
                "is not training"
            )
        else:
            return
        advice = self.explain() or (
            "lower optimizer.lr, clip gradients (trainer.grad_clip), or raise "
            "trainer.max_nonfinite_steps"
        )
        raise Diverged(f"{why} (stopped at step {step}): {advice}")
