#!/usr/bin/env bash
# What the docs show of a real run, made by a real run: the demo's sweep
# (experiment=precision_sweep) in a temporary folder with its own MLflow store. Copies the
# report's charts from the sweep's parent run into docs/assets/ and writes everything the
# sweep printed to docs/assets/demo_report.txt, headed by the machine (lscpu's model name,
# cores), the date and the versions. The README's report excerpt is copied from that file.
# Extra arguments are Hydra overrides for the sweep, e.g. scripts/docs_assets.sh trainer.epochs=3
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_venv.sh
root="$(pwd)"
assets="$root/docs/assets"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$assets"

cpu="$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)"
flags="$(grep -o -w -E 'avx512_bf16|avx512_fp16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ' || true)"
versions="$("$root/.venv/bin/python" -c 'import torch, mlflow, ampsweep; print(f"torch {torch.__version__}, mlflow {mlflow.__version__}, ampsweep {ampsweep.__version__}")')"
start=$(date +%s)
status=0
(cd "$work" && "$root/.venv/bin/ampsweep" train -m experiment=precision_sweep trainer.progress=false "$@") \
    > "$work/printed.txt" 2>&1 || status=$?
{
    echo "# ampsweep train -m experiment=precision_sweep trainer.progress=false $*"
    echo "# machine: ${cpu:-unknown CPU} ($(nproc) cores${flags:+; $flags}), $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "# $versions; the sweep took $(($(date +%s) - start)) s (exit $status)"
    cat "$work/printed.txt"
} > "$assets/demo_report.txt"

charts="$(find "$work/outputs/mlartifacts" -path '*/artifacts/charts/*.png' | sort)"
if [ -z "$charts" ]; then
    echo "docs_assets: error: the sweep logged no charts (exit $status): see $assets/demo_report.txt" >&2
    exit 1
fi
for png in $charts; do
    cp "$png" "$assets/demo_$(basename "$png")"
done
echo "docs_assets: wrote $assets/demo_report.txt and $(echo "$charts" | wc -l) charts (exit $status)"
exit "$status"
