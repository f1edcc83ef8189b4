"""Where a run's first non-finite value began (``Origin``), as the replay of that step found it
(``measure.replay``), said in words: the sentence and the fix that the divergence message, the
run's tags, ``numerics/first_nonfinite.json``, the report and ``ampsweep doctor`` carry.

A regression's head is named as such: its output and the gradient the loss passes back to it
grow with the targets, so where the targets are far from standardised (``LARGE_TARGETS``) the
fix is in the data, not in a precision setting.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ampsweep.measure import names

ARTIFACT = names.FIRST_NONFINITE_ARTIFACT
# Standardised targets ((y - mean) / std) are a few units; beyond this they were not, and a
# regression head's output and the loss's gradient grow with them
LARGE_TARGETS = 100.0
STANDARDISE = (
    "standardise the targets, (y - mean) / std of the training split "
    "(dataset.standardize_targets=true where the data set has that option)"
)


@dataclass
class Origin:
    """Where the first non-finite value of a run began (the kinds: ``measure.numerics``)."""

    step: int  # the optimizer step (1-based)
    kind: str  # forward | loss | output_grad | weight_grad | input_grad | not_reproduced
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
    op: str = ""  # the op that made it, where known (``matmul`` inside ``attn.forward``)
    # Precision or not: whether the same step replayed in fp32 at the same weights failed too
    # (None: not replayed), and the growth before it ("the weights grew from 1e2 to 1e17 over
    # 10 steps"): a divergence, which no precision setting fixes
    fp32_too: bool | None = None
    growth: str = ""
    # Whether ``precision.keep_fp32=[module]`` could change anything: the mode has autocast to
    # leave and the module does not already run in fp32
    keepable: bool = True
    # The model's head (the innermost module whose output is the model's output), named where
    # the value began at it: its output, its weights' gradient, or the gradient the loss passed
    # back to its output (``output_grad``)
    head: str = ""
    targets: float | None = None  # the largest magnitude of the step's float targets

    @property
    def cause(self) -> str:
        """``divergence`` (the values grew), ``computation`` (fails in fp32 too) or
        ``precision`` (the format: fp32 at the same weights stays finite); '' if unknown."""
        if self.growth:
            return "divergence"
        if self.fp32_too:
            return "computation"
        return "precision" if self.fp32_too is False else ""

    @property
    def scaled_overflow(self) -> bool:
        """Non-finite only because of the loss scale: unscaled, the step was finite."""
        return bool(self.loss_scale and self.loss_scale > 1 and self.unscaled_too is False)

    @property
    def large_targets(self) -> bool:
        """A regression whose head overflowed the format with targets far from standardised:
        the targets' scale is the cause (the format's doing, not a divergence's)."""
        return bool(
            self.head
            and self.module == self.head
            and self.targets is not None
            and self.targets > LARGE_TARGETS
            and not self.growth
            and not self.fp32_too
        )

    @property
    def label(self) -> str:
        """``layer4.0.conv1 (Conv2d)``; ``7 (Linear, the model's head)``."""
        name = self.module or "(the model)"
        what = [self.module_type] if self.module_type else []
        if self.head and self.module == self.head:
            what.append("the model's head")
        return f"{name} ({', '.join(what)})" if what else name

    def sentence(self) -> str:
        """The origin in one sentence, with what most likely caused it, and whether it is the
        format's doing."""
        said = self._where()
        if self.growth:
            return f"{said}; {self.growth}: a divergence, not the format"
        if self.fp32_too:
            return f"{said}; it fails in fp32 too, at the same weights: not the format"
        if self.large_targets:
            assert self.targets is not None  # large_targets
            said += (
                f"; the targets reach {self.targets:.4g}: the head's output and the gradient "
                "the loss passes back to it grow with them"
            )
        if self.fp32_too is False and self.kind != "loss":
            return f"{said}; in fp32 at the same weights the step is finite: the format"
        return said

    @property
    def _in(self) -> str:
        """`` (its matmul)``: the op inside the module, where known and not the module's own
        (a Linear's ``linear``)."""
        plain = self.op.replace("_", "") == self.module_type.lower()
        return f" (its {self.op})" if self.op and not plain else ""

    def _scaled(self, overflowed: str) -> str:
        """Why a gradient went non-finite: the loss scale's doing, or ``overflowed``."""
        if self.scaled_overflow:
            return "the scaled gradient overflowed (the scaler backs off and skips the step)"
        return overflowed

    def _where(self) -> str:
        at = f"step {self.step}"
        scale = f" at loss scale {self.loss_scale:g}" if self.loss_scale else ""
        if self.kind == "forward":
            held = ""
            if self.value is not None and self.limit is not None and self.value > self.limit:
                held = (
                    f": it reaches {self.value:.4g} in fp32, beyond {self.dtype}'s "
                    f"largest value {self.limit:g} (a forward overflow)"
                )
            elif self.value is not None and math.isfinite(self.value):
                held = f" (in fp32 its output's largest magnitude is {self.value:.4g})"
            return (
                f"{at}: the first non-finite value was the {self.dtype} output of {self.label}"
                f"{self._in}, with finite inputs{held}"
            )
        if self.kind == "loss":
            return (
                f"{at}: every module's output was finite but the loss was not: the loss "
                "function itself overflowed or took a log of zero"
            )
        if self.kind == "output_grad":
            return (
                f"{at}: the first non-finite value was the gradient the loss passed back to "
                f"the {self.dtype} output of {self.label}{scale}, from the loss's finite "
                f"gradient: {self._scaled(f'it overflowed {self.dtype}')}"
            )
        if self.kind == "weight_grad":
            return self._weight_grad(at, scale)
        if self.kind == "input_grad":
            cause = self._scaled(f"its backward overflowed {self.dtype} or failed")
            return (
                f"{at}: the first non-finite value was the gradient {self.label}{self._in} "
                f"passed back to its input{scale}, from a finite output gradient: {cause}"
            )
        if self.kind == "not_hookable":
            return f"{at}: the loss or a gradient was non-finite; not located: {self.reason}"
        return (
            f"{at}: the loss or a gradient was non-finite, but a replay of the step with the "
            "same weights and inputs stayed finite (random layers such as dropout draw anew): "
            "rerun with trainer.deterministic=true, or with model dropout off, to locate it"
        )

    def _weight_grad(self, at: str, scale: str) -> str:
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
        cause = self._scaled("a backward kernel of this device produced it")
        return (
            f"{at}: the first non-finite value was the weight gradient of {self.label} "
            f"({self.param}){size}{scale}, with finite input and output gradient: {cause}"
        )

    def keep(self) -> str:
        """The module ``precision.keep_fp32`` would keep in fp32 to fix it ('' where that
        changes nothing: a divergence, a computation that fails in fp32 too, the loss, a
        module already kept, a run without autocast)."""
        if self.growth or self.fp32_too or not self.keepable:
            return ""
        if self.kind not in ("forward", "output_grad", "weight_grad", "input_grad"):
            return ""
        return self.consumers[0] if self.kind == "input_grad" and self.consumers else self.module

    def fix(self) -> str:
        """The config change that most likely fixes it ('' when none can be named): never a
        ``precision.keep_fp32`` that changes nothing."""
        if self.growth:
            return (
                "lower optimizer.lr, warm it up (optimizer.warmup_steps), or clip the "
                "gradients (trainer.grad_clip=1.0)"
            )
        if self.fp32_too and self.module and self.kind != "loss":
            part = "backward" if self.kind in ("weight_grad", "input_grad") else "forward"
            return f"fix the {part} of {self.module}{self._in} (no precision setting changes it)"
        if self.kind == "loss":
            return "check the loss for log(0) or division by zero on these targets"
        occasional = " if it keeps happening (the scaler backs off from occasional ones)"
        if self.large_targets:  # the data's fix; bf16 has the range for them too
            wider = ", or precision=bf16 (fp32's range)" if self.dtype == "fp16" else ""
            return STANDARDISE + wider + (occasional if self.scaled_overflow else "")
        target = self.keep()
        if not target:
            return ""
        keep = f"precision.keep_fp32=[{target}]"
        if self.kind == "forward" and self.dtype == "fp16":
            return f"{keep}, or precision=bf16 (fp32's range)"
        if self.kind != "forward" and self.scaled_overflow:
            return keep + occasional
        return keep

    def tags(self) -> dict[str, str]:
        """What the run records of it (MLflow tags)."""
        return {
            names.NONFINITE_STEP: str(self.step),
            names.NONFINITE_KIND: self.kind,
            names.NONFINITE_MODULE: self.module,
            names.NONFINITE_WHERE: self.sentence()[:4000],
            names.NONFINITE_FIX: self.fix(),
            names.NONFINITE_CAUSE: self.cause,
        }

    def write(self, folder: Path) -> Path:
        path = folder / Path(ARTIFACT).name
        path.write_text(
            json.dumps(
                {**asdict(self), "sentence": self.sentence(), "fix": self.fix()}
                | {"cause": self.cause},
                indent=2,
            )
        )
        return path
