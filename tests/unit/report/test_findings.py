"""report/findings.py: the report's plain-language findings on known numbers, every wording
branch: one or several model/data groups, accuracy held, dropped or rose, no baseline, the
CPU and old-GPU hardware notes, and the gradient-underflow finding."""

from __future__ import annotations

from ampsweep.report import sweeps
from unit.report.test_sweeps import CPU, CUDA, run


def findings_of(runs, baseline: str = "fp32") -> str:
    return "\n".join(sweeps.make_report({"run_id": "p", "name": "s"}, runs, baseline).findings)


def test_findings_on_cpu_name_fastest_savings_accuracy_and_where_speedups_belong():
    runs = [
        run("fp32", acc=0.986, sps=5000.0, act=4.62),
        run("fp16", acc=0.984, sps=1000.0, act=2.58, skipped=2.0, scale=16384.0),
        run("fp16_noscale", acc=0.90, sps=1100.0, act=2.58, underflow=0.125),
        run("bf16", acc=0.989, sps=2500.0, act=2.31),
        run("tf32", status="FAILED", error="precision=tf32 needs a CUDA GPU"),
    ]
    rep = sweeps.make_report({"run_id": "p", "name": "s"}, runs)
    text = "\n".join(rep.findings)
    assert rep.findings[0] == "Device: cpu (x86_64, 2 threads, torch 2.14.1)."
    assert "Fastest here: fp32 at 5,000 samples/s" in text
    assert "bf16 0.50x" in text and "fp16 0.20x" in text
    assert "Most activation memory saved: bf16, 2.31 MiB per step vs 4.62 MiB for fp32" in text
    assert "(0.50x, 50% less)" in text
    assert "Accuracy held within 1.5 points of fp32's 0.986: fp16 0.984, bf16 0.989." in text
    assert "Accuracy dropped for fp16_noscale: 0.900 (-8.6 points vs fp32)." in text
    assert "fp16 without loss scaling (fp16_noscale) reached 0.900 (-8.6 points vs fp32)" in text
    assert "(12.5% of this run's gradient values did)" in text
    assert "fp16 skipped 2 step(s), final scale 16384" in text
    assert "no tensor cores" in text and "belong to GPUs" in text
    assert "tf32-cnn-digits ended FAILED: precision=tf32 needs a CUDA GPU." in text


def test_findings_on_a_gpu_name_the_speedup_and_peak_memory():
    runs = [
        run("fp32", device=CUDA, acc=0.95, sps=1000.0, act=40.0, peak=4000.0),
        run("bf16", device=CUDA, acc=0.951, sps=3100.0, act=20.0, peak=2400.0),
    ]
    rep = sweeps.make_report({"run_id": "p"}, runs)
    text = "\n".join(rep.findings)
    assert "Device: cuda (NVIDIA H200, compute capability 9.0)." in text
    assert "Fastest here: bf16, 3.10x the fp32 throughput (3,100 samples/s)." in text
    assert "Lowest peak GPU memory: bf16, 2,400 MiB (0.60x fp32)." in text
    assert "belong to GPUs" not in text


def test_underflow_diagnostics_become_a_finding_with_their_numbers():
    runs = [
        run("fp32", acc=0.975, underflow=0.25),
        run("fp16_noscale", acc=0.47, underflow=0.2),
        run("fp16", acc=0.975, underflow=0.25, scale=65536.0),
    ]
    runs[1].metrics["amp/grad_flushed_frac"] = 0.3
    runs[2].metrics["amp/grad_underflow_frac_scaled"] = 0.001
    text = "\n".join(sweeps.make_report({"run_id": "p", "name": "s"}, runs).findings)
    assert "Gradient underflow: fp16 without loss scaling would flush 25" in text
    assert "measured in fp32" in text
    assert "The fp16_noscale run actually lost 30" in text


def test_a_cpu_with_native_bf16_is_named_in_the_hardware_finding():
    cpu = {**CPU, "cpu_half_isa": "avx512_bf16"}
    runs = [
        run("fp32", acc=0.98, sps=100.0, device=cpu),
        run("bf16", acc=0.98, sps=120.0, device=cpu),
    ]
    text = "\n".join(sweeps.make_report({"run_id": "p", "name": "s"}, runs).findings)
    assert "native half-precision instructions avx512_bf16" in text
    assert "bf16 1.20x" in text and "belong to GPUs" in text


def test_no_memory_saving_is_not_reported_as_one():
    runs = [run("fp32", acc=0.97, act=0.144), run("fp16", acc=0.97, act=0.203, scale=65536.0)]
    text = "\n".join(sweeps.make_report({"run_id": "p", "name": "s"}, runs).findings)
    assert "Most activation memory saved" not in text
    assert "No mode saved activation memory: the least is fp16 with 0.20 MiB" in text


def test_several_model_and_data_groups_are_named_in_each_finding():
    runs = [
        run("fp32", model="cnn", acc=0.98, sps=1000.0, act=4.0),
        run("bf16", model="cnn", acc=0.98, sps=800.0, act=2.0),
        run("fp32", model="mlp", acc=0.95, sps=3000.0, act=1.0),
        run("bf16", model="mlp", acc=0.90, sps=2000.0, act=0.5),
    ]
    text = findings_of(runs)
    assert "Fastest here (cnn on digits): fp32 at 1,000 samples/s" in text
    assert "Fastest here (mlp on digits): fp32 at 3,000 samples/s" in text
    assert "Most activation memory saved (cnn on digits): bf16, 2.00 MiB" in text
    assert "Accuracy held (cnn on digits) within 1.5 points of fp32's 0.980: bf16 0.980." in text
    assert "Accuracy dropped (mlp on digits) for bf16: 0.900 (-5.0 points vs fp32)." in text


def test_one_group_names_no_group():
    text = findings_of([run("fp32", acc=0.98, sps=1.0), run("bf16", acc=0.98, sps=2.0)])
    assert "(cnn on digits)" not in text
    assert "Fastest here: bf16, 2.00x the fp32 throughput (2 samples/s)." in text


def test_accuracy_that_rose_is_called_noise():
    text = findings_of([run("fp32", acc=0.95, sps=1.0), run("bf16", acc=0.99, sps=1.0)])
    assert (
        "Accuracy rose for bf16: 0.990 (+4.0 points vs fp32; at this run length that is noise, "
        "not a gain)." in text
    )
    assert "Accuracy held" not in text and "Accuracy dropped" not in text


def test_runs_without_a_baseline_are_named():
    text = findings_of([run("bf16", acc=0.9, sps=1.0), run("fp16", acc=0.9, sps=1.0)])
    assert (
        "No fp32 baseline for 2 run(s) (bf16-cnn-digits, fp16-cnn-digits): their config differs "
        "from every baseline run beyond precision, so their comparisons are blank." in text
    )
    assert "Fastest here" not in text  # nothing to compare with


def test_another_baseline_mode_is_named_in_the_findings():
    runs = [run("fp32", acc=0.9, sps=100.0), run("bf16", acc=0.9, sps=300.0)]
    text = findings_of(runs, baseline="bf16")
    assert "Fastest here: bf16 at 300 samples/s; every other mode is slower" in text
    assert "(throughput relative to bf16: fp32 0.33x)" in text


def test_a_gpu_without_tensor_cores_says_so():
    pascal = {**CUDA, "device_name": "Tesla P100", "compute_capability": "6.0"}
    runs = [run("fp32", device=pascal, sps=100.0), run("fp16", device=pascal, sps=150.0)]
    text = findings_of(runs)
    assert (
        "This GPU (compute capability 6.0) has no tensor cores, so half precision mostly saves "
        "memory and bandwidth here (fp16 1.50x); tensor-core GPUs (7.0+) gain more speed." in text
    )


def test_a_gpu_without_native_bf16_says_bf16_is_emulated():
    turing = {**CUDA, "device_name": "Tesla T4", "compute_capability": "7.5"}
    runs = [run("fp32", device=turing, sps=100.0), run("bf16", device=turing, sps=90.0)]
    text = findings_of(runs)
    assert "This GPU (compute capability 7.5) has no native bf16: bf16 modes are emulated." in text
    only_fp16 = findings_of(
        [run("fp32", device=turing, sps=1.0), run("fp16", device=turing, sps=2.0)]
    )
    assert "emulated" not in only_fp16 and "no tensor cores" not in only_fp16


def test_a_modern_gpu_gets_no_hardware_caveat():
    runs = [run("fp32", device=CUDA, sps=100.0), run("bf16", device=CUDA, sps=300.0)]
    text = findings_of(runs)
    assert "no tensor cores" not in text and "emulated" not in text


def test_a_run_that_ended_without_an_error_says_so():
    text = findings_of([run("fp32", acc=0.9), run("bf16", status="KILLED")])
    assert "bf16-cnn-digits ended KILLED: no error recorded." in text


def test_the_scaled_fp16_rows_beside_fp16_without_scaling_are_named_by_their_setting():
    runs = [
        run("fp32", acc=0.986, sps=5000.0, act=4.62),
        run("fp16_noscale", acc=0.90, sps=1100.0, act=2.58),
        run("fp16", acc=0.984, sps=1000.0, act=2.58, skipped=2.0, scale=16384.0),
        run("fp16", acc=0.985, sps=990.0, act=2.60, skipped=0.0, scale=65536.0),
    ]
    runs[3].run_id += "-kept"  # the doctor's fp16 with fc2 kept in fp32
    for r in runs:
        r.params["precision.keep_fp32"] = "['fc2']" if r is runs[3] else "[]"
    text = findings_of(runs)
    assert "fp16 skipped 2 step(s), final scale 16384; " in text
    assert "fp16 (keep_fp32=['fc2']) skipped 0 step(s), final scale 65536." in text
