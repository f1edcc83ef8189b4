"""The trained model as it is handed to MLflow: a snapshot taken when training ends.

The snapshot is the plain module (not DDP's wrapper, not torch.compile's), copied to the CPU in
fp32: a ``*_pure`` mode trains half-precision weights, but a logged model is for people to load
anywhere, and fp32 holds every half value exactly (``.to(torch.bfloat16)`` gives the trained
weights back bit for bit). Its input example is one batch as the model receives it (at most
``EXAMPLE_VALUES`` values, so a batch of large images does not become a megabytes-long JSON
file). Taking the snapshot is cheap and happens at once, so the training run's memory can go;
computing the example's output (for the signature) is left to whoever logs it, off the
critical path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import cloudpickle
import numpy as np
import torch

from ampsweep.engine import distributed
from ampsweep.precision.policy import Fp32Forward

EXAMPLE_VALUES = 65536  # values in the input example (whole rows, at least one)


@dataclass
class ModelSnapshot:
    module: torch.nn.Module  # fp32 (floating tensors), CPU, eval mode
    example: np.ndarray  # one batch of inputs, as numpy (float32 for floating inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The module's output on ``x`` (float32), as the signature records it."""
        with torch.inference_mode():
            out = self.module(torch.from_numpy(x))
        return out.float().numpy() if out.is_floating_point() else out.numpy()

    def save(self, file: str) -> None:
        """The whole module pickled into ``file`` with cloudpickle, as MLflow's pytorch flavor
        keeps it (``mlflow.pytorch.pickle_module`` is cloudpickle's functions), so that
        ``mlflow.pytorch.load_model`` loads it back."""
        torch.save(self.module, file, pickle_module=cloudpickle)

    @property
    def packages(self) -> set[str]:
        """Top-level packages the module's classes come from (torch, ampsweep, timm, ...)."""
        return {type(m).__module__.split(".")[0] for m in self.module.modules()}

    @property
    def torch_version(self) -> str:
        return str(torch.__version__)


def snapshot(model: torch.nn.Module, batches) -> ModelSnapshot:
    """The trained ``model`` copied for logging, with an input example from ``batches``."""
    module = distributed.unwrap(model)
    # Each tensor copied straight to a CPU fp32 tensor (deepcopy's memo), so the copy never
    # doubles the GPU memory the trained model holds.
    params = {id(p) for p in module.parameters()}
    memo = {}
    for t in [*module.parameters(), *module.buffers()]:
        cpu = t.detach().to("cpu", _fp32(t.dtype), copy=True)
        memo[id(t)] = torch.nn.Parameter(cpu, t.requires_grad) if id(t) in params else cpu
    copied = copy.deepcopy(module, memo).eval()
    for m in copied.modules():  # all fp32 now: precision.keep_fp32's wrappers have no use left
        if isinstance(m.__dict__.get("forward"), Fp32Forward):
            del m.forward
    x, _ = next(iter(batches.epoch(0)))
    per_row = max(1, x[0].numel())
    rows = max(1, min(len(x), EXAMPLE_VALUES // per_row))
    example = x[:rows].detach().to("cpu", _fp32(x.dtype)).contiguous().numpy()
    return ModelSnapshot(copied, example)


def _fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype.is_floating_point else dtype
