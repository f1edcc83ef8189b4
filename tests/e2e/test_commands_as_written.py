"""The docs' commands as a new user types them: every runnable block of README.md and docs/
runs (tests/docs_blocks.py says how), and a few commands whose output the docs describe are
checked closely (relative config paths, run folders named as documented, no resume line before
a refusal; the one error line of a DDP config error is tests/e2e/test_ddp.py's)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import docs_blocks
import pytest
from docs_blocks import REPO, Session

from ampsweep.cli import main as cli
from ampsweep.tracking import store as mlflow_store

# ---------------------------------------------------------------- every block of the docs


@pytest.mark.slow
@pytest.mark.parametrize("page", docs_blocks.pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_of_the_page_runs(page, tmp_path, empty_store, capsys):
    found = docs_blocks.blocks(page)
    runnable = [b for b in found if b.skip is None]
    if not runnable:
        reasons = sorted({b.skip for b in found}) or ["no shell or Python block"]
        pytest.skip("; ".join(reasons))
    session = Session(tmp_path, empty_store, lambda: "".join(capsys.readouterr()))
    for block in runnable:
        session.run(block)


def test_every_block_is_run_or_skipped_with_a_reason():
    found = [b for page in docs_blocks.pages() for b in docs_blocks.blocks(page)]
    assert len(found) > 40  # the collector sees the docs' blocks (README alone has 4)
    assert all(b.skip is None or b.skip.strip() for b in found)
    # every page of the site is collected, and so is every block a page has
    for page in docs_blocks.pages():
        fences = page.read_text().count("```bash") + page.read_text().count("```python")
        assert len(docs_blocks.blocks(page)) >= fences, page


def test_a_broken_block_fails_naming_its_page_and_line(tmp_path, empty_store, capsys):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- run: trainer.max_steps=2 -->\n```bash\n"
        "ampsweep train --cfg job            # prints the config: fine\n"
        "ampsweep train trainer.epoch=3      # a typo\n```\n"
    )
    (block,) = docs_blocks.blocks(page)
    assert block.overrides == ["trainer.max_steps=2"] and block.line == 4
    session = Session(tmp_path / "run", empty_store, lambda: "".join(capsys.readouterr()))
    with pytest.raises(
        AssertionError, match=r"page.md:4: ampsweep train trainer.epoch=3 .*exited 2"
    ):
        session.run(block)


def test_markers_and_pip_lines(tmp_path, empty_store, capsys):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- skip: needs a GPU -->\n```bash\nampsweep train trainer.device=cuda\n```\n\n"
        "<!-- cwd: examples/shapes -->\n```sh\npip install -e '.[timm,fp8]'\n"
        "pip install 'ampsweep[gpu]'\n```\n\n```yaml\nnot: collected\n```\n"
    )
    skipped, pip = docs_blocks.blocks(page)
    assert skipped.skip == "needs a GPU" and pip.cwd == "examples/shapes"
    session = Session(tmp_path / "run", empty_store, lambda: "".join(capsys.readouterr()))
    with pytest.raises(AssertionError, match=r"no such extra \['gpu'\]"):
        session.run(pip)


# ---------------------------------------------------------------- commands checked closely


def _runs(store: str):
    client = mlflow_store.client_for(store)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.slow
def test_run_folder_is_time_mode_model_data_and_a_relative_config_path_reruns_it(
    tmp_path, store, quick, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "precision=fp32", "model=mlp", f"tracking.uri={store}", *quick]) == 0
    (run,) = _runs(store)
    run_dir = Path(run.data.tags["run_dir"])
    assert re.fullmatch(r"\d\d-\d\d-\d\d-fp32-mlp-digits", run_dir.name), run_dir.name
    assert run_dir.parent.parent == (tmp_path / "outputs" / "runs").resolve()
    # The .hydra form of the README, with the path relative to where the user is.
    relative = run_dir.relative_to(tmp_path) / ".hydra"
    capsys.readouterr()
    args = ["train", "--config-path", str(relative), "--config-name", "config"]
    handlers = list(logging.getLogger().handlers)
    assert cli.main([*args, "tracking.run_name=again"]) == 0
    again = next(r for r in _runs(store) if r.info.run_name == "again")
    assert again.data.metrics["val/loss"] == run.data.metrics["val/loss"]  # the same config
    # with ampsweep's run settings, not Hydra's defaults (outputs/<date>/<time>/, a log file,
    # a console handler)
    rerun_dir = Path(again.data.tags["run_dir"])
    assert rerun_dir.parent.parent == run_dir.parent.parent, rerun_dir
    assert re.fullmatch(r"\d\d-\d\d-\d\d-fp32-mlp-digits", rerun_dir.name), rerun_dir.name
    assert list(tmp_path.rglob("*.log")) == []
    assert logging.getLogger().handlers == handlers
    # a group option of ampsweep's, added to the saved config with + (it has no defaults list)
    assert cli.main([*args, "+precision=bf16", "tracking.run_name=bf16"]) == 0
    bf16 = next(r for r in _runs(store) if r.info.run_name == "bf16")
    assert bf16.data.tags["precision"] == "bf16"


@pytest.mark.slow
def test_resume_refused_before_saying_it_resumes(tmp_path, store, quick, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = ["train", f"tracking.uri={store}", *quick, "trainer.checkpoint_every=2"]
    assert cli.main([*base, "trainer.max_steps=4"]) == 0
    (ckpt,) = (tmp_path / "outputs" / "checkpoints").glob("*/*/step-*-end.pt")
    capsys.readouterr()
    # Another config (a different lr) cannot continue that checkpoint.
    assert cli.main([*base, "optimizer.lr=0.01", f"trainer.resume={ckpt}"]) == 2
    out, err = capsys.readouterr()
    assert "resuming from" not in out
    assert "was written by a different config" in err or "nothing to resume" in err


@pytest.mark.slow
def test_reproduce_says_what_it_does_without_a_download_bar(
    tmp_path, store, quick, capsys, monkeypatch
):
    from mlflow.environment_variables import MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR
    from mlflow.utils import file_utils

    # MLflow draws a download bar (with tqdm, where installed) whenever this variable says so
    # at the moment a transfer starts: record what it said for each transfer.
    drawn = []
    original = file_utils.ArtifactProgressBar.__init__

    def spy(self, *args, **kwargs):
        drawn.append(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR.get())
        original(self, *args, **kwargs)

    assert cli.main(["train", "model=mlp", f"tracking.uri={store}", *quick]) == 0
    (run,) = _runs(store)
    capsys.readouterr()
    monkeypatch.setattr(file_utils.ArtifactProgressBar, "__init__", spy)
    assert cli.main(["reproduce", run.info.run_id, f"tracking.uri={store}"]) == 0
    out, _ = capsys.readouterr()
    assert f"reproducing run {run.info.run_id}" in out
    assert drawn and not any(drawn)  # the config was downloaded, and without a bar
