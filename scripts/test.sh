#!/usr/bin/env bash
# Set up .venv with the dev extras if needed, then lint, check the import layers and the types
# (mypy), build the docs site strictly and run the whole test suite (slow end-to-end tests
# included; CUDA tests skip themselves without a GPU) in three worker processes. Extra
# arguments go to pytest, e.g.
#   scripts/test.sh -m "not slow" -x        scripts/test.sh -n 0 tests/unit/engine/test_loop.py
# It fails when pytest collects no test at all (exit 5), and when a test wrote into the
# checkout (every test runs in a temporary folder of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh dev,cluster,fp8,timm,hf  # so the fp8, timm and transformers tests run too
.venv/bin/ruff check src tests scripts examples
.venv/bin/ruff format --check src tests scripts examples
.venv/bin/lint-imports  # the package's layers and no import cycles (pyproject.toml)
.venv/bin/mypy  # types (pyproject's [tool.mypy])
# The docs site, strictly (a broken link or anchor, a missing page, a docstring mkdocstrings
# cannot read fails), into a temporary folder: nothing is written into the checkout.
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"

# Python caches the bytecode of the checkout's modules (src/, tests/) under __pycache__/
# (git-ignored), even where the environment says not to (PYTHONDONTWRITEBYTECODE): each
# ampsweep process the suite starts would otherwise compile them again. Most commands run in
# the test's own process; a test starts a real `python -m ampsweep` where the process boundary
# is what it tests (signals, a kill and resume, DDP ranks, SLURM jobs, servers, start-up).
unset PYTHONDONTWRITEBYTECODE

stamp="$(mktemp)"
trap 'rm -f "$stamp"' EXIT
# Three workers, on CI's two cores too: with two, a core sat idle whenever a test waited (a
# locked store's 20 s timeouts, SLURM's scheduler, a server's start-up); with three the CPUs
# stay busy and the suite took 7 min 30 s twice against 7 min 49 s to 8 min 29 s with two
# (docs/benchmarks.md). The "loadgroup" keeps tests that share a session fixture, such as the
# three-mode sweep, on one worker.
status=0
.venv/bin/python -m pytest -n 3 --dist loadgroup "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "test.sh: error: pytest collected no tests (exit 5): check the arguments" >&2
fi
written="$(find . \( -path ./.venv -o -path ./.git -o -name __pycache__ -o -name .pytest_cache \
    -o -name .ruff_cache -o -name '*.egg-info' \) -prune -o -type f -newer "$stamp" -print)"
if [ -n "$written" ]; then
    echo "test.sh: error: files were written into the checkout while the tests ran:" >&2
    echo "$written" | head -n 20 >&2
    [ "$status" -ne 0 ] || status=1
fi
exit "$status"
