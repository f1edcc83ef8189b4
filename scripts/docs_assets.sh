#!/usr/bin/env bash
# What the docs show of a real run, made by a real run: the demo's sweep
# (experiment=precision_sweep) in a temporary folder with its own MLflow store. Copies the
# report's charts from the sweep's parent run into docs/assets/ and writes everything the
# sweep printed to docs/assets/demo_report.txt, headed by the machine (lscpu's model name,
# cores), the date and the versions. The README's report excerpt is copied from that file.
# Where chromium is installed, it then serves the store with ampsweep ui and takes a
# screenshot of the sweep's page in MLflow's UI (docs/assets/demo_ui_sweep.png).
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

if command -v chromium >/dev/null; then
    port="$("$root/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    (cd "$work" && exec "$root/.venv/bin/ampsweep" ui --port "$port") > "$work/ui.txt" 2>&1 &
    ui=$!
    for _ in $(seq 120); do grep -q "newest sweep" "$work/ui.txt" && break; sleep 1; done
    # The newest sweep's page: the link ampsweep ui prints after "newest sweep ...: "
    link="$(sed -n 's/.*newest sweep [^ ]*: //p' "$work/ui.txt" | head -n 1)"
    if [ -n "$link" ]; then
        chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-sync \
            --disable-background-networking --disable-component-update \
            --user-data-dir="$work/chromium" --window-size=1400,900 --virtual-time-budget=15000 \
            --screenshot="$assets/demo_ui_sweep.png" "$link" > "$work/chromium.txt" 2>&1 \
            && echo "docs_assets: wrote $assets/demo_ui_sweep.png" \
            || echo "docs_assets: note: chromium took no screenshot (see above)" >&2
    else
        echo "docs_assets: note: ampsweep ui printed no sweep link: $(tail -n 3 "$work/ui.txt")" >&2
    fi
    kill -INT "$ui" 2>/dev/null || true
    wait "$ui" 2>/dev/null || true
fi
exit "$status"
