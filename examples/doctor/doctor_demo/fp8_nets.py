"""A small model for the bundled digits data whose one layer fp8 cannot carry:

* ``outlier_net``: the weight matrix of ``fc2`` holds one ``outlier``, on an input that never
  fires (a unit of ``fc1`` with zero weights, silenced by its ReLU), so that it changes
  nothing the model computes. fp8 with tensorwise scaling scales the whole matrix so that its
  largest value fits e4m3's 448: every ordinary weight, ``outlier`` times smaller, falls under
  e4m3's smallest subnormal (2^-9) and rounds to zero. In fp32 and bf16 the layer is fine.

``ampsweep doctor --modes fp8_tensorwise precision.fp8.emulate=true model=outlier_net`` names
``fc2`` with its SQNR against bf16 and prescribes ``precision.fp8.keep_bf16=[fc2]``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


def outlier_net(
    in_channels: int, num_classes: int, hidden: int = 64, in_features: int = 64,
    outlier: float = 1e5,
):  # fmt: skip
    """``in_features``: the flattened input size (64 for digits' 8x8 images)."""
    fc1 = nn.Linear(in_features * in_channels, hidden)
    fc2 = nn.Linear(hidden, hidden)
    with torch.no_grad():
        fc1.weight[-1].zero_()  # the last unit of fc1 never fires (ReLU of 0: no gradient)
        fc1.bias[-1] = 0.0
        fc2.weight[0, -1] = outlier  # ... and carries fc2's one outlier
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            fc1=fc1,
            act1=nn.ReLU(),
            fc2=fc2,
            act2=nn.ReLU(),
            fc3=nn.Linear(hidden, hidden),
            act3=nn.ReLU(),
            head=nn.Linear(hidden, num_classes),
        )
    )
