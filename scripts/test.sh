#!/usr/bin/env bash
# Set up .venv with the dev extras if needed, then lint, check the import layers and run the
# whole test suite (slow end-to-end tests included; CUDA tests skip themselves without a GPU).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not slow" -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh dev,cluster,fp8,timm,hf  # so the fp8, timm and transformers tests run too
.venv/bin/ruff check src tests scripts examples
.venv/bin/ruff format --check src tests scripts examples
.venv/bin/lint-imports  # the package's layers and no import cycles (pyproject.toml)
exec .venv/bin/python -m pytest "$@"
