"""fp8 training through torchao: which ``nn.Linear`` layers are converted, and converting them.

An fp8 mode (a row of the mode table with ``fp8``) hands the eligible ``nn.Linear`` layers to
torchao's ``convert_to_float8_training``, which swaps each for a ``Float8Linear`` whose matmuls
run in fp8 with the mode's scaling recipe; everything else runs under bf16 autocast. A layer is
eligible when

* it is a plain ``nn.Linear`` that the model calls through its ``forward`` (the output
  projection inside ``nn.MultiheadAttention`` is a Linear whose weight the attention function
  reads directly: swapping it would convert nothing),
* both its dimensions are divisible by 16 (what fp8 tensor-core matmuls need), and
* it is not the model's first or last layer while ``precision.fp8.keep_first_last`` holds,
  nor named by ``precision.fp8.keep_bf16`` (the filter written as config).

Which layers are first and last, which are called, and the FLOPs each carries come from one
forward pass of two samples traced on the meta device, or on the CPU where the model cannot run
on meta (``plan``). The run records every Linear
layer with its verdict and the share of the FLOPs the converted ones carry: fp8 can only speed
up that share.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ampsweep.config.schema import Config, ConfigError
from ampsweep.precision.modes import Fp8Config, PrecisionMode

MULTIPLE = 16  # fp8 tensor-core matmuls need both dimensions divisible by 16


@dataclass(frozen=True)
class Layer:
    """One ``nn.Linear`` of the model and what fp8 does with it."""

    name: str
    in_features: int
    out_features: int
    flops: float  # forward FLOPs of the traced batch (0: never called through forward)
    converted: bool
    reason: str = ""  # why it is kept out of fp8
    rows: float = 0.0  # rows it multiplies per sample (tokens of a sequence; 1 for a vector)


@dataclass
class Conversion:
    """What an fp8 mode converted (nothing for every other mode)."""

    recipe: str = ""  # torchao's recipe name; "": no conversion
    emulated: bool = False
    layers: list[Layer] = field(default_factory=list)
    total_flops: float = 0.0  # forward FLOPs of the whole model on the traced batch

    @property
    def converted(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.converted]

    @property
    def kept(self) -> list[str]:
        return [layer.name for layer in self.layers if not layer.converted]

    @property
    def flop_share(self) -> float:
        """The share of the step's FLOPs in converted layers (counted on the forward pass: a
        matmul's backward costs twice its forward, as a convolution's or attention's does)."""
        done = sum(layer.flops for layer in self.layers if layer.converted)
        return done / self.total_flops if self.total_flops else 0.0

    def metrics(self) -> dict[str, float]:
        if not self.recipe:
            return {}
        return {
            "fp8/converted_layers": float(len(self.converted)),
            "fp8/kept_layers": float(len(self.kept)),
            "fp8/flop_share": self.flop_share,
        }

    def table(self) -> dict:
        """Every Linear layer with its verdict, for the run's ``fp8_layers.json``."""
        return {
            "recipe": self.recipe,
            "emulated": self.emulated,
            "flop_share": self.flop_share,
            "layers": [dataclasses.asdict(layer) for layer in self.layers],
        }


# ---------------------------------------------------------------- planning


def plan(
    model: nn.Module,
    x: torch.Tensor,
    cfg: Fp8Config,
    recipe: str = "",
    kept: Callable[[str], bool] = lambda name: False,
) -> Conversion:
    """Which Linear layers of ``model`` fp8 would convert, from one forward pass of two
    samples of ``x``, traced on the meta device, else on the CPU (the model and ``x`` may be
    anywhere; ``_traced_flops``).
    ``kept``: whether a module stays in fp32 (precision.keep_fp32; its layers too)."""
    order: list[str] = []  # leaf layers with parameters, in the order they run
    tokens: dict[str, float] = {}  # rows each Linear multiplied, for its FLOPs
    handles = []
    for name, module in model.named_modules():
        leaf = next(module.children(), None) is None
        if not leaf or next(module.parameters(recurse=False), None) is None:
            continue  # containers (a ViT's encoder holds a parameter too) are not layers

        def hook(mod, args, out, name=name):
            if name not in order:
                order.append(name)
            if isinstance(mod, nn.Linear) and args:
                tokens[name] = tokens.get(name, 0) + args[0].numel() / mod.in_features

        handles.append(module.register_forward_hook(hook))
    was_training = model.training
    model.eval()  # no BatchNorm statistics touched, no dropout drawn
    try:
        try:
            total_flops = _traced_flops(model, x, torch.device("meta"))
        except (NotImplementedError, RuntimeError):  # e.g. a model that calls .item()
            order.clear()
            tokens.clear()
            total_flops = _traced_flops(model, x, torch.device("cpu"))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    ends = {order[0], order[-1]} if order and cfg.keep_first_last else set()
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        i, o = module.in_features, module.out_features
        called = name in tokens
        reason = ""
        if type(module) is not nn.Linear:
            reason = f"a {type(module).__name__}, not a plain nn.Linear"
        elif not called:
            reason = "not called through its forward (e.g. inside nn.MultiheadAttention)"
        elif i % MULTIPLE or o % MULTIPLE:
            reason = f"{i}x{o}: both dimensions must be divisible by {MULTIPLE}"
        elif any(kept(n) for n in _prefixes(name)):
            reason = "kept in fp32 (precision.keep_fp32)"
        elif _named(name, cfg.keep_bf16):
            reason = "kept in bf16 by precision.fp8.keep_bf16"
        elif name in ends:
            which = "first" if name == order[0] else "last"
            reason = f"the model's {which} layer (precision.fp8.keep_first_last=true)"
        flops = 2.0 * tokens.get(name, 0) * i * o
        rows = tokens.get(name, 0) / len(x[:2])
        layers.append(Layer(name, i, o, flops, not reason, reason, rows))
    _check_keep_bf16(cfg.keep_bf16, [la.name for la in layers])
    return Conversion(recipe, cfg.emulate, layers, total_flops)


def _traced_flops(model: nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """The forward FLOPs of two samples of ``x`` through ``model`` on ``device``, its hooks
    firing. On the meta device: shapes only, no compute, no memory, and attention's FLOPs
    counted (the CPU's fused attention kernel is invisible to the counter). A model that reads
    a value of a tensor (Hugging Face's packed-sequence check calls ``.item()``) cannot run
    there: it runs on the CPU, on its own tensors or zeros where it lives on meta. With
    gradients on, as in training: without them nn.MultiheadAttention takes a fused inference
    path, uncounted too."""

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        if device.type == "meta":
            copy = torch.empty_like(t, device="meta")
        else:
            copy = torch.zeros_like(t, device=device) if t.is_meta else t.detach().to(device)
        return copy.requires_grad_(t.requires_grad)

    state = {n: stand_in(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    with torch.enable_grad(), FlopCounterMode(display=False) as counter:
        torch.func.functional_call(model, state, (x[:2].to(device),))
    return float(counter.get_total_flops())


def _named(name: str, patterns: list[str]) -> bool:
    """Whether a pattern names the layer or a module that holds it."""
    return any(fnmatch.fnmatchcase(n, p) for n in _prefixes(name) for p in patterns)


def _check_keep_bf16(patterns: list[str], linear: list[str]) -> None:
    """Refuse the precision.fp8.keep_bf16 patterns that name no Linear layer, in one line
    with the closest names."""
    unmatched = [p for p in patterns if not any(_named(n, [p]) for n in linear)]
    if not unmatched:
        return
    parts = []
    for pattern in unmatched:
        close = difflib.get_close_matches(pattern, linear, n=3, cutoff=0.3)
        parts.append(pattern + (f" (closest: {', '.join(close)})" if close else ""))
    shown = ", ".join(linear[:8]) + (", ..." if len(linear) > 8 else "")
    raise ConfigError(
        f"precision.fp8.keep_bf16: no nn.Linear layer of the model is called "
        f"{'; '.join(parts)}: use names of its Linear layers ({shown or 'it has none'}), or "
        "glob patterns such as 'blocks.*.mlp'"
    )


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` and the modules that hold it: ``a.b``, ``a``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def refusal(mode: PrecisionMode, model_name: str, planned: Conversion, cfg: Fp8Config) -> str:
    """Why an fp8 mode would change nothing on this model (no layer to convert)."""
    linear = planned.layers
    if not linear:
        what = "has no nn.Linear layer"
    else:
        shown = "; ".join(f"layer {la.name or '(the model)'}, {la.reason}" for la in linear[:3])
        more = f"; and {len(linear) - 3} more" if len(linear) > 3 else ""
        what = f"has no nn.Linear layer fp8 can take ({shown}{more})"
    hint = ""
    if cfg.keep_first_last and any(la.reason.startswith("the model's") for la in linear):
        hint = ", or precision.fp8.keep_first_last=false to convert its first and last layers"
    return (
        f"precision={mode.name}: model={model_name} {what}: fp8 would change nothing: use "
        f"precision={mode.fallback}{hint}"
    )


# ---------------------------------------------------------------- converting


def convert_fp8(
    model: nn.Module,
    mode: PrecisionMode,
    cfg: Fp8Config,
    x: torch.Tensor,
    name: str,
    kept: Callable[[str], bool] = lambda name: False,
    fsdp: bool = False,
):
    """Convert ``model``'s eligible Linear layers in place for ``mode``; the record of it.
    ``x``: a batch of real inputs on the model's device (two samples are traced). ``kept``:
    whether a layer stays in fp32 (``precision.keep_fp32``), out of fp8 too. ``fsdp``: the
    model is about to be sharded, so its weights are all-gathered in fp8 (half the bytes of
    bf16; torchao's tensorwise recipe only, which engine.sharded.check enforces)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    planned = plan(model, x, cfg, mode.fp8, kept)
    if not planned.converted:
        raise ConfigError(refusal(mode, name, planned, cfg))
    config = Float8LinearConfig.from_recipe_name(mode.fp8)
    if cfg.emulate:
        config = dataclasses.replace(config, emulate=True)
    if fsdp:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    chosen = set(planned.converted)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen
    )
    return planned


def check_fp8(
    model: nn.Module,
    samples: torch.Tensor,
    mode: PrecisionMode,
    cfg: Config,
    kept: Callable[[str], bool] = lambda name: False,
) -> None:
    """Refuse an fp8 config on a model where fp8 would convert nothing, without converting:
    ``model`` may live on the meta device (no memory, no compute); ``samples`` are moved there."""
    planned = plan(model, samples, cfg.precision.fp8, mode.fp8, kept)
    if not planned.converted:
        raise ConfigError(refusal(mode, cfg.model.name, planned, cfg.precision.fp8))


# ---------------------------------------------------------------- which layers gain


@dataclass(frozen=True)
class LayerAdvice:
    """One Linear layer: fp8's predicted gain against bf16 on a GPU, and the choices made."""

    name: str
    m: int  # rows of the batch (samples times tokens), the matmul's M
    k: int  # in_features
    n: int  # out_features
    bf16_s: float | None  # predicted forward + backward; None: fp8 cannot take the layer
    fp8_s: float | None
    torchao: bool | None  # torchao's own auto-filter converts it (None: not known)
    fp8: bool  # converted under the advice
    why: str  # why the advice keeps it out of fp8 ("" when converted)

    @property
    def speedup(self) -> float | None:
        return self.bf16_s / self.fp8_s if self.bf16_s and self.fp8_s else None


@dataclass
class FilterAdvice:
    """Per Linear layer, whether fp8 is predicted to gain on a GPU, beside torchao's
    auto-filter; ``override()`` is the config that keeps the losers in bf16."""

    gpu: str
    recipe: str
    batch_size: int
    layers: list[LayerAdvice] = field(default_factory=list)
    given: list[str] = field(default_factory=list)  # the config's own keep_bf16 patterns

    def keep_bf16(self) -> list[str]:
        """The config's own patterns, then the layers fp8 would convert but is predicted to
        slow down."""
        losers = [la.name for la in self.layers if la.why.startswith("predicted")]
        return [*self.given, *losers]

    def override(self) -> str:
        return f"precision.fp8.keep_bf16=[{','.join(self.keep_bf16())}]"

    def verdict(self) -> str:
        """In one line: how many layers are predicted to gain, and the config that follows."""
        gaining = [la for la in self.layers if la.fp8]
        judged = [la for la in self.layers if la.speedup is not None]
        where = f"fp8_{self.recipe} on the {self.gpu} at batch {self.batch_size}"
        if not gaining:
            return f"no Linear layer is predicted to gain from {where}: stay with bf16"
        if not self.keep_bf16():
            return f"every Linear layer fp8 takes is predicted to gain from {where}"
        return (
            f"{where}: {len(gaining)} of the {len(judged)} Linear layers fp8 can take predicted "
            f"to gain; the others in bf16: {self.override()}"
        )

    def table(self) -> dict:
        rows = [{**dataclasses.asdict(la), "speedup": la.speedup} for la in self.layers]
        return {"gpu": self.gpu, "recipe": self.recipe, "batch_size": self.batch_size,
                "override": self.override(), "verdict": self.verdict(),
                "layers": rows}  # fmt: skip


def fp8_filter(
    planned: Conversion, gpu, batch_size: int, patterns: Sequence[str] = ()
) -> FilterAdvice:
    """Which of ``planned``'s Linear layers fp8 (its recipe) is predicted to speed up on
    ``gpu`` (a ``measure.roofline.Gpu``) at ``batch_size`` samples, by the roofline of one
    Linear's three matmuls (and fp8's casts) at the layer's M, K, N; beside torchao's
    auto-filter's choice. ``patterns``: precision.fp8.keep_bf16 as configured (its layers are
    judged again; the patterns are kept in the advice's override)."""
    from ampsweep.measure.roofline import linear_times

    recipe = planned.recipe or "tensorwise"
    auto = _torchao_auto_filter(recipe)
    advice = FilterAdvice(gpu.label, recipe, batch_size, given=list(patterns))
    for la in planned.layers:
        m = round(la.rows * batch_size)  # 0: never called through its forward
        bf16 = fp8 = None
        why = la.reason
        if la.converted or la.reason.endswith("precision.fp8.keep_bf16"):
            shape = (max(1, m), la.in_features, la.out_features)
            bf16 = linear_times(gpu, *shape, "bf16").total_s
            fp8 = linear_times(gpu, *shape, f"fp8_{recipe}").total_s
            why = "" if fp8 < bf16 else f"predicted {bf16 / fp8:.2f}x bf16's speed in fp8"
        theirs = None
        if auto is not None:
            theirs = bool(auto(nn.Linear(la.in_features, la.out_features, device="meta"), la.name))
        advice.layers.append(
            LayerAdvice(
                la.name, m, la.in_features, la.out_features, bf16, fp8, theirs, not why, why
            )
        )
    return advice


def _torchao_auto_filter(recipe: str) -> Callable[[nn.Module, str], bool] | None:
    """torchao's auto-filter for a recipe (its thresholds come from H100 measurements), or
    None where torchao or the filter is missing: it is private in torchao 0.18
    (``torchao.float8.float8_linear_utils._auto_filter_for_recipe``) and may move."""
    try:
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        return _auto_filter_for_recipe(recipe, filter_fqns=[])
    except (ImportError, AttributeError, NotImplementedError, ValueError):
        return None
