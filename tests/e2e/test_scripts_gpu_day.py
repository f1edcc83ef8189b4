"""scripts/gpu_day.sh, dry-run on the CPU: every step runs, the final table holds each headline
figure read from the recorded runs, and $OUT holds no more than a GPU machine sends back (at
most 8 files of under 16 MiB each, with plain names)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile

import pytest
from conftest import REPO, all_runs, cli_env

from ampsweep.tracking import store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(920)]

HEADLINES = [
    "ResNet-50 samples/s: fp32 / tf32 / fp16 / bf16",
    "ResNet-50 fp16 vs tf32 (samples/s)",
    "ResNet-50 bf16 vs tf32 (samples/s)",
    "ResNet-50 fp16 vs fp32 (samples/s)",
    "ResNet-50 bf16 vs fp32 (samples/s)",
    "ViT-B/16 bf16 MFU (compiled)",
    "ViT-B/16 fp8_tensorwise vs bf16 (compiled)",
    "ResNet-18 fp32 largest batch: predicted vs measured",
    "ResNet-18 fp16 largest batch: predicted vs measured",
    "ResNet-18 bf16 largest batch: predicted vs measured",
    "ResNet-18 bf16 step peak saved vs fp32",
    "ResNet-18 fp32 step peak at a larger batch: predicted vs measured",
    "ResNet-18 bf16 step peak at a larger batch: predicted vs measured",
    "Precision doctor, overflow_net: every prescription proved",
    "pytest -m gpu",
]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``AMPSWEEP_DRYRUN=1 scripts/gpu_day.sh`` with OUT in a temporary folder, run once,
    with this interpreter as PYTHON (which the scripts run every command with)."""
    out = tmp_path_factory.mktemp("gpu_day_out")
    env = cli_env({"AMPSWEEP_DRYRUN": "1", "OUT": str(out), "PYTHON": sys.executable})
    proc = subprocess.run([str(REPO / "scripts" / "gpu_day.sh")], cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return out, proc.stdout


def table_rows(text: str) -> dict[str, list[str]]:
    """The rows of the last headline table in ``text``: figure -> [measured, target, verdict]."""
    table = text[text.rindex("## gpu_day headline figures") :]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "figure":
            rows[cells[0]] = cells[1:]
    return rows


def test_the_run_ends_with_the_headline_table_marked_as_a_dry_run(dry_run):
    out, stdout = dry_run
    tail = stdout[stdout.rindex("## gpu_day headline figures") :]
    assert "DRY RUN" in tail.splitlines()[0]
    rows = table_rows(stdout)
    assert list(rows) == HEADLINES
    assert (out / "summary.md").read_text() in stdout  # the table printed is the one kept
    for step in ("install", "pytest_gpu", "gpu_check", "gpu_bench", "doctor"):
        assert f"- {step}: ok," in tail


def test_the_figures_are_read_from_the_recorded_runs(dry_run, tmp_path):
    out, stdout = dry_run
    rows = table_rows(stdout)
    with tarfile.open(out / "gpu_day.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    uri = f"sqlite:///{tmp_path / 'work' / 'outputs' / 'mlflow.db'}"
    runs = all_runs(uri)

    def recorded(model, mode):
        (run,) = [r for r in runs if r.data.tags.get("model") == model
                  and r.data.tags.get("precision") == mode
                  and "perf/samples_per_s" in r.data.metrics]  # fmt: skip
        return run.data.metrics

    fp32, bf16 = recorded("resnet50", "fp32"), recorded("resnet50", "bf16")
    measured = rows["ResNet-50 samples/s: fp32 / tf32 / fp16 / bf16"][0]
    assert (
        measured == f"{fp32['perf/samples_per_s']:,.0f} / - / - / {bf16['perf/samples_per_s']:,.0f}"
    )
    ratio = bf16["perf/samples_per_s"] / fp32["perf/samples_per_s"]
    speedup, target, verdict = rows["ResNet-50 bf16 vs fp32 (samples/s)"]
    assert speedup == f"{ratio:.2f}x" and target == ">= 3.00x"
    assert verdict == ("met" if ratio >= 3 else "MISSED")
    # What a CPU cannot measure says why, instead of a number.
    assert (
        rows["ResNet-50 bf16 vs tf32 (samples/s)"][0] == "not measured: no tf32 run in the dry run"
    )
    assert rows["ViT-B/16 bf16 MFU (compiled)"][0] == "not measured: no MFU on a CPU"
    assert "emulated" in rows["ViT-B/16 fp8_tensorwise vs bf16 (compiled)"][0]
    # Capacity: the prediction the capacity run recorded; the search needs CUDA.
    (cap_fp32,) = [r for r in runs if r.data.tags.get("ampsweep.capacity") == "true"
                   and r.data.tags.get("precision") == "fp32"]  # fmt: skip
    predicted = cap_fp32.data.metrics["mem/max_batch_predicted"]
    assert rows["ResNet-18 fp32 largest batch: predicted vs measured"][0] == (
        f"{predicted:,.0f} predicted (the search needs CUDA)"
    )
    # A step's peak: bf16's against fp32's in gpu_check's sweep; at the larger batch of the
    # memory sweep, predicted from the smaller, with the error its report gave (in the log).
    experiments = {e.name: e.experiment_id for e in store.client_for(uri).search_experiments()}

    def peak(experiment, mode, batch=None):
        (run,) = [r for r in runs if r.info.experiment_id == experiments[experiment]
                  and r.data.tags.get("precision") == mode
                  and batch in (None, r.data.params.get("trainer.batch_size"))]  # fmt: skip
        return run.data.metrics["mem/step_peak_mib"]

    fp32_peak, bf16_peak = peak("gpu_check", "fp32"), peak("gpu_check", "bf16")
    saved = 1 - bf16_peak / fp32_peak
    assert rows["ResNet-18 bf16 step peak saved vs fp32"] == [
        f"{100 * saved:.0f}% ({bf16_peak:,.0f} vs {fp32_peak:,.0f} MiB)",
        ">= 35%",
        "met" if saved >= 0.35 else "MISSED",
    ]
    for mode in ("fp32", "bf16"):
        (said,) = re.findall(rf"{mode}'s step peak predicted from its batch-4 run: batch 8: "
                             r"predicted [^(]*\(([+-][\d.]+)%\)", stdout)  # fmt: skip
        measured, target, verdict = rows[
            f"ResNet-18 {mode} step peak at a larger batch: predicted vs measured"
        ]
        large = peak("gpu_check_memory", mode, "8")
        assert measured.startswith("batch 8 from 4: ") and f" vs {large:,.1f} MiB" in measured
        assert measured.endswith(f"({said}%)") and target == "within 10%"
        assert verdict == ("met" if abs(float(said)) <= 10 else "MISSED")
    assert rows["Precision doctor, overflow_net: every prescription proved"][1:] == ["yes", "met"]
    assert re.fullmatch(r"\d+ skipped, \d+ deselected in [\d.]+s",
                        rows["pytest -m gpu"][0])  # fmt: skip


def test_out_holds_a_few_small_files_and_the_packed_runs(dry_run, tmp_path):
    out, _ = dry_run
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == [
        "gpu_day.log", "gpu_day.tar.gz", "headline.json", "summary.md"
    ]  # fmt: skip
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    assert all(p.stat().st_size < 16 * 1024**2 for p in files)
    with tarfile.open(out / "gpu_day.tar.gz") as tar:
        names = tar.getnames()
    for step in ("install", "pytest_gpu", "gpu_check", "gpu_bench", "doctor", "table"):
        assert f"work/logs/{step}.log" in names
    assert "work/outputs/mlflow.db" in names
    assert "work/reports/gpu_bench_vit_fp8_vs_bf16.json" in names
    assert "work/doctor/conf/experiment/doctor.yaml" in names  # the doctor's prescriptions
    assert not [n for n in names if n.endswith(".pt")]  # checkpoints stay behind
