"""Where a run's first non-finite value began (``Origin``), and how it is said: the sentence
and the fix the divergence message, the run's tags and ``numerics/first_nonfinite.json`` carry.
``measure.numerics`` (the training loop's locator) finds it, ``measure.replay`` reproduces the
step that found it; the kinds are described there."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ampsweep.measure import names

ARTIFACT = names.FIRST_NONFINITE_ARTIFACT
FORMAT_OF = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass
class Origin:
    """Where the first non-finite value of a run began (see the module docstring)."""

    step: int  # the optimizer step (1-based)
    kind: str  # forward | loss | weight_grad | input_grad | not_reproduced
    module: str = ""  # the module's name in model.named_modules() ("" for the model itself)
    module_type: str = ""
    param: str = ""  # weight_grad: the parameter (e.g. layer4.0.conv1.weight)
    dtype: str = ""  # the format the non-finite value was in (fp16, bf16, fp32)
    value: float | None = None  # forward: the output's largest magnitude, recomputed in fp32
    limit: float | None = None  # forward: the format's largest finite value
    loss_scale: float | None = None  # the GradScaler's scale at that step (None: no scaler)
    micro_batch: int = 0  # which micro-batch of the step (grad accumulation)
    mode: str = ""
    nonfinite_steps: int = 0  # non-finite steps seen in the run so far
    consumers: list[str] = field(default_factory=list)  # input_grad: modules that took it
    reason: str = ""  # not_hookable: why the model could not be hooked
    # With a loss scale above 1: whether the same step was non-finite unscaled too (True: not
    # the scale's doing, a kernel or the values themselves; None: not checked)
    unscaled_too: bool | None = None
    # False: a replay of the step stayed finite, so the origin was read off the step's own
    # gradients (a kernel that is not deterministic); the parameters whose gradient was bad:
    reproduced: bool = True
    bad_params: list[str] = field(default_factory=list)

    @property
    def scaled_overflow(self) -> bool:
        """Non-finite only because of the loss scale: unscaled, the step was finite."""
        return bool(self.loss_scale and self.loss_scale > 1 and self.unscaled_too is False)

    @property
    def label(self) -> str:
        """``layer4.0.conv1 (Conv2d)``."""
        name = self.module or "(the model)"
        return f"{name} ({self.module_type})" if self.module_type else name

    def sentence(self) -> str:
        """The origin in one sentence, with what most likely caused it."""
        at = f"step {self.step}"
        scale = f" at loss scale {self.loss_scale:g}" if self.loss_scale else ""
        if self.kind == "forward":
            held = ""
            if self.value is not None and self.limit is not None and self.value > self.limit:
                held = (
                    f": its output reaches {self.value:.4g} in fp32, beyond {self.dtype}'s "
                    f"largest value {self.limit:g} (a forward overflow)"
                )
            elif self.value is not None and math.isfinite(self.value):
                held = f" (in fp32 its output's largest magnitude is {self.value:.4g})"
            return (
                f"{at}: the first non-finite value was the {self.dtype} output of {self.label}, "
                f"with finite inputs{held}"
            )
        if self.kind == "loss":
            return (
                f"{at}: every module's output was finite but the loss was not: the loss "
                "function itself overflowed or took a log of zero"
            )
        if self.kind == "weight_grad":
            cause = (
                "the scaled gradient overflowed (the scaler backs off and skips the step)"
                if self.scaled_overflow
                else "a backward kernel of this device produced it"
            )
            size = ""
            if self.value is not None and math.isfinite(self.value):  # finite, norm overflows
                size = f" (finite values up to {self.value:.3g}, too large for its norm)"
            if not self.reproduced:
                others = len(self.bad_params) - 1
                also = f" ({others} more parameter(s) too)" if others > 0 else ""
                return (
                    f"{at}: the weight gradient of {self.label} ({self.param}){size}{scale} "
                    f"was non-finite{also} while the loss was finite; a replay of the step at "
                    "the same weights stayed finite, so a backward kernel of this device "
                    "produced it, and not every time"
                )
            return (
                f"{at}: the first non-finite value was the weight gradient of {self.label} "
                f"({self.param}){size}{scale}, with finite input and output gradient: {cause}"
            )
        if self.kind == "input_grad":
            cause = (
                "the scaled gradient overflowed (the scaler backs off and skips the step)"
                if self.scaled_overflow
                else f"its backward overflowed {self.dtype} or failed"
            )
            return (
                f"{at}: the first non-finite value was the gradient {self.label} passed back "
                f"to its input{scale}, from a finite output gradient: {cause}"
            )
        if self.kind == "not_hookable":
            return f"{at}: the loss or a gradient was non-finite; not located: {self.reason}"
        return (
            f"{at}: the loss or a gradient was non-finite, but a replay of the step with the "
            "same weights and inputs stayed finite (random layers such as dropout draw anew): "
            "rerun with trainer.deterministic=true, or with model dropout off, to locate it"
        )

    def fix(self) -> str:
        """The config change that most likely fixes it ('' when none can be named)."""
        if self.kind not in ("forward", "weight_grad", "input_grad") or not self.module:
            if self.kind == "loss":
                return "check the loss for log(0) or division by zero on these targets"
            return ""
        target = self.consumers[0] if self.kind == "input_grad" and self.consumers else self.module
        keep = f"precision.keep_fp32=[{target}]"
        if self.kind == "forward" and self.dtype == "fp16":
            return f"{keep}, or precision=bf16 (fp32's range)"
        if self.kind in ("weight_grad", "input_grad") and self.scaled_overflow:
            return f"{keep} if it keeps happening (the scaler backs off from occasional ones)"
        return keep

    def tags(self) -> dict[str, str]:
        """What the run records of it (MLflow tags)."""
        return {
            names.NONFINITE_STEP: str(self.step),
            names.NONFINITE_KIND: self.kind,
            names.NONFINITE_MODULE: self.module,
            names.NONFINITE_WHERE: self.sentence()[:4000],
            names.NONFINITE_FIX: self.fix(),
        }

    def write(self, folder: Path) -> Path:
        path = folder / Path(ARTIFACT).name
        path.write_text(json.dumps({**asdict(self), "sentence": self.sentence(),
                                    "fix": self.fix()}, indent=2))  # fmt: skip
        return path
