#!/usr/bin/env bash
# Create .venv (if missing) and install ampsweep into it with the given extras, only when
# pyproject.toml or the extras changed since the last install: re-running is cheap.
# Usage: scripts/setup_venv.sh [EXTRAS]   e.g. scripts/setup_venv.sh dev,cluster
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "ampsweep: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
stamp=".venv/.ampsweep-install"  # "<pyproject hash> <extras installed>"
hash="$(sha256sum pyproject.toml | cut -c1-16)"
have_hash="" have_extras=""
[ -f "$stamp" ] && read -r have_hash have_extras <"$stamp"
satisfied=false
if [ "${have_hash:-}" = "$hash" ]; then
    satisfied=true  # every extra asked for must already be installed
    for e in ${extras//,/ }; do
        [[ ",${have_extras:-}," == *",$e,"* ]] || satisfied=false
    done
fi
if [ "$satisfied" = false ]; then
    mkdir -p outputs
    log="outputs/pip-install.log"
    echo "ampsweep: installing $spec into .venv (torch is large: a few minutes the first time; log: $log)"
    if ! .venv/bin/python -m pip install --disable-pip-version-check -e "$spec" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" | tail -n 30 >&2
        echo "ampsweep: installation failed; see $log" >&2
        exit 1
    fi
    echo "$hash $extras" >"$stamp"
fi
