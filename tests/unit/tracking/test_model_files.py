"""tracking/model_files.py: the files of a logged model around its weights, written without
torch where MLflow is, are the files ``mlflow.pytorch.save_model`` writes, one by one."""

from __future__ import annotations

import filecmp
import os

import mlflow.pytorch
import numpy as np
import pytest
import torch
import yaml
from mlflow.models import Model, infer_signature
from mlflow.utils import environment
from mlflow.utils import requirements_utils as reqs

from ampsweep.engine.export import ModelSnapshot
from ampsweep.tracking import model_files, modellog

IDS = {"model_id": "m-0123", "artifact_location": "file:///tmp/a/m-0123", "run_id": "r0123"}


def ours(path: str, snapshot: ModelSnapshot) -> None:
    """The model as ampsweep writes it: the weights here, the rest by model_files."""
    os.makedirs(os.path.join(path, modellog.DATA))
    snapshot.save(os.path.join(path, modellog.DATA, modellog.WEIGHTS))
    output = modellog.signature_output(snapshot)
    model_files.write(path, **IDS, example=snapshot.example, output=output,
                      packages=sorted(snapshot.packages),
                      torch_version=snapshot.torch_version)  # fmt: skip


def theirs(path: str, snapshot: ModelSnapshot) -> None:
    """The same model written by mlflow.pytorch.save_model, as ampsweep called it before."""
    info = Model(artifact_path=IDS["artifact_location"], model_uuid=IDS["model_id"],
                 run_id=IDS["run_id"], model_id=IDS["model_id"])  # fmt: skip
    output = modellog.signature_output(snapshot)
    mlflow.pytorch.save_model(
        snapshot.module, path, mlflow_model=info, input_example=snapshot.example,
        signature=infer_signature(snapshot.example, output), serialization_format="pickle",
        pip_requirements=modellog.pinned_requirements(snapshot.packages),
    )  # fmt: skip


def files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns}


@pytest.mark.parametrize("failing", [False, True])
def test_the_files_are_those_mlflow_pytorch_save_model_writes(tmp_path, failing):
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    if failing:  # a model whose forward does not run here: a signature of its inputs only
        net.forward = lambda x: (_ for _ in ()).throw(RuntimeError("needs a GPU"))
    snapshot = ModelSnapshot(net, np.random.default_rng(0).random((5, 4), dtype=np.float32))
    ours(str(tmp_path / "ours"), snapshot)
    theirs(str(tmp_path / "theirs"), snapshot)
    assert files(tmp_path / "ours") == files(tmp_path / "theirs")
    for name in files(tmp_path / "ours") - {"MLmodel", "data/model.pth"}:
        mine, want = (tmp_path / d / name for d in ("ours", "theirs"))
        assert filecmp.cmp(mine, want, shallow=False), (name, mine.read_bytes(), want.read_bytes())
    mine, want = (
        yaml.safe_load((tmp_path / d / "MLmodel").read_text()) for d in ["ours", "theirs"]
    )
    mine.pop("utc_time_created"), want.pop("utc_time_created")
    assert mine == want
    loaded = mlflow.pytorch.load_model(str(tmp_path / "ours"))
    x = torch.from_numpy(snapshot.example)
    if not failing:
        assert torch.equal(loaded(x), net(x))


def test_mlflows_private_names_are_where_model_files_reads_them():
    """What model_files and modellog take from MLflow's private API and layout (checked on
    mlflow 3.17.2): renamed or moved, this fails before a model is written wrong."""
    flavor = mlflow.pytorch
    assert flavor._MODEL_DATA_SUBPATH == modellog.DATA  # noqa: SLF001
    assert flavor._SERIALIZED_TORCH_MODEL_FILE_NAME == modellog.WEIGHTS  # noqa: SLF001
    assert flavor._PICKLE_MODULE_INFO_FILE_NAME == model_files.PICKLE_INFO  # noqa: SLF001
    assert flavor.pickle_module.__name__ == model_files.PICKLE_MODULE
    assert environment._CONDA_ENV_FILE_NAME == model_files.CONDA_ENV  # noqa: SLF001
    assert environment._PYTHON_ENV_FILE_NAME == model_files.PYTHON_ENV  # noqa: SLF001
    assert environment._REQUIREMENTS_FILE_NAME == model_files.REQUIREMENTS  # noqa: SLF001
    assert environment._CONSTRAINTS_FILE_NAME == model_files.CONSTRAINTS  # noqa: SLF001


def test_mlflow_still_caches_its_module_to_package_map_where_no_env_scan_sets_it():
    # no_env_scan sets MLflow's private map (mlflow 3.17.2); renamed, a model only gets slower
    assert hasattr(reqs, "_MODULES_TO_PACKAGES") and hasattr(reqs, "_PACKAGES_TO_MODULES")
    before = reqs._MODULES_TO_PACKAGES  # noqa: SLF001
    with model_files.no_env_scan():
        inside = reqs._MODULES_TO_PACKAGES  # noqa: SLF001
    assert inside == {} if before is None else inside is before


def test_the_environment_files_follow_the_environment_they_are_written_in(tmp_path, monkeypatch):
    """Computed once per environment, not once per process: a wheel installed meanwhile (here
    a distribution put on sys.path) is in the next model's files."""
    snapshot = ModelSnapshot(torch.nn.Linear(4, 3), np.zeros((2, 4), dtype=np.float32))
    ours(str(tmp_path / "before"), snapshot)
    site = tmp_path / "site" / "wheel-99.0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: wheel\nVersion: 99.0\n")
    monkeypatch.syspath_prepend(str(site.parent))
    ours(str(tmp_path / "after"), snapshot)
    assert "wheel==99.0" not in (tmp_path / "before" / "python_env.yaml").read_text()
    assert "wheel==99.0" in (tmp_path / "after" / "python_env.yaml").read_text()
