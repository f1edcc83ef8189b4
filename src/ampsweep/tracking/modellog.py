"""What a logged model carries besides its weights, made cheap for the end of a run.

A run's end waits for its model to be logged (a run is FINISHED only once its model is
recorded), so whatever logging costs lands on the wall time of every standalone run. Two
things MLflow would do there cost seconds and are replaced here:

- the requirements: MLflow infers them by loading the saved model in a subprocess (9-15 s)
  and checks pins against a map of every module of every installed distribution (a walk over
  tens of thousands of files, ~0.3 s of CPU once per process). ampsweep pins what loading the
  model needs from the installed versions instead, reads them once per process and
  environment, and skips the walk (``model_files.no_env_scan``: it can only agree, the pins
  come from this environment);
- the signature's output: one forward of the model on the whole input example (a batch of up
  to 65,536 values: 0.3-0.9 s for a ResNet on a CPU) where two rows give the same signature.

Everything else MLflow writes (MLmodel, the pickled module, requirements and environment
files, the input example) is what ``mlflow.pytorch.load_model`` and the UI read, and costs
milliseconds: the command writes the pickled module (``logged_model``), the recorder host the
rest (``model_files``); the numbers are in the docs' performance page. Nothing here imports
MLflow or torch.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterable
from typing import Any

import cloudpickle

from ampsweep.tracking import installed

# Always required to load a model saved in pickle format (mlflow itself is added by MLflow).
BASE_REQUIREMENTS = ("torch", "cloudpickle", "numpy")

# Module names of classes that no package provides: a script's own (cloudpickle pickles
# __main__'s classes by value already) and Python's.
NO_PACKAGE = frozenset({"__main__", "builtins"})

# Rows of the input example the signature's output is computed from: two, not one, so that a
# model which squeezes its output still shows its batch dimension.
SIGNATURE_ROWS = 2

# MLflow's pytorch flavor keeps the pickled module in data/model.pth (mlflow.pytorch's
# _MODEL_DATA_SUBPATH and _SERIALIZED_TORCH_MODEL_FILE_NAME; test_model_files.py checks them).
DATA = "data"
WEIGHTS = "model.pth"


def signature_output(snapshot) -> Any:
    """The model's output on the first rows of its input example, from which the signature
    takes its outputs; None for a model whose forward does not run on the CPU (e.g. a float8
    model trained on a GPU): its signature then has inputs only."""
    try:
        return snapshot.predict(snapshot.example[:SIGNATURE_ROWS])
    except Exception:
        return None


def pickled_by_value(packages: Iterable[str]) -> set[str]:
    """Packages whose classes are pickled with the model, by value: ampsweep's own (not on
    PyPI) and any that no installed distribution provides (a user's local module), so the
    model loads where neither is importable. Classes of installed packages are pickled by
    reference and their distributions pinned as requirements."""
    return set(_by_value(frozenset(packages), installed.environment_key()))


def pinned_requirements(packages: Iterable[str]) -> list[str]:
    """``name==version`` of what loading the model needs: torch, cloudpickle, numpy and the
    installed distributions its classes come from (torchvision, timm, transformers, torchao;
    scikit-learn for ``sklearn``...).
    Versions are read from the installed distributions (local labels such as ``+cu128``
    dropped, so pip finds them), once per process and environment: the jobs of a sweep log
    the same packages, and so does a rerun."""
    return list(_pins(frozenset(packages), installed.environment_key()))


@functools.lru_cache(maxsize=64)
def _by_value(packages: frozenset[str], environment: tuple) -> frozenset[str]:
    return frozenset(p for p in packages - NO_PACKAGE if p == "ampsweep" or not _distributions(p))


@functools.lru_cache(maxsize=64)
def _pins(packages: frozenset[str], environment: tuple) -> tuple[str, ...]:
    by_value = _by_value(packages, environment)
    wanted = [*BASE_REQUIREMENTS, *sorted(packages - by_value - NO_PACKAGE)]
    names = [name for package in wanted for name in _distributions(package)]
    out = []
    for name in dict.fromkeys(names):
        version = installed.version(name)
        if version is not None:
            out.append(f"{name}=={version.split('+')[0]}")
    return tuple(out)


def _distributions(package: str) -> list[str]:
    """The installed distributions that provide top-level package ``package``: most are named
    after it (read directly, cheap), others not (``sklearn`` is scikit-learn's, ``PIL``
    Pillow's, ``open_clip`` open_clip_torch's: found from what each distribution provides).
    None (an empty list) for a local module or a built-in one."""
    if installed.version(package) is not None:
        return [package]
    return installed.distributions_of(package)


@contextlib.contextmanager
def classes_pickled_by_value(packages: set[str]):
    """cloudpickle pickles the classes of ``packages`` (already imported) by value inside."""
    modules = [sys.modules[p] for p in sorted(packages) if p in sys.modules]
    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    try:
        yield
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)
