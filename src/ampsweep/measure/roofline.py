"""What a GPU can do, and how long a kernel takes on it: the GPU table and the roofline.

The table holds, per GPU model, its dense peak throughput per number format (TFLOPS, no
structured sparsity) and its memory bandwidth, each from the vendor's datasheet (cited beside
each row). ``perf/mfu`` reads its peaks (``measure.cost``); ``ampsweep predict`` reads all of
it.

The roofline: a kernel takes the longer of its compute time (its FLOPs at the format's dense
peak, times the share of the peak large kernels reach) and its memory time (its bytes at the
bandwidth, likewise), and never less than ``LAUNCH_S``. A matmul's compute time counts whole
waves of output tiles over the GPU's multiprocessors: a matmul with fewer tiles than
multiprocessors leaves the rest idle. ``linear_times`` applies it to one ``nn.Linear``'s three
matmuls (output, grad_input, grad_weight), with fp8's amax and cast kernels as torchao's
float8 training runs them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

# The share of the datasheet peak that large kernels reach, measured by torchao on an H100 for
# bf16 matmuls and pointwise kernels (torchao.testing.training.roofline_utils); applied to every
# format and GPU alike.
MATMUL_EFFICIENCY = 0.78
MEMORY_EFFICIENCY = 0.92
# The shortest kernel, launch to end, as timed on an H100 (torchao, likewise). Eager PyTorch can
# take longer than this to issue a kernel from the host, so a step made of many small kernels
# runs at least this long and often longer.
LAUNCH_S = 2e-6
TILE = 128  # a matmul's output tile per multiprocessor (cuBLAS and CUTLASS on Ampere and later)
# A matmul whose reduction is this many times longer than its output's larger side, with fewer
# output tiles than multiprocessors, has its reduction split across the idle ones (split-K,
# as cuBLAS does for a Linear's weight gradient over many rows).
SPLIT_K = 4

FORMATS = ("fp32", "tf32", "fp16", "bf16", "fp8_tensorwise", "fp8_rowwise")
BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class Gpu:
    """One GPU model: dense peak TFLOPS per kind of math, memory bandwidth, multiprocessors."""

    key: str  # what --gpu takes
    label: str
    fp32: float  # plain fp32 (CUDA cores)
    tf32: float | None  # fp32 inputs on tensor cores (None: no TF32, pre-Ampere)
    fp16: float  # fp16 tensor cores, fp32 accumulate
    bf16: float | None  # None: no bf16 tensor cores (pre-Ampere)
    fp8: float | None  # fp8 (E4M3/E5M2) tensor cores; None: none (before Ada and Hopper)
    bandwidth: float  # memory bandwidth, TB/s
    sms: int  # streaming multiprocessors
    pattern: str = field(default="", compare=False)  # matches torch.cuda.get_device_name()

    def peak(self, kind: str) -> float | None:
        """Dense FLOP/s of a kind of math ("fp32", "tf32", "fp16", "bf16", "fp8")."""
        tflops = getattr(self, kind)
        return None if tflops is None else tflops * 1e12


# Vendor datasheets. NVIDIA quotes tensor-core figures "with sparsity" (marked * there); the
# dense figure, which training runs at, is half of it. Matched against CUDA's device name in
# order (first match wins).
# fmt: off
GPUS: list[Gpu] = [
    # NVIDIA B200 (HGX B200 datasheet, per GPU): FP32 75, TF32 2.2 PF*, FP16/BF16 4.5 PF*,
    # FP8 9 PF*; HBM3e 8 TB/s; 148 SMs.
    Gpu("b200", "B200", 75.0, 1100.0, 2250.0, 2250.0, 4500.0, 8.0, 148, r"\bB200\b"),
    # NVIDIA H200 Tensor Core GPU datasheet: H200 SXM FP32 67, TF32 989*, BF16/FP16 1979*,
    # FP8 3958*, 4.8 TB/s; H200 NVL FP32 60, TF32 835*, BF16/FP16 1671*, FP8 3341*, 4.8 TB/s.
    # 132 SMs (Hopper whitepaper, H100 SXM5: the same GH100).
    Gpu("h200-nvl", "H200 NVL", 60.0, 417.5, 835.5, 835.5, 1670.5, 4.8, 132, r"\bH200 NVL\b"),
    Gpu("h200", "H200 SXM", 67.0, 494.5, 989.5, 989.5, 1979.0, 4.8, 132, r"\bH200\b"),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM FP32 67, TF32 989*, BF16/FP16 1979*,
    # FP8 3958*, 3.35 TB/s; PCIe FP32 51, TF32 756*, BF16/FP16 1513*, FP8 3026*, 2 TB/s;
    # NVL FP32 60, TF32 835*, BF16/FP16 1671*, FP8 3341*, 3.9 TB/s. NVIDIA Hopper
    # architecture whitepaper: 132 SMs (SXM5), 114 (PCIe).
    Gpu("h100-nvl", "H100 NVL", 60.0, 417.5, 835.5, 835.5, 1670.5, 3.9, 132, r"\bH100 NVL\b"),
    Gpu("h100-pcie", "H100 PCIe", 51.0, 378.0, 756.5, 756.5, 1513.0, 2.0, 114,
        r"\bH100\b.*\bPCIe\b"),
    Gpu("h100", "H100 SXM", 67.0, 494.5, 989.5, 989.5, 1979.0, 3.35, 132, r"\bH100\b"),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe): FP32 19.5, TF32 156 (312*),
    # BF16 312 (624*), FP16 312 (624*); 80GB SXM 2.039 TB/s, 40GB 1.555 TB/s. NVIDIA A100
    # (Ampere) architecture whitepaper: 108 SMs.
    Gpu("a100-40gb", "A100", 19.5, 156.0, 312.0, 312.0, None, 1.555, 108, r"\bA100\b.*40GB"),
    Gpu("a100", "A100", 19.5, 156.0, 312.0, 312.0, None, 2.039, 108, r"\bA100\b"),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*),
    # FP8 733 (1466*), 864 GB/s; 142 SMs (Ada whitepaper's AD102 with 142 of 144 enabled).
    Gpu("l40s", "L40S", 91.6, 183.0, 362.05, 362.05, 733.0, 0.864, 142, r"\bL40S\b"),
    # NVIDIA A40 datasheet: FP32 37.4, TF32 74.8 (149.6*), BF16/FP16 149.7 (299.4*),
    # 696 GB/s; 84 SMs.
    Gpu("a40", "A40", 37.4, 74.8, 149.7, 149.7, None, 0.696, 84, r"\bA40\b"),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485*, 300 GB/s; 58 SMs.
    Gpu("l4", "L4", 30.3, 60.0, 121.0, 121.0, 242.5, 0.3, 58, r"\bL4\b"),
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5 (125*), BF16/FP16 125 (250*), 600 GB/s;
    # 72 SMs. The AWS A10G is a different part and does not match (\b stops "A10" at "A10G").
    Gpu("a10", "A10", 31.2, 62.5, 125.0, 125.0, None, 0.6, 72, r"\bA10\b"),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: FP32 82.6, TF32 82.6
    # (165.2*), FP16/BF16 tensor with FP32 accumulate 165.2 (330.4*), FP8 tensor with FP32
    # accumulate 330.3 (660.6*) (autocast and torchao accumulate in fp32, so the
    # fp16-accumulate figures do not apply); 1008 GB/s; 128 SMs.
    Gpu("rtx4090", "RTX 4090", 82.6, 82.6, 165.2, 165.2, 330.3, 1.008, 128, r"\bRTX 4090\b"),
    # NVIDIA V100 datasheet: SXM2 FP32 15.7, tensor 125; PCIe 14, 112; V100S PCIe 16.4, 130;
    # 900 GB/s (V100S 1134 GB/s); 80 SMs. Volta has neither TF32 nor bf16.
    Gpu("v100s", "V100S PCIe", 16.4, None, 130.0, None, None, 1.134, 80, r"\bV100S\b"),
    Gpu("v100-pcie", "V100 PCIe", 14.0, None, 112.0, None, None, 0.9, 80, r"\bV100\b.*\bPCIE\b"),
    Gpu("v100", "V100 SXM2", 15.7, None, 125.0, None, None, 0.9, 80, r"\bV100\b"),
    # NVIDIA T4 datasheet: FP32 8.1, mixed precision (FP16/FP32) 65, 320 GB/s; 40 SMs.
    Gpu("t4", "T4", 8.1, None, 65.0, None, None, 0.32, 40, r"\bT4\b"),
]
# fmt: on


def lookup_peak(device_name: str) -> tuple[str, Gpu] | None:
    """The table entry for a GPU name as CUDA reports it, or None for an unknown GPU."""
    for gpu in GPUS:
        if re.search(gpu.pattern, device_name, flags=re.IGNORECASE):
            return gpu.label, gpu
    return None


def gpu_spec(name: str) -> Gpu:
    """The GPU a user names: a key of the table (``h100``), or a name as CUDA reports it
    (``NVIDIA H100 80GB HBM3``). Raises ValueError (one line, the known names) otherwise."""
    wanted = name.strip().lower().replace(" ", "").replace("_", "-")
    for gpu in GPUS:  # keys first: the A100's two rows share a label
        if wanted == gpu.key:
            return gpu
    for gpu in GPUS:
        if wanted == gpu.label.lower().replace(" ", ""):
            return gpu
    found = lookup_peak(name)
    if found is None:
        known = ", ".join(gpu.key for gpu in GPUS)
        raise ValueError(
            f"--gpu {name}: not a GPU ampsweep knows: choose one of {known}, or describe it "
            "in a file for --gpu-spec"
        )
    return found[1]


def load_gpu_spec(path: str) -> Gpu:
    """A GPU described in a JSON or YAML file with the table's fields (peaks in dense TFLOPS,
    bandwidth in TB/s, sms). Raises ValueError (one line) when a field is missing or wrong."""
    import yaml  # JSON is YAML too

    where = f"--gpu-spec {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(
            f"{where}: cannot read it ({type(err).__name__}): give a JSON or YAML file"
        ) from None
    names = [f.name for f in fields(Gpu) if f.name != "pattern"]
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping with the keys {', '.join(names)}")
    data.setdefault("key", Path(path).stem)
    data.setdefault("label", data["key"])
    missing = [n for n in names if n not in data and n not in ("tf32", "bf16", "fp8")]
    unknown = sorted(set(data) - set(names))
    if missing or unknown:
        what = f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(unknown)}"
        raise ValueError(
            f"{where}: {what}: the keys are {', '.join(names)} (example in docs/predict.md)"
        )
    for n in ("fp32", "fp16", "bandwidth", "sms"):
        if not isinstance(data[n], (int, float)) or data[n] <= 0:
            raise ValueError(f"{where}: {n}={data[n]!r}: must be a positive number")
    return Gpu(**{n: data.get(n) for n in names})  # type: ignore[arg-type]


# ---------------------------------------------------------------- the roofline


@dataclass(frozen=True)
class Kernel:
    """One kernel's predicted time and what bounds it."""

    seconds: float
    bound: str  # "compute" | "memory" | "launch"


def kernel(gpu: Gpu, flops: float, nbytes: float, kind: str = "fp32") -> Kernel:
    """A kernel doing ``flops`` of ``kind`` math and moving ``nbytes`` to and from memory."""
    peak = gpu.peak(kind) or gpu.peak("fp32")
    assert peak is not None  # every GPU has an fp32 peak
    compute = flops / (peak * MATMUL_EFFICIENCY)
    memory = nbytes / (gpu.bandwidth * 1e12 * MEMORY_EFFICIENCY)
    seconds = max(compute, memory, LAUNCH_S)
    bound = "launch" if seconds == LAUNCH_S else "compute" if compute >= memory else "memory"
    return Kernel(seconds, bound)


def matmul(gpu: Gpu, m: int, k: int, n: int, kind: str, in_bytes: float, out_bytes: float):
    """An (m x k) @ (k x n) matmul: its FLOPs are counted over whole waves of output tiles
    (each tile's share of the reduction, where a long one is split: ``SPLIT_K``). A side
    shorter than a tile gets a tile that fits it (a power of two, 16 at least), as the
    libraries choose smaller tiles for small matrices."""
    tile_m, tile_n = _tile(m), _tile(n)
    tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
    split = 1
    if tiles < gpu.sms and k >= SPLIT_K * max(m, n):
        split = max(1, min(gpu.sms // tiles, k // max(m, n, TILE)))
    waves = math.ceil(tiles * split / gpu.sms)
    flops = waves * gpu.sms * 2.0 * tile_m * tile_n * math.ceil(k / split)
    return kernel(gpu, flops, (m * k + k * n) * in_bytes + m * n * out_bytes, kind)


def _tile(side: int) -> int:
    return min(TILE, max(16, 1 << (side - 1).bit_length()))


@dataclass(frozen=True)
class LinearTime:
    """One ``nn.Linear``'s forward and backward: its three matmuls and fp8's casts."""

    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    matmul_s: float  # of the total, in the three matmuls (the rest: fp8's casts)

    @property
    def forward_s(self) -> float:
        return sum(k.seconds for k in self.forward)

    @property
    def total_s(self) -> float:
        return self.forward_s + sum(k.seconds for k in self.backward)

    @property
    def kernels(self) -> tuple[Kernel, ...]:
        return self.forward + self.backward


def linear_times(gpu: Gpu, m: int, k: int, n: int, fmt: str, grad_input: bool = True) -> LinearTime:
    """An ``nn.Linear`` of ``k`` inputs and ``n`` outputs on ``m`` rows, forward (output) and
    backward (grad_input, unless ``grad_input`` is false, and grad_weight), in ``fmt`` (one of
    ``FORMATS``): how ``ampsweep predict`` times every Linear, in a mode's step and in fp8's
    layer filter. fp8: the matmuls in fp8 with bf16 outputs, plus torchao's kernels that cast
    input, weight and grad_output from bf16 (``fp8_casts``). Raises ValueError for a format
    this GPU has no tensor cores for."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt}: choose one of {', '.join(FORMATS)}")
    recipe = fmt.removeprefix("fp8_") if fmt.startswith("fp8_") else ""
    kind = "fp8" if recipe else fmt
    if gpu.peak(kind) is None:
        raise ValueError(f"format {fmt}: the {gpu.label} has no {kind} tensor cores")
    size = BYTES[kind]
    out = BYTES["bf16"] if recipe else size

    def mm(a: int, b: int, c: int) -> Kernel:
        return matmul(gpu, a, b, c, kind, size, out)

    forward, backward = [mm(m, k, n)], [mm(m, n, k), mm(k, m, n)][not grad_input :]
    matmul_s = sum(k.seconds for k in forward + backward)
    if recipe:
        fwd_casts, bwd_casts = fp8_casts(gpu, m, k, n, recipe)
        forward, backward = fwd_casts + forward, bwd_casts + backward
    return LinearTime(tuple(forward), tuple(backward), matmul_s)


def fp8_casts(gpu: Gpu, m: int, k: int, n: int, recipe: str):
    """The memory-bound kernels torchao's float8 training adds around a Linear's matmuls, as
    compiled (its roofline's account): per tensor (input m x k, weight k x n, grad_output
    m x n), tensorwise scaling reads it for its amax, reduces that (a tiny kernel) and casts it
    to fp8 in both layouts the matmuls need (the weight's second layout cast in backward);
    rowwise scaling has no global amax but casts each layout from its own rows, the second
    one through a transposed bf16 copy. Returns the forward's kernels and the backward's."""
    hp, f8 = BYTES["bf16"], BYTES["fp8"]

    def mem(nbytes: float) -> Kernel:
        return kernel(gpu, 0.0, nbytes)

    def tensor(numel: int, weight: bool) -> tuple[list[Kernel], list[Kernel]]:
        if recipe == "tensorwise":
            amax = [mem(hp * numel), mem(0)]
            if weight:  # one layout now, the other in backward
                return [*amax, mem((hp + f8) * numel)], [mem((hp + f8) * numel)]
            return [*amax, mem((hp + 2 * f8) * numel)], []
        if weight:
            first = [mem((hp + f8) * numel)]
            return first, [mem(2 * hp * numel), mem((hp + f8) * numel)]
        return [mem((2 * hp + f8) * numel), mem((hp + f8) * numel)], []

    x_fwd, _ = tensor(m * k, weight=False)
    w_fwd, w_bwd = tensor(k * n, weight=True)
    g_bwd, _ = tensor(m * n, weight=False)
    return x_fwd + w_fwd, w_bwd + g_bwd
