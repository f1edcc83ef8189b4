#!/usr/bin/env bash
# The first GPU run in one command, on a machine with a CUDA GPU and no network, from the
# checkout's root with .whl/ in it (scripts/gpu_wheelhouse.sh, run beforehand where there is
# network): a venv over the image's own torch with the wheelhouse installed offline, then in
# order, each under its own time limit: the CUDA tests (pytest -m gpu), scripts/gpu_check.sh,
# scripts/gpu_bench.sh --headline, and the precision doctor on examples/doctor's overflow_net,
# every run recorded in one MLflow store. It ends with one table: the headline figures against
# their targets, read from the reports of the recorded sweeps and from the store.
# What it writes under $OUT (default outputs/gpu_day), four files however far it got:
# gpu_day.log (all it printed), summary.md (each step's outcome and the table), headline.json
# (the same as data) and gpu_day.tar.gz (each step's log, the store, the reports as JSON, the
# doctor's folder; no checkpoints), packed again after every step, so that a run cut short
# still brings back the runs it finished.
#   scripts/gpu_day.sh                      # on the GPU machine (an H200: under 9 minutes)
#   AMPSWEEP_DRYRUN=1 scripts/gpu_day.sh    # every step on this CPU, tiny, with the checkout's
#                                           # .venv instead of a new venv (2-3 minutes on 2
#                                           # idle cores)
set -uo pipefail  # no -e: a step that fails is recorded, and the next one runs
repo="$(cd "$(dirname "$0")/.." && pwd)"
self="$repo/scripts/gpu_day.sh"
dry="${AMPSWEEP_DRYRUN:-0}"

if [ "${1:-}" = --make-venv ]; then
  # --make-venv VENV: a venv over the image's packages, with the wheelhouse installed offline.
  venv=$2
  unset PYTHONPATH  # the checkout's src/ may hold a stale egg-info that pip would take as ampsweep
  base=${PYTHON:-python3}
  "$base" -m venv --without-pip --system-site-packages "$venv" || exit
  # The image's python3 may itself be a venv, whose packages (torch among them) a venv made
  # from it does not see: a .pth file puts them after the new venv's own. pip is the image's.
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$base" -c 'import sys, sysconfig
if sys.prefix != sys.base_prefix:
    print(sysconfig.get_paths()["purelib"]); print(sysconfig.get_paths()["platlib"])' \
    >"$site/_image_packages.pth" || exit
  pip=("$venv/bin/python" -m pip install -q --no-index --no-cache-dir --find-links "$repo/.whl")
  if ! "${pip[@]}" "ampsweep[fp8,cluster]"; then
    # A carried package whose requirement excludes the version of an image package (pip check
    # below names it) still installs without the resolver; the image's version is what runs.
    echo "gpu_day: the resolver refused (above); installing every wheel with --no-deps"
    "${pip[@]}" --no-deps "$repo"/.whl/*.whl || exit
  fi
  "$venv/bin/python" -m pip check || echo "gpu_day: pip check (above) is for information"
  exit 0
fi

if [ "${1:-}" = --table ]; then
  # --table WORK OUT: the reports of the recorded sweeps as JSON, then the headline table from
  # them and from the store, into OUT/summary.md and OUT/headline.json.
  work=$2 out=$3 PY=${PYTHON:-python3}
  while read -r experiment baseline; do  # at once: each is mostly its process's start
    { "$PY" -m ampsweep report --format json --experiment "$experiment" --baseline "$baseline" \
        >"$work/reports/${experiment}_vs_$baseline.json" \
        || echo "gpu_day: no report of $experiment against $baseline"; } &
  done <<'LIST'
gpu_check fp32
gpu_bench_resnet50 fp32
gpu_bench_resnet50 tf32
gpu_bench_vit_fp8 bf16
LIST
  wait
  exec "$PY" - "$work" "$dry" "$out" <<'PYEOF'
import json
import re
import subprocess
import sys
from pathlib import Path

from ampsweep.measure import capacity as cap
from ampsweep.report.memory import BATCH
from ampsweep.tracking import store

work, dry, out = Path(sys.argv[1]), sys.argv[2] == "1", Path(sys.argv[3])
steps = {}
for line in (work / "steps.tsv").read_text().splitlines():
    name, status, seconds = line.split("\t")
    steps[name] = (status, int(seconds))
table = []  # (figure, measured, target, verdict)


def report(experiment, baseline):
    try:
        return json.loads((work / "reports" / f"{experiment}_vs_{baseline}.json").read_text())
    except (OSError, ValueError):
        return None


def run_of(rep, mode):
    """The finished run of ``mode`` in a report, or None."""
    for r in (rep or {}).get("rows", []):
        if r["precision"] == mode and r["status"] == "FINISHED":
            return r
    return None


def add(figure, value, target, met, step, why):
    """A row; without a value, why it is missing: the step's outcome when it was not ok."""
    if value is None:
        status = steps.get(step, ("not run",))[0]
        value = f"not measured: {why}" if status == "ok" else f"not measured: {step} {status}"
        verdict = "-"
    else:
        verdict = "info" if met is None else ("met" if met else "MISSED")
    table.append((figure, value, target, verdict))


# ResNet-50, uncompiled: samples/s, and each AMP mode against TF32 and fp32.
r50 = {base: report("gpu_bench_resnet50", base) for base in ("fp32", "tf32")}
runs = [run_of(r50["fp32"], m) for m in ("fp32", "tf32", "fp16", "bf16")]
add(
    "ResNet-50 samples/s: fp32 / tf32 / fp16 / bf16",
    " / ".join("-" if r is None else f"{r['samples_per_s']:,.0f}" for r in runs)
    if any(runs)
    else None,
    "A100 (NVIDIA's): TF32 938, AMP 2,470",
    None,
    "gpu_bench",
    "no run",
)
for base, goal in (("tf32", 2.0), ("fp32", 3.0)):
    for mode in ("fp16", "bf16"):
        r = run_of(r50[base], mode)
        x = None if r is None else r.get("speedup")
        why = f"no {mode} run" if r is None else f"no {base} run"
        add(
            f"ResNet-50 {mode} vs {base} (samples/s)",
            None if x is None else f"{x:.2f}x",
            f">= {goal:.2f}x",
            None if x is None else x >= goal,
            "gpu_bench",
            why + (" in the dry run" if dry else ""),
        )

# ViT-B/16, compiled: bf16's MFU, and fp8 against bf16.
vit = report("gpu_bench_vit_fp8", "bf16")
r = run_of(vit, "bf16")
mfu = None if r is None else r.get("mfu")
add(
    "ViT-B/16 bf16 MFU (compiled)",
    None if mfu is None else f"{100 * mfu:.1f}%",
    ">= 40%",
    None if mfu is None else mfu >= 0.40,
    "gpu_bench",
    "no MFU on a CPU" if dry else "no MFU (this GPU has no peak in measure/cost.py)",
)
r = run_of(vit, "fp8_tensorwise")
emulated = bool(r and r.get("emulated"))
x = None if r is None or emulated else r.get("speedup")
add(
    "ViT-B/16 fp8_tensorwise vs bf16 (compiled)",
    None if x is None else f"{x:.2f}x",
    "> 1.00x",
    None if x is None else x > 1.0,
    "gpu_bench",
    "emulated fp8 (its speed means nothing)" if emulated else "no run",
)

# Capacity (gpu_check's ResNet-18 on 32x32): the prediction against the search.
client = store.client_for(store.resolve_uri(None))
exp = client.get_experiment_by_name("gpu_check_capacity")
found = (
    []
    if exp is None
    else client.search_runs(
        [exp.experiment_id], f"tags.`{store.CAPACITY}` = 'true'", order_by=["start_time ASC"]
    )
)
latest = {run.data.tags.get(store.PRECISION): run.data.metrics for run in found}
for mode in ("fp32", "fp16", "bf16"):
    m = latest.get(mode, {})
    predicted, measured = m.get(cap.MAX_BATCH_PREDICTED), m.get(cap.MAX_BATCH_MEASURED)
    err = cap.error_pct(predicted, measured)
    figure = f"ResNet-18 {mode} largest batch: predicted vs measured"
    if err is not None:
        add(
            figure,
            f"{predicted:,.0f} vs {measured:,.0f} ({err:+.1f}%)",
            "within 15%",
            abs(err) <= 15.0,
            "gpu_check",
            "",
        )
    elif predicted is not None:
        searched = "the search needs CUDA" if dry else "no search result"
        add(figure, f"{predicted:,.0f} predicted ({searched})", "within 15%", None, "gpu_check", "")
    else:
        add(
            figure,
            None,
            "within 15%",
            None,
            "gpu_check",
            "no capacity run of this mode" + (" in the dry run" if dry else ""),
        )

# A training step's peak on gpu_check's ResNet-18: what bf16 saved of fp32's (at batch 256 the
# activations, which autocast halves, are most of fp32's peak: the target leaves room for what
# stays fp32), then each mode's peak at the larger batch predicted from the smaller batch's run
# (Breakdown.at, as the sweep's report checks it) against that batch's.
checked = [run_of(report("gpu_check", "fp32"), mode) for mode in ("fp32", "bf16")]
peaks = [(r.get("memory") or {}).get("step_peak_mib") if r else None for r in checked]
saved = None if None in peaks else 1 - peaks[1] / peaks[0]
add(
    "ResNet-18 bf16 step peak saved vs fp32",
    None if saved is None else f"{100 * saved:.0f}% ({peaks[1]:,.0f} vs {peaks[0]:,.0f} MiB)",
    ">= 35%",
    None if saved is None else saved >= 0.35,
    "gpu_check",
    "no step peak of fp32 and bf16",
)
exp = client.get_experiment_by_name("gpu_check_memory")
ids, finished = [] if exp is None else [exp.experiment_id], "attributes.status = 'FINISHED'"
found = client.search_runs(ids, finished, order_by=["start_time ASC"]) if ids else []
by_batch = {}  # mode -> {batch: its breakdown}, of the latest finished run at each batch
for run in found:
    mode, batch = run.data.tags.get(store.PRECISION), run.data.params.get(BATCH, "")
    bd = batch.isdigit() and cap.breakdown(run.data.metrics, mode, int(batch))
    if bd and cap.STEP_PEAK in run.data.metrics:
        by_batch.setdefault(mode, {})[bd.batch] = bd
for mode in ("fp32", "bf16"):
    sizes = [bd for _, bd in sorted(by_batch.get(mode, {}).items())]
    small, large = (sizes[0], sizes[-1]) if len(sizes) > 1 else (None, None)
    predicted = None if small is None else small.at(large.batch).total
    err = None if small is None else cap.error_pct(predicted, large.total)
    add(
        f"ResNet-18 {mode} step peak at a larger batch: predicted vs measured",
        None
        if err is None
        else f"batch {large.batch} from {small.batch}: {predicted:,.1f} vs {large.total:,.1f} MiB"
        f" ({err:+.1f}%)",
        "within 10%",
        None if err is None else abs(err) <= 10.0,
        "gpu_check",
        "no runs of this mode at two batch sizes",
    )

# The doctor proves its prescriptions (exit 0); the CUDA tests pass.
status = steps.get("doctor", ("not run",))[0]
add(
    "Precision doctor, overflow_net: every prescription proved",
    "yes" if status == "ok" else status,
    "yes",
    status == "ok",
    "doctor",
    "",
)
log = work / "logs" / "pytest_gpu.log"
counts = re.compile(r"\d+ (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b.* in ")
summary = [
    ln.strip("= ")
    for ln in (log.read_text().splitlines() if log.exists() else [])
    if counts.search(ln)
]
add(
    "pytest -m gpu",
    summary[-1] if summary else None,
    "no failure",
    bool(summary) and not re.search(r"failed|error", summary[-1]),
    "pytest_gpu",
    "no summary line",
)

dev = next((rep["device"] for rep in (*r50.values(), vit) if rep), {})
where = f"{dev.get('device_name') or dev.get('device', '?')}, torch {dev.get('torch_version', '?')}"


# Predicted against measured: ampsweep predict's step time of each ResNet-50 mode on this GPU
# (an H100 in the dry run, whose CPU times it cannot predict), from the fp32 run's own overrides,
# beside the step time each mode's run measured.
BOUNDS = ("compute", "memory", "launch")


def predicted_rows():
    base = run_of(r50["fp32"], "fp32")
    if base is None:
        return "no ResNet-50 fp32 run to take the configuration from", []
    tags = client.get_run(base["run_id"]).data.tags
    dropped = ("precision", "tracking", "hydra", "trainer.callbacks")
    overrides = [o for o in tags.get(store.OVERRIDES, "").split()
                 if not o.lstrip("+~").split("=")[0].startswith(dropped)]  # fmt: skip
    gpu = "h100" if dry else dev.get("device_name", "?")
    cmd = [sys.executable, "-m", "ampsweep", "predict", "--gpu", gpu, "--format", "json"]
    done = subprocess.run([*cmd, *overrides], capture_output=True, text=True)
    if done.returncode != 0:
        return f"no prediction: {(done.stderr.strip().splitlines() or ['?'])[-1]}", []
    predicted = json.loads(done.stdout)
    rows = []
    for mode in ("fp32", "tf32", "fp16", "bf16"):
        guess = predicted["modes"].get(mode)
        run = run_of(r50["fp32"], mode)
        measured = None if run is None else run.get("step_ms")
        err = cap.error_pct(guess and guess["step_ms"], measured)
        rows.append((
            mode,
            "-" if guess is None else f"{guess['step_ms']:.2f}",
            "-" if measured is None else f"{measured:.2f}",
            "-" if err is None else f"{err:+.0f}%",
            "-" if guess is None else max(BOUNDS, key=lambda b: guess["shares"].get(b, 0.0)),
        ))  # fmt: skip
    return predicted["verdict"], rows


said, predicted = predicted_rows()
title = f"gpu_day headline figures ({where})"
if dry:
    title += ": DRY RUN on the CPU, tiny sizes, the numbers mean nothing"
heads = ("figure", "measured", "target", "verdict")
widths = [max(len(str(c)) for c in col) for col in zip(heads, *table, strict=True)]
lines = [
    f"| {' | '.join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))} |"
    for cells in (heads, *table)
]
lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
done = [f"- {name}: {status}, {seconds} s" for name, (status, seconds) in steps.items()]
heads5 = ("ResNet-50 mode", "predicted step ms", "measured step ms", "error", "predicted bound")
versus = [f"| {' | '.join(cells)} |" for cells in (heads5, *predicted)]
versus.insert(1, "|" + "---|" * len(heads5))
if dry:
    said += " (dry run: predicted for an H100, measured on this CPU: the error means nothing)"
versus = ["", "### Predicted (ampsweep predict) against measured", "", said, "", *versus]
summary = [f"## {title}", "", *lines, "", "Steps:", *done, *(versus if predicted else versus[:4])]
(out / "summary.md").write_text("\n".join([*summary, ""]))
(out / "headline.json").write_text(
    json.dumps(
        {
            "dry_run": dry,
            "device": dev,
            "steps": steps,
            "table": [dict(zip(heads, cells, strict=True)) for cells in table],
            "predicted": [dict(zip(heads5, cells, strict=True)) for cells in predicted],
        },
        indent=1,
    )
)
PYEOF
fi

out="${OUT:-$repo/outputs/gpu_day}"
mkdir -p "$out"
rm -f "$out"/{gpu_day.log,summary.md,headline.json,gpu_day.tar.gz,.gpu_day.tar.gz.part}
exec > >(tee "$out/gpu_day.log") 2>&1
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
work="$tmp/work"  # what is packed
mkdir -p "$work/logs" "$work/reports"
: >"$work/steps.tsv"
export MLFLOW_TRACKING_URI="sqlite:///$work/outputs/mlflow.db"  # one store for every step
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's code, as the scripts
export PYTHONUNBUFFERED=1

# Each step's time limit in seconds, estimated for an H200 (nothing here has been timed on one
# yet): their sum is 565 s, under 10 minutes with the packing, where a command may run 10. The
# table's step builds ResNet-50 once more, for its prediction (ampsweep predict). A
# step past its limit is stopped (killed 10 s later if it goes on), and the next one runs.
# Compiling is most of the time of the two steps that compile: the fp8 tests' small ViT (in 4
# processes at once) and gpu_bench's ViT-B/16 in bf16 and fp8_tensorwise, each compiled for
# training and again for the evaluation.
declare -A LIMIT=([install]=45 [pytest_gpu]=70 [gpu_check]=105 [gpu_bench]=250 [doctor]=35
                  [table]=60)
# The dry run's steps are tiny, but this CPU starts a process several times slower.
scale=1 device=cuda
[ "$dry" != 1 ] || scale=3 device=cpu
# Every training run: no model artifact (hundreds of MB a run in the packed store, and seconds).
runs=(tracking.log_model=false)

pack() {
  tar -czf "$out/.gpu_day.tar.gz.part" -C "$tmp" --exclude='*.pt' --exclude=checkpoints work \
    && mv "$out/.gpu_day.tar.gz.part" "$out/gpu_day.tar.gz"
}

# step NAME COMMAND...: COMMAND under NAME's time limit, its output in logs/NAME.log too and
# its outcome in steps.tsv; then everything so far is packed.
step() {
  local name=$1 limit=$((LIMIT[$1] * scale)) t0=$SECONDS rc status
  shift
  echo
  echo "=== gpu_day: $name (limit $limit s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$work/logs/$name.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124 | 137) status="stopped at its $limit s limit" ;;
    *) status="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$work/steps.tsv"
  echo "=== gpu_day: $name: $status, $((SECONDS - t0)) s"
  pack
}

if [ "$dry" = 1 ]; then
  echo "gpu_day: DRY RUN on the CPU with the checkout's .venv (tiny sizes; numbers mean nothing)"
  if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
  elif [ -x "$repo/.venv/bin/python" ]; then PY=$repo/.venv/bin/python
  else PY=python3; fi
  step install "$PY" -c "import ampsweep, hydra, mlflow, omegaconf, torch
print('gpu_day: ampsweep', ampsweep.__version__, 'with torch', torch.__version__)"
else
  [ -d "$repo/.whl" ] || echo "gpu_day: no .whl/ in the checkout: run scripts/gpu_wheelhouse.sh" \
    "where there is network, and carry .whl with the checkout"
  step install "$self" --make-venv "$tmp/venv"
  PY="$tmp/venv/bin/python"
  [ -x "$PY" ] || PY=${PYTHON:-python3}
  "$PY" -c "import torch; print('gpu_day: torch', torch.__version__, 'CUDA', torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'but NO CUDA DEVICE')"
fi
export PYTHON="$PY"  # the interpreter of gpu_check.sh, gpu_bench.sh and the table

# Only the test files that hold CUDA tests: collecting the whole suite costs more than they run.
# Four processes on the GPU: the fp8 tests compile (the dry run's tests all skip).
mapfile -t gpu_tests < <(grep -rl --include="test_*.py" "pytest.mark.gpu" "$repo"/tests)
workers=(-n 4)
[ "$dry" != 1 ] || workers=()
step pytest_gpu env -C "$work" "$PY" -m pytest -p no:cacheprovider --basetemp "$work/pytest" \
  -q "${workers[@]}" -m gpu "${gpu_tests[@]}"
# One epoch (64 steps a mode, 10 of them warm-up) leaves the time to the capacity search.
check=(trainer.epochs=1)
[ "$dry" != 1 ] || check=()
step gpu_check env -C "$work" "$repo/scripts/gpu_check.sh" "${check[@]}" "${runs[@]}"
step gpu_bench env -C "$work" "$repo/scripts/gpu_bench.sh" --headline "${runs[@]}"
# A copy of the example project: the doctor writes its prescriptions into its conf/.
cp -r "$repo/examples/doctor" "$work/doctor"
rm -rf "$work/doctor/outputs" "$work/doctor/conf/experiment" "$work/doctor/conf/precision"
step doctor env -C "$work/doctor" "$PY" -m ampsweep doctor --verify --config-dir conf \
  --modes fp16,bf16 model=overflow_net trainer.max_steps=60 "trainer.device=$device" "${runs[@]}"
# The table is a step of its own: a store too slow to read still leaves the packed runs.
step table "$self" --table "$work" "$out"

echo
cat "$out/summary.md" 2>/dev/null || echo "gpu_day: no table (the table step failed: above)"
# Exit 1 when a step was not ok (summary.md lists each step's outcome).
! awk -F'\t' '$2 != "ok" { bad = 1 } END { exit !bad }' "$work/steps.tsv"
