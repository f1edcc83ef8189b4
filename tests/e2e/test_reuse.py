"""A relaunched sweep reuses a FINISHED run only when the config and the code it ran are the
same: a user's model whose code changed is trained again (and the command says why), an
unchanged one is reused and marked in the report's table. Each command is a process of its
own, as a user's are: one process would import the edited model's module once."""

from __future__ import annotations

import pytest
from conftest import all_runs, run_cli

pytestmark = pytest.mark.slow

NET = """\
import torch


class Net(torch.nn.Module):
    def __init__(self, input_shape, num_classes, hidden: int = 8):
        super().__init__()
        self.flat = torch.nn.Flatten()
        self.inner = torch.nn.Linear(input_shape[-1] * input_shape[-2], hidden)
        self.out = torch.nn.Linear(hidden, num_classes)

    def forward(self, x):
        h = self.inner(self.flat(x))
        return self.out(h + SKIP * h.relu())


SKIP = 1.0
"""


def results_table(stdout: str) -> str:
    """The report's table of runs: from its title to the memory table (or the findings)."""
    table = stdout[stdout.index("\nSweep ") :]
    return table.split("Memory of a training step")[0].split("Findings")[0]


def test_a_changed_model_is_trained_again_and_a_reused_row_is_marked(tmp_path, store_uri):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    nets = tmp_path / "mypkg" / "nets.py"
    nets.write_text(NET)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "my_net.yaml").write_text("_target_: mypkg.nets.Net\n")
    sweep = ["train", "--config-dir", "conf", "-m", "precision=fp32,bf16", "model=my_net",
             "trainer.epochs=1", "trainer.max_steps=4", "trainer.timing_warmup_steps=1",
             "trainer.progress=false", "diagnostics.every=0",
             f"tracking.uri={store_uri}"]  # fmt: skip
    first = run_cli(sweep, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    trained = {r.info.run_id for r in all_runs(store_uri) if r.data.tags.get("mlflow.parentRunId")}
    assert len(trained) == 2
    # Unchanged: both jobs reused, and the report's table says which rows are reused.
    same = run_cli(sweep, tmp_path)
    assert same.returncode == 0, same.stderr[-2000:]
    assert same.stdout.count("skipped, the identical config FINISHED") == 2, same.stdout
    table = results_table(same.stdout)
    rows = [line for line in table.splitlines() if line.strip().startswith(("fp32", "bf16"))]
    assert len(rows) == 2 and all("earlier" in row for row in rows), table
    # The model's code changes (its skip connection scaled by 0.5): both jobs train again.
    nets.write_text(NET.replace("SKIP = 1.0", "SKIP = 0.5"))
    edited = run_cli(sweep, tmp_path)
    assert edited.returncode == 0, edited.stderr[-2000:]
    assert "skipped, the identical config FINISHED" not in edited.stdout
    reasons = [line for line in edited.stdout.splitlines() if "runs again" in line]
    assert len(reasons) == 2, edited.stdout
    assert all("with other code (model.target.sha256: " in line for line in reasons), reasons
    children = [r for r in all_runs(store_uri) if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
    table = results_table(edited.stdout)
    assert "earlier" not in table
