"""The repeats page's example keeps its promise: after ``sweep.repeats=3``, a sweep of the
same config over ``trainer.seed=0,1,2,3,4`` finds seeds 0-2 finished and trains only 3 and 4;
``trainer.seed=10 sweep.repeats=3`` trains seeds 10, 11 and 12. Its commands are read from
the page, as tests/e2e/test_commands_as_written.py runs them."""

from __future__ import annotations

import shlex

from docs_blocks import REPO, blocks, commands

from ampsweep.report import sweeps
from ampsweep.tracking import store


def _run(main, line: str, extra: list[str]):
    words = shlex.split(line, comments=True)
    assert words[:2] == ["ampsweep", "train"]
    result = main(*words[1:], *extra)
    assert result.code == 0, result.err
    return result


def test_the_repeats_example_reuses_the_seeds_it_promises(store_uri, main):
    (block, *_) = blocks(REPO / "docs" / "repeats.md")
    first, given, offset = commands(block.code)
    extra = [*block.overrides, f"tracking.uri={store_uri}"]
    client = store.client_for(store_uri)

    def newest_sweep():
        parent, _ = sweeps.find_sweep(client)
        kids = store.children(client, parent)
        seeds = sorted((k.data.params["trainer.seed"], k.data.tags[store.PRECISION]) for k in kids)
        return parent, seeds

    _run(main, first, extra)
    _, seeds = newest_sweep()
    assert seeds == sorted((s, m) for s in "012" for m in ("fp32", "bf16"))

    said = _run(main, given, extra)
    parent, seeds = newest_sweep()
    assert seeds == sorted((s, m) for s in "34" for m in ("fp32", "bf16"))  # trained here
    assert len(store.skipped_jobs(parent)) == 6  # seeds 0-2 of both modes: found finished
    assert said.err.count("skipped") >= 6 or said.out.count("skipped") >= 6

    _run(main, offset, extra)
    _, seeds = newest_sweep()
    assert seeds == sorted((s, m) for s in ("10", "11", "12") for m in ("fp32", "bf16"))
