"""The files of a logged model around its weights: what ``mlflow.pytorch.save_model`` writes
besides ``data/model.pth``, written with MLflow's own classes where MLflow is imported (the
recorder host, ``tracking.host``), from the weights file the command wrote.

``save_model`` needs torch in the process that calls it, and the recorder host must not import
torch (it would compete with the command for the CPU it saves, measured in docs/benchmarks.md).
So the command saves the module (``logged_model``) and this module writes the rest as
``save_model`` does, in its order: the input example, the signature, the pickle module's name,
the ``pytorch`` and ``python_function`` flavors, the MLmodel file, and the requirements and
environment files. ``mlflow.pytorch.load_model`` and the UI read exactly these;
tests/unit/tracking/test_model_files.py checks them against ``save_model``'s own, file by file.

Three helpers are MLflow's private ones, with no public equivalent (checked on mlflow 3.17.2;
that test fails if any moves): ``_save_example`` (the example files and their MLmodel entry),
``_process_pip_requirements`` (requirements.txt, conda.yaml) and ``_PythonEnv``
(python_env.yaml). Requirements are pinned, never inferred (``modellog`` says why), and the
requirements files are computed once per set of pins and environment.
"""

from __future__ import annotations

import contextlib
import functools
import os

import yaml
from mlflow.models import Model, infer_signature
from mlflow.models.model import MLMODEL_FILE_NAME
from mlflow.models.utils import _save_example

# Imported here, not where it is used: `from mlflow import pyfunc` names a lazy module that
# would be imported at the first model (about 0.05 s at the end of a run), not with the rest.
from mlflow.pyfunc import add_to_model
from mlflow.utils import requirements_utils as reqs
from mlflow.utils.environment import _process_pip_requirements, _PythonEnv

from ampsweep.tracking import installed, modellog

FLAVOR = "pytorch"
PICKLE_MODULE = "mlflow.pytorch.pickle_module"  # cloudpickle's functions under MLflow's name
PICKLE_INFO = "pickle_module_info.txt"  # in data/: which module unpickles model.pth
CONDA_ENV = "conda.yaml"
PYTHON_ENV = "python_env.yaml"
REQUIREMENTS = "requirements.txt"
CONSTRAINTS = "constraints.txt"


def write(path: str, *, model_id: str, artifact_location: str, run_id: str, example, output,
          packages: list[str], torch_version: str) -> None:  # fmt: skip
    """Write the model at ``path`` around ``path/data/model.pth``: ``example`` is one batch of
    inputs, ``output`` the model's output on its first rows (None: the signature has inputs
    only), ``packages`` the top-level packages of the module's classes."""
    info = Model(artifact_path=artifact_location, model_uuid=model_id, run_id=run_id,
                 model_id=model_id)  # fmt: skip
    _save_example(info, example, path)
    info.signature = infer_signature(example, output)
    with open(os.path.join(path, modellog.DATA, PICKLE_INFO), "w") as f:
        f.write(PICKLE_MODULE)
    info.add_flavor(FLAVOR, model_data=modellog.DATA, pytorch_version=torch_version, code=None)
    add_to_model(info, loader_module="mlflow.pytorch", data=modellog.DATA,
                 pickle_module_name=PICKLE_MODULE, code=None, conda_env=CONDA_ENV,
                 python_env=PYTHON_ENV, model_config={"device": None})  # fmt: skip
    info.model_size_bytes = _size(path)
    info.save(os.path.join(path, MLMODEL_FILE_NAME))
    pins = tuple(modellog.pinned_requirements(packages))
    conda_env, requirements, constraints = _requirements(pins, installed.environment_key())
    with open(os.path.join(path, CONDA_ENV), "w") as f:
        yaml.safe_dump(conda_env, stream=f, default_flow_style=False)
    if constraints:
        _write(os.path.join(path, CONSTRAINTS), "\n".join(constraints))
    _write(os.path.join(path, REQUIREMENTS), "\n".join(requirements))
    # The interpreter and its pip, setuptools and wheel, read as save_model reads them (0.5 ms)
    _PythonEnv.current().to_yaml(os.path.join(path, PYTHON_ENV))


@functools.lru_cache(maxsize=16)
def _requirements(pins: tuple[str, ...], environment: tuple):
    """conda.yaml's content, requirements.txt's lines and the constraints for these pins
    (mlflow's own pin added), computed once per set of pins and environment
    (``installed.environment_key``): the jobs of a sweep pin the same packages."""
    with no_env_scan():
        conda_env, requirements, constraints = _process_pip_requirements(None, list(pins), None)
    return conda_env, tuple(requirements), tuple(constraints)


def _size(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(path)
        for name in names
    )


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def no_env_scan():
    """Skip MLflow's check of the pinned requirements against the environment: it first maps
    every module of every installed distribution to its package (a walk over tens of
    thousands of files: about 0.3 s of CPU, once per process) and can only pass here, since
    the pins were read from this environment. MLflow skips the walk when its map exists; an
    empty one lasts for the check alone (``None`` again after), so whatever else in the
    process later infers requirements still gets the real map. If MLflow renames the map,
    nothing is skipped: a model merely takes longer. (Private to MLflow, with no public
    switch: checked on mlflow 3.17.2; tests/unit/tracking/test_model_files.py fails if it
    moves.)"""
    if getattr(reqs, "_MODULES_TO_PACKAGES", ...) is not None:
        yield  # computed already (cheap from now on), or not MLflow's layout any more
        return
    reqs._MODULES_TO_PACKAGES = {}
    try:
        yield
    finally:
        reqs._MODULES_TO_PACKAGES, reqs._PACKAGES_TO_MODULES = None, None
