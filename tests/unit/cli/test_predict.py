"""ampsweep predict: each mode's step on a named GPU, from one step traced on this machine."""

import json

import pytest

from ampsweep.measure.prediction import HELPS


def test_the_default_cnn_is_called_launch_bound_never_a_speedup(main):
    """The default cnn on digits at batch 64: tiny kernels, on an H100 each at its launch
    floor; no mode may be sold as a speed-up."""
    result = main("predict", "--gpu", "h100", "--format", "json")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["predicted"] and out["gpu"]["label"] == "H100 SXM"
    assert out["config"] == {"model": "cnn", "dataset": "digits", "batch_size": 64}
    verdict = out["verdict"]
    assert verdict.startswith("no mode is predicted to help this model on an H100 SXM: its GEMMs")
    assert "launch-bound" in verdict or "memory-bound" in verdict
    for name, mode in out["modes"].items():
        assert mode["speedup_vs_fp32"] < HELPS, name
        assert mode["shares"]["launch"] > 0.5, name
    fp32 = out["modes"]["fp32"]
    assert fp32["speedup_vs_fp32"] == 1.0 and fp32["step_ms"] > 0
    layers = {row["name"]: row for row in fp32["layers"]}
    assert "(optimizer)" in layers and "(loss)" in layers
    assert sum(row["gflop"] for row in fp32["layers"]) > 0
    assert sum(row["ms"] for row in fp32["layers"]) == pytest.approx(fp32["step_ms"])


def test_the_gpt_is_predicted_to_gain_from_half_precision_with_fp8_layers_named(main):
    result = main("predict", "--gpu", "h100", "model=gpt", "dataset=pysource")
    assert result.code == 0, result.err
    assert "Predicted" in result.out and "not measured" in result.out
    assert "is predicted the fastest on an H100 SXM" in result.out
    result = main("predict", "--gpu", "H100", "--format", "json", "model=gpt", "dataset=pysource")
    modes = json.loads(result.out)["modes"]
    assert modes["bf16"]["speedup_vs_fp32"] > HELPS
    assert modes["tf32"]["speedup_vs_tf32"] == 1.0 and modes["tf32"]["speedup_vs_fp32"] > 1
    fp8 = {row["name"] for row in modes["fp8_tensorwise"]["layers"] if row["fp8"]}
    assert "blocks.0.mlp.0" in fp8 and "head" not in fp8  # the last layer stays in bf16
    # its 128-wide Linear layers are too small for fp8's casts to pay
    assert modes["fp8_tensorwise"]["step_ms"] > modes["bf16"]["step_ms"]
    # fp8's per-layer filter and the mode table time each Linear's bf16 matmuls alike
    table = {row["name"]: row for row in modes["bf16"]["layers"]}
    advice = json.loads(result.out)["fp8_filter"]["fp8_tensorwise"]["layers"]
    judged = [row for row in advice if row["bf16_s"] is not None]
    assert judged
    for row in judged:
        assert row["bf16_s"] * 1e3 == pytest.approx(table[row["name"]]["math_ms"]), row["name"]


def test_a_gpu_without_fp8_says_which_modes_it_cannot_run(main, tmp_path):
    spec = tmp_path / "old.yaml"
    spec.write_text("label: Old GPU\nfp32: 20\ntf32: 150\nfp16: 300\nbf16: 300\n"
                    "bandwidth: 1.5\nsms: 100\n")  # fmt: skip
    result = main("predict", "--gpu-spec", str(spec), "--format", "json")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["gpu"]["label"] == "Old GPU" and "fp8_rowwise" not in out["modes"]
    assert out["cannot_run"]["fp8_rowwise"] == "the Old GPU has no fp8 tensor cores"


def test_an_unknown_gpu_is_one_line_and_exit_2(main):
    result = main("predict", "--gpu", "h1000")
    assert result.code == 2 and result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "--gpu h1000" in lines[0] and "h100, " in lines[0]


def test_a_precision_override_is_refused_every_mode_is_predicted(main):
    result = main("predict", "precision=bf16")
    assert result.code == 2 and "precision=bf16" in result.err and "every" in result.err


@pytest.mark.slow
@pytest.mark.xdist_group("three_mode_sweep")
def test_the_report_carries_the_prediction_for_the_gpu_named(three_mode_sweep, main):
    """report --gpu: the baseline run's model and batch (its recorded overrides: the cnn,
    8 wide) predicted on an H100, labelled as predicted, among the findings."""
    args = ("report", "--format", "json", "--tracking-uri", three_mode_sweep.uri)
    result = main(*args, "--gpu", "h100")
    assert result.code == 0, result.err
    findings = json.loads(result.out)["findings"]
    (predicted,) = [f for f in findings if f.startswith("Predicted, not measured")]
    assert predicted.startswith(
        "Predicted, not measured (ampsweep predict --gpu h100): no mode is predicted to help "
        "this model on an H100 SXM"
    )
    plain = json.loads(main(*args).out)["findings"]
    assert not [f for f in plain if f.startswith("Predicted")]  # only when asked
    unknown = main(*args, "--gpu", "h1000")
    assert unknown.code == 2 and "--gpu h1000: not a GPU ampsweep knows" in unknown.err


def test_a_hugging_face_model_that_reads_a_tensor_is_predicted_in_both_fp8_modes(main):
    """Its packed-sequence check calls .item(), which the meta device refuses: fp8's plan is
    traced on the CPU instead."""
    pytest.importorskip("transformers")
    hf = ["model=hf_causal_lm", "dataset=pysource", "dataset.max_bytes=20000",
          "dataset.seq_len=32", "model.hidden_size=32", "model.num_attention_heads=2"]  # fmt: skip
    result = main("predict", "--gpu", "h100", "--format", "json", *hf)
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["cannot_run"] == {}
    fp8 = [row for row in out["modes"]["fp8_rowwise"]["layers"] if row["fp8"]]
    assert any(row["name"].endswith("mlp.up_proj") for row in fp8)
    assert set(out["fp8_filter"]) == {"fp8_tensorwise", "fp8_rowwise"}
