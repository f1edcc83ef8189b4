#!/usr/bin/env bash
# Serve the documentation site locally (mkdocs serve: http://127.0.0.1:8000, rebuilt on every
# save), after setting up .venv with the dev extras if needed. Extra arguments go to mkdocs
# serve, e.g. scripts/docs.sh --dev-addr 127.0.0.1:8001. scripts/test.sh builds it strictly.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh dev
NO_MKDOCS_2_WARNING=1 exec .venv/bin/mkdocs serve "$@"
