"""What is live at each moment of the measured training step, counted as it runs: the
parameters' gradients, the tensors autograd saved (until it lets go of them) and the gradients
of activations in flight between backward's nodes. ``StepPeak`` marks each change (``Live``);
the marks say what was live at the step's peak."""

from __future__ import annotations

from functools import partial

import torch
from torch.autograd.graph import Node

from ampsweep.measure.memory import Held, storage_of, tensor_bytes

# The parts counted as the step runs, in the order of a mark's numbers
LIVE = ("grads", "activations", "autocast_cache", "fp8", "activation_grads")
Snapshot = tuple[int, ...]
NOTHING: Snapshot = (0,) * len(LIVE)


def text(numbers: Snapshot) -> str:
    return " ".join(map(str, numbers))


def numbers(text: str) -> Snapshot:
    return tuple(int(n) for n in text.split())


def plus(a: Snapshot, b: Snapshot) -> Snapshot:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def made_before(made: Snapshot, later: int) -> Snapshot:
    """Of what a node made (live as it ends), what was made before its peak: at least all of
    it but the bytes it allocated after the peak, taken off the parameters' gradients first
    (a node computes them after the gradient of its input)."""
    out = dict(zip(LIVE, made, strict=True))
    for part in ("grads", "activation_grads"):
        taken = min(out[part], later)
        out[part], later = out[part] - taken, later - taken
    return tuple(out[part] for part in LIVE)


class Live:
    """The bytes of each part (``LIVE``) live at this moment of the measured step, told to
    ``mark`` (the state now, and what the node ending now made) at each change.

    Saved tensors (``keep``): each storage counts once, from the first time autograd saves it
    to the last time it lets go of it. Gradients of activations (``watch``): a node's
    gradient for one input of the next node counts from the moment the node that makes it
    ends until the node it feeds ends (having used it); several nodes feeding one input
    count once (autograd adds them into one buffer, freeing each as it is added), and a
    gradient handed on as it came (a view's, an addition's) counts once, by its storage.
    Gradients that feed a parameter are ``grads`` as the parameter's accumulates it; a
    peak while a node runs counts what it made as live then."""

    def __init__(self, mark, grads: int = 0):
        self._mark = mark  # None: a state that marks nothing
        self.bytes = dict.fromkeys(LIVE, 0)
        self.bytes["grads"] = grads
        self.first = self.snapshot()  # as the step began
        self._saved: dict[tuple[str, int], list] = {}  # storage -> [part, bytes, holders]
        self._flying: dict[tuple[str, int], list] = {}  # storage -> [bytes, inputs fed]
        self._feeds: dict[tuple[int, int], tuple[str, int]] = {}  # (node, input) -> storage
        self._nodes = 0  # the nodes hooked so far, over every micro-batch's graph

    def close(self) -> None:
        """Mark nothing more: a saved tensor autograd lets go of later (a node that never ran,
        its graph collected in another run's measured step) is no part of another step."""
        self._mark = None

    def snapshot(self) -> Snapshot:
        return tuple(self.bytes[part] for part in LIVE)

    def add(self, part: str, nbytes: int, made: Snapshot = NOTHING) -> None:
        self.bytes[part] += nbytes
        if self._mark is not None:
            self._mark(self.snapshot(), made)

    def keep(self, t: torch.Tensor, key: tuple[str, int], part: str, size: int) -> Held:
        held = self._saved.setdefault(key, [part, size, 0])
        held[2] += 1
        if held[2] == 1:
            self.add(part, size)
        return Held(t, partial(self._let_go, key))

    def _let_go(self, key: tuple[str, int]) -> None:
        held = self._saved[key]
        held[2] -= 1
        if held[2] == 0:
            del self._saved[key]
            self.add(held[0], -held[1])

    def watch(self, loss: torch.Tensor) -> None:
        """Hook each node of ``loss``'s backward graph but the parameters' own
        (AccumulateGrad, whose hooks would keep it from taking a gradient as it is)."""
        nodes: dict[int, tuple[int, Node]] = {}  # id -> (index, node), while walking
        todo = [loss.grad_fn] if loss.grad_fn is not None else []
        while todo:
            node = todo.pop()
            if id(node) in nodes:
                continue
            nodes[id(node)] = (self._nodes + len(nodes), node)
            todo += [f for f, _ in node.next_functions if f is not None and not _leaf(f)]
        for index, walked in nodes.values():
            feeds = [
                None if f is None else LEAF if _leaf(f) else (nodes[id(f)][0], slot)
                for f, slot in walked.next_functions
            ]
            walked.register_prehook(partial(self._node_begins, index))
            walked.register_hook(partial(self._node_ends, index, feeds))
        self._nodes += len(nodes)

    def _feed(self, to: tuple[int, int], g: torch.Tensor) -> None:
        if to in self._feeds:  # added into the gradient the input has already
            return
        key, size = storage_of(g)
        self._feeds[to] = key
        flying = self._flying.setdefault(key, [size, 0])
        flying[1] += 1
        if flying[1] == 1:
            self.bytes["activation_grads"] += size

    def _used(self, to: tuple[int, int]) -> None:
        key = self._feeds.pop(to, None)
        if key is not None:
            flying = self._flying[key]
            flying[1] -= 1
            if flying[1] == 0:
                del self._flying[key]
                self.bytes["activation_grads"] -= flying[0]

    def _node_begins(self, index: int, grad_outputs) -> None:
        # What reaches it from a node not hooked (the loss's scaling): in flight from now
        for slot, g in enumerate(grad_outputs):
            if g is not None:
                self._feed((index, slot), g)
        self.add("activation_grads", 0)

    def _node_ends(self, index: int, feeds: list, grad_inputs, grad_outputs) -> None:
        before = self.bytes["activation_grads"]
        to_params = 0
        for to, g in zip(feeds, grad_inputs, strict=False):
            if g is None or to is None:
                continue
            if to is LEAF:
                to_params += tensor_bytes(g)
            else:
                self._feed(to, g)
        made = self.bytes["activation_grads"] - before  # new storages: made by this node
        for slot in range(len(grad_outputs)):
            self._used((index, slot))
        grads = dict.fromkeys(LIVE, 0) | {"grads": to_params, "activation_grads": made}
        self.add("activation_grads", 0, tuple(grads[part] for part in LIVE))


LEAF = (-1, -1)  # a gradient that feeds a parameter (its AccumulateGrad)


def _leaf(node) -> bool:
    return hasattr(node, "variable")  # AccumulateGrad: the leaf it accumulates into
