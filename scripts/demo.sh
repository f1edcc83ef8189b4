#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone: set up .venv if needed, sweep the
# portable precision modes (fp32, fp16, fp16_static, fp16_noscale, bf16, bf16_pure) on the
# bundled digits data into a local SQLite MLflow store (outputs/mlflow.db), print the
# comparison report, and say how to browse it all in the MLflow UI.
# Extra arguments are Hydra overrides for the sweep, e.g. scripts/demo.sh trainer.epochs=3
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh
start=$(date +%s)
status=0
.venv/bin/ampsweep train -m experiment=precision_sweep "$@" || status=$?
echo
echo "demo: sweep finished in $(($(date +%s) - start)) s (exit $status); every run is in $(pwd)/outputs/mlflow.db"
echo "demo: browse it with:  .venv/bin/ampsweep ui    (then open the URL it prints)"
exit "$status"
