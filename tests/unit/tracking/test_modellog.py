"""tracking.modellog: a logged model's signature output from the first rows of its input
example, and its pinned requirements read once per environment."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ampsweep.engine.export import ModelSnapshot
from ampsweep.tracking import installed, modellog


class Rows(torch.nn.Module):
    """Counts the rows it sees; squeezes its output like some user models do."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(len(x))
        return self.fc(x).squeeze()


def test_the_signature_output_runs_two_rows_and_keeps_the_batch():
    net = Rows()
    output = modellog.signature_output(ModelSnapshot(net, np.zeros((64, 4), dtype=np.float32)))
    assert net.rows == [2]  # not a forward over the 64 rows of the example
    assert output.shape == (2, 3) and output.dtype == np.float32  # the batch stays a batch


def test_a_model_that_cannot_run_has_no_signature_output():
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("float8 matmul needs a GPU")

    snapshot = ModelSnapshot(Broken(), np.zeros((8, 4), dtype=np.float32))
    assert modellog.signature_output(snapshot) is None


def test_requirements_are_read_once_per_environment(monkeypatch):
    reads = []
    real = installed.version
    monkeypatch.setattr(installed, "version", lambda name: reads.append(name) or real(name))
    modellog._pins.cache_clear()
    modellog._by_value.cache_clear()
    first = modellog.pinned_requirements({"torch", "timm", "ampsweep"})
    assert first[:3] == [f"{n}=={real(n).split('+')[0]}" for n in ("torch", "cloudpickle", "numpy")]
    count = len(reads)
    assert count > 0
    assert modellog.pinned_requirements({"ampsweep", "timm", "torch"}) == first
    assert len(reads) == count  # the next job of a sweep, or a rerun: nothing read again
    # a distribution installed or removed changes its folder's mtime: read again
    key = installed.environment_key()
    monkeypatch.setattr(installed, "environment_key", lambda: (*key[:2], ()))
    assert modellog.pinned_requirements({"torch", "timm", "ampsweep"}) == first
    assert len(reads) > count


@pytest.mark.parametrize("packages", [set(), {"torch"}, {"torch", "__main__", "builtins"}])
def test_the_base_requirements_are_always_pinned(packages):
    names = [r.split("==")[0] for r in modellog.pinned_requirements(packages)]
    assert names == ["torch", "cloudpickle", "numpy"]
    assert modellog.pickled_by_value(packages) == set()  # a script's classes: cloudpickle's own


def test_requirements_are_pinned_from_what_is_installed():
    reqs = modellog.pinned_requirements({"torch", "torchvision", "ampsweep", "mynets"})
    names = [r.split("==")[0] for r in reqs]
    assert names == ["torch", "cloudpickle", "numpy", "torchvision"]
    assert all("+" not in r for r in reqs)  # local labels (+cu130) are not on PyPI
    # ampsweep's and a local module's classes travel inside the pickle instead
    assert modellog.pickled_by_value({"torch", "ampsweep", "mynets"}) == {"ampsweep", "mynets"}


def test_a_package_named_otherwise_than_its_distribution_is_pinned_by_the_distribution():
    # sklearn is scikit-learn's, PIL Pillow's, yaml PyYAML's: importable, hence installed,
    # so their classes travel by reference and loading the model needs the distribution
    pins = modellog.pinned_requirements({"torch", "sklearn", "PIL", "yaml"})
    for package, dist in (("sklearn", "scikit-learn"), ("PIL", "pillow"), ("yaml", "PyYAML")):
        (pin,) = [p for p in pins if p.split("==")[0].lower() == dist.lower()]
        assert pin.split("==")[1] == installed.version(dist).split("+")[0], package
    assert modellog.pickled_by_value({"torch", "sklearn", "PIL", "yaml", "mynets"}) == {"mynets"}
