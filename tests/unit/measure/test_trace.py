"""One training step's kernels, traced on the meta device with the module each runs in."""

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from ampsweep.measure.trace import ATTENTION, trace_step


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        q, k, v = self.qkv(x).view(4, 8, 3, 2, 16).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(self.norm(torch.relu(a.transpose(1, 2).reshape(4, 8, 32)))).mean(1)


def loss(logits, y):
    return F.cross_entropy(logits, y)


def test_each_kernel_is_counted_to_its_module_forward_and_backward():
    model = Block()
    x, y = torch.randn(4, 8, 32), torch.randint(0, 10, (4,))
    ops = trace_step(model, x, y, loss)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model is untouched
    by = Counter((op.module, op.kind, op.backward) for op in ops if op.kind != "memory")
    # each Linear: one matmul forward; backward grad_input and grad_weight, but the first
    # layer has no grad_input to compute: its input is the data
    assert by[("qkv", "matmul", False)] == 1 and by[("head", "matmul", False)] == 1
    assert by[("qkv", "matmul", True)] == 1 and by[("head", "matmul", True)] == 2
    qkv = next(op for op in ops if op.module == "qkv" and not op.backward and op.kind == "matmul")
    assert qkv.shape == (32, 32, 96) and qkv.flops == 2 * 32 * 32 * 96
    # attention: one fused kernel each way (no attention matrix through memory), in the
    # module that calls it (the root here, as the loss is: "")
    fused = [op for op in ops if op.name.startswith(ATTENTION)]
    assert [op.backward for op in fused] == [False, True] and fused[0].module == ""
    assert not any(op.name in ("bmm", "_softmax", "_safe_softmax") for op in ops)
    assert any(op.module == "norm" and op.backward for op in ops)
    assert not any(op.name in ("view", "permute", "t", "transpose", "detach") for op in ops)
    relu = next(op for op in ops if op.name == "relu")
    assert relu.float_bytes == 2 * 4 * 8 * 32 * 4  # read and written, fp32


class Counting(nn.Module):
    """A model that reads a value back (``.item()``): it cannot run on the meta device."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x) * (1.0 if x.abs().sum().item() >= 0 else 0.0)


def test_a_model_that_cannot_run_on_meta_is_traced_on_the_cpu():
    ops = trace_step(Counting(), torch.randn(16, 8), torch.randint(0, 4, (16,)), loss)
    fc = [op for op in ops if op.module == "fc" and op.kind == "matmul"]
    assert len(fc) == 2 and fc[0].shape == (16, 8, 4) and fc[1].backward


def test_a_model_built_on_meta_that_cannot_run_there_is_traced_on_zeros_in_fp32():
    """What a run records its prediction from: its model built anew on the meta device, fed
    the run's batch (in a pure mode's half dtype)."""
    with torch.device("meta"):
        model = Counting()
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    ops = trace_step(model, x, torch.randint(0, 4, (16,)), loss)
    fc = [op for op in ops if op.module == "fc" and op.kind == "matmul"]
    assert fc[0].shape == (16, 8, 4) and fc[0].float_bytes == 4 * (16 * 8 + 8 * 4 + 4 + 16 * 4)
    assert model.fc.weight.is_meta
