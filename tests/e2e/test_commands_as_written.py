"""The docs' commands as a new user types them: every runnable block of README.md and docs/
runs (tests/docs_blocks.py says how) and keeps what its page claims of it
(tests/docs_claims.py); a few commands whose output the docs describe are checked closely here
(relative config paths, run folders named as documented, no resume line before a refusal; the
one error line of a DDP config error is tests/e2e/test_ddp.py's)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import docs_blocks
import docs_claims
import pytest
from docs_blocks import REPO, Session
from docs_claims import Outcome

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


# ---------------------------------------------------------------- what the docs claim


def test_claims_are_read_below_a_block_and_a_mistyped_one_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run: trainer.max_steps=2 -->\n```bash\nampsweep train -m precision=fp32,bf16\n"
        "ampsweep report\n```\n"
        '<!-- expect 1: trains precision.name=fp32,bf16 -->\n<!-- expect: prints "2 runs" -->\n'
        "<!-- expect all: exit 0 -->\n\n<!-- output -->\n```text\nSweep ...\n```\n"
    )
    block, shown = docs_blocks.blocks(page)
    assert [(c.which, c.kind) for c in block.claims] == [
        ("1", "trains"),
        ("last", "prints"),
        ("all", "exit"),
    ]
    assert [c.about(2, 2) for c in block.claims] == [False, True, True]
    assert shown.kind == "output" and shown.code == "Sweep ...\n"
    page.write_text('```bash\nampsweep report\n```\n<!-- expect: says "2 runs" -->\n')
    with pytest.raises(ValueError, match=r"page.md:4: not a claim: 'says \"2 runs\"'"):
        docs_blocks.blocks(page)
    # a claim no command would check
    page.write_text("```bash\nampsweep report\n```\n<!-- expect 2: exit 2 -->\n")
    with pytest.raises(ValueError, match=r"page.md:1: expect 2: the block has 1 command"):
        docs_blocks.blocks(page)
    page.write_text("<!-- skip: a GPU -->\n```bash\nampsweep report\n```\n<!-- expect: exit 2 -->")
    with pytest.raises(ValueError, match=r"page.md:2: 'exit 2': a claim on a block not run"):
        docs_blocks.blocks(page)


def _session(tmp_path, empty_store, capsys, text: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    page = tmp_path / "page.md"
    page.write_text(text)
    session = Session(tmp_path / "run", empty_store, lambda: "".join(capsys.readouterr()))
    return session, docs_blocks.blocks(page)


CLAIMED = (
    "```bash\nampsweep train --cfg job precision=fp16\nampsweep train trainer.epoch=3\n```\n"
    '<!-- expect 1: prints "  name: fp16" -->\n<!-- expect 2: exit 2 -->\n'
    "<!-- expect 2: records nothing -->\n"
)


def test_a_claim_the_command_keeps_passes_and_one_it_breaks_fails(tmp_path, empty_store, capsys):
    session, (block,) = _session(tmp_path, empty_store, capsys, CLAIMED)
    session.run(block)  # the config printed, the typo refused with exit 2, nothing recorded
    broken = CLAIMED.replace("name: fp16", "name: bf16")
    session, (block,) = _session(tmp_path / "b", empty_store, capsys, broken)
    with pytest.raises(AssertionError, match=r"page.md:1: ampsweep train --cfg job precision=fp16"):
        session.run(block)
    broken = CLAIMED.replace("exit 2", "exit 1")
    session, (block,) = _session(tmp_path / "c", empty_store, capsys, broken)
    with pytest.raises(AssertionError, match=r"trainer.epoch=3: exited 2, not 1"):
        session.run(block)


TRANSCRIPT = (
    "```text\n$ ampsweep train trainer.epoch=3\n"
    "error: trainer.epoch=3: unknown key 'epoch': did you mean trainer.epochs?; valid keys ...\n"
    "```\n<!-- expect all: exit 2 -->\n\n<!-- output -->\n```text\n"
    "error: trainer.epoch=3: unknown key 'epoch': ...\n```\n"
)


def test_a_transcript_runs_its_commands_and_an_output_block_is_checked(
    tmp_path, empty_store, capsys
):
    session, (transcript, shown) = _session(tmp_path, empty_store, capsys, TRANSCRIPT)
    assert transcript.kind == "transcript" and shown.kind == "output"
    session.run(transcript)
    session.run(shown)
    session, (transcript, shown) = _session(
        tmp_path / "b", empty_store, capsys, TRANSCRIPT.replace("key 'epoch'", "key 'epok'")
    )
    with pytest.raises(AssertionError, match=r"the page shows \"error: .*'epok'.*\" after it"):
        session.run(transcript)
    with pytest.raises(AssertionError, match=r"page.md:8: the output shown has .*'epok'"):
        session.run(shown)


def test_an_output_matches_in_order_with_any_numbers_and_any_text_for_dots():
    output = (
        "fp32: val/acc 0.5292\n  bf16: FAILED: diverged (stopped at step 30)\n"
        " fp16   keep_fp32=['fc2']   FINISHED    0.5320      +0.3      43,816\n"
    )
    shown = "fp32: val/acc 0.61\n...\nfp16 keep_fp32=['fc2'] FINISHED 0.5 -1.2 9,999\n"
    assert docs_claims.missing_line(shown, output, numbers=True) is None
    assert docs_claims.missing_line("bf16: FAILED: ... step 12)\n", output, True) is None
    # a name is not a number, and the order counts
    assert docs_claims.missing_line("keep_fp32=['fc3']\n", output, True) == "keep_fp32=['fc3']"
    shuffled = "bf16: FAILED\nfp32: val/acc 1\n"
    assert docs_claims.missing_line(shuffled, output, True) == "fp32: val/acc 1"
    # a quote of a file keeps its numbers
    assert docs_claims.missing_line("fp32: val/acc 0.61\n", output, False) == "fp32: val/acc 0.61"


def test_a_file_the_docs_quote_holds_what_they_quote():
    quoted = [b for p in docs_blocks.pages() for b in docs_blocks.blocks(p) if b.quotes]
    assert any(b.page.name == "README.md" for b in quoted)  # the demo's report
    for block in quoted:
        docs_blocks.check_shown(block, printed="")


def _run(seed: str, sweep: bool = False):
    tags = {"ampsweep.sweep": "true"} if sweep else {}
    return SimpleNamespace(data=SimpleNamespace(tags=tags, params={"trainer.seed": seed}))


def _check(claim: str, outcome: Outcome) -> str | None:
    return docs_claims.check(docs_claims.parse(f"<!-- expect: {claim} -->"), outcome)


def test_the_claims_on_runs_output_and_files(tmp_path):
    done = Outcome("ampsweep train -m", 0, "#0 a: skipped\n#1 b: skipped\n", tmp_path)
    done.runs = [_run("3"), _run("4"), _run("3"), _run("0", sweep=True)]
    assert _check("trains trainer.seed=3,4", done) is None  # the sweep's parent left out
    assert _check("trains trainer.seed=3,4,5", done) == "its runs have trainer.seed=3,4"
    assert _check("records nothing", done) == "it recorded 4 run(s)"
    assert _check('prints 2 lines ": skipped"', done) is None
    assert _check('prints 3 lines ": skipped"', done) == "2 line(s) of its output say it"
    assert _check('prints no "skipped"', done) == "2 line(s) of its output say it"
    assert _check("writes conf/experiment/doctor.yaml", done) == (
        "conf/experiment/doctor.yaml does not exist"
    )
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "doctor.yaml").write_text("{}")
    assert _check("writes conf/experiment/doctor.yaml", done) is None
