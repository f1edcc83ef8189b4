"""report/numerics.py: the findings of what went wrong numerically, on constructed runs: where
a run's first inf/NaN began and its fix (said once for a module several runs name), an
unhealthy loss scale (collapsed, skipping, never growing; nothing for a healthy one), the
numerics probe's verdicts once per configuration, a pure run's lost updates, and how repeats
keep these facts."""

from __future__ import annotations

import csv
import io

import pytest
from rich.console import Console

from ampsweep.report import numerics, render, sweeps
from ampsweep.report.model import RunData

CPU = {"device": "cpu", "device_name": "x86_64", "cpu_threads": "2", "torch_version": "2.14.1"}
WHERE = (
    "step 6: the first non-finite value was the weight gradient of layer4.0.conv1 (Conv2d) "
    "(layer4.0.conv1.weight), with finite input and output gradient: a backward kernel of this "
    "device produced it"
)
FIX = "precision.keep_fp32=[layer4.0.conv1]"
# A probe that finds fp16's forward pass overflowing, gradients fp16 loses, updates bf16 loses
TROUBLED = {
    "numerics/fp16_forward_headroom_log2": -1.48,
    "numerics/fp16_grad_underflow_frac": 0.125,
    "numerics/suggested_init_scale": 1024.0,
    "numerics/fp16_grad_underflow_frac_at_scale": 0.0001,
    "numerics/bf16_update_lost_frac": 0.37,
    "numerics/fp16_update_lost_frac": 0.01,
}
TROUBLED_TAGS = {
    "numerics.fp16_overflow": "amplify=1.83e+05,blocks.1.attn=7.1e+04",
    "numerics.update_lost_layers": "fc1.weight=1.00,fc2.weight=0.42,fc3.weight=0.10,head=0.05",
}
# A probe that finds nothing wrong
HEALTHY = {
    "numerics/fp16_forward_headroom_log2": 9.3,
    "numerics/fp16_grad_underflow_frac": 0.0,
    "numerics/suggested_init_scale": 65536.0,
    "numerics/fp16_grad_underflow_frac_at_scale": 0.0,
    "numerics/bf16_update_lost_frac": 0.002,
    "numerics/fp16_update_lost_frac": 0.0001,
}


def run(
    mode, *, seed=0, job=0, lr="0.001", status="FINISHED", tags=None, params=None, history=None,
    **metrics,
) -> RunData:  # fmt: skip
    """A run of ``mode`` on cnn/digits; ``metrics`` by their logged names, ``/`` as ``__``."""
    return RunData(
        run_id=f"{mode}-{seed}-{lr}",
        name=f"{mode}-cnn-digits" + (f"-{job}" if job else ""),
        status=status,
        params={
            "precision.name": mode,
            "model.name": "cnn",
            "optimizer.lr": lr,
            "trainer.seed": str(seed),
            "precision.scaler.min_scale": "1.0",
            "precision.scaler.growth_interval": "2000",
            "precision.scaler.dynamic": "null",
            **(params or {}),
        },
        tags={
            "precision": mode,
            "model": "cnn",
            "dataset": "digits",
            "job_num": str(job),
            **CPU,
            **(tags or {}),
        },  # fmt: skip
        metrics={k.replace("__", "/"): v for k, v in metrics.items()},
        history={"amp/loss_scale": history} if history else {},
    )


def origin(module="layer4.0.conv1", where=WHERE, fix=FIX, kind="weight_grad") -> dict[str, str]:
    return {
        "numerics.nonfinite_step": "6",
        "numerics.nonfinite_kind": kind,
        "numerics.nonfinite_module": module,
        "numerics.nonfinite_where": where,
        "numerics.nonfinite_fix": fix,
    }


def report(runs):
    return sweeps.make_report({"run_id": "p", "name": "s"}, runs)


def numeric_findings(runs) -> list[str]:
    return numerics.findings(report(runs).summary)


def about(found: list[str], name: str) -> list[str]:
    return [f for f in found if f.startswith(name + ":") or f.startswith(name + " (")]


# ---------------------------------------------------------------- where inf/NaN began


def test_a_run_with_a_nonfinite_step_says_where_it_began_and_the_fix():
    runs = [
        run("fp32", val__acc=0.9),
        run(
            "bf16", tags=origin(), val__acc=0.9, train__steps=200.0, numerics__nonfinite_steps=3.0
        ),  # fmt: skip
    ]
    (text,) = about(numeric_findings(runs), "bf16-cnn-digits")
    assert text == (f"bf16-cnn-digits: {WHERE}; fix: {FIX}. 3 of its 200 steps were non-finite.")
    assert text in report(runs).findings  # the report's findings carry it


def test_a_failed_run_says_its_failure_began_there():
    diverged = origin(where="step 9: the first non-finite value was the fp16 output of amplify")
    runs = [
        run("fp16", status="FAILED", tags={**diverged, "diverged": "true"}),
        run("bf16", status="FAILED", tags=origin(module="", kind="loss", fix="check the loss")),
    ]
    found = numeric_findings(runs)
    (fp16,) = about(found, "fp16-cnn-digits")
    assert "fp16 output of amplify; fix: precision.keep_fp32=[layer4.0.conv1]." in fp16
    assert fp16.endswith("Its divergence began there.")
    (bf16,) = about(found, "bf16-cnn-digits")
    assert bf16.endswith("; fix: check the loss. Its failure began there.")


def test_a_module_several_runs_name_is_said_once_with_their_names():
    runs = [
        run("fp16", tags=origin()),
        run("bf16", status="FAILED", tags={**origin(), "diverged": "true"}),
        run("fp32", tags=origin(module="fc", where="step 2: fc", fix="precision.keep_fp32=[fc]")),
    ]
    found = numeric_findings(runs)
    shared = [f for f in found if "layer4.0.conv1" in f]
    assert len(shared) == 1
    assert shared[0].startswith(
        "2 runs first went non-finite in layer4.0.conv1 (fp16-cnn-digits, bf16-cnn-digits); "
        f"fp16-cnn-digits: {WHERE}; fix: {FIX}."
    )
    assert shared[0].endswith("The failure of bf16-cnn-digits (diverged) began there.")
    assert "fp32-cnn-digits: step 2: fc; fix: precision.keep_fp32=[fc]." in found


def test_runs_that_name_one_module_with_different_fixes_get_each_fix_by_name():
    runs = [
        run("fp16", tags=origin(fix=f"{FIX}, or precision=bf16 (fp32's range)")),
        run("bf16", tags=origin()),
    ]
    (text,) = numeric_findings(runs)
    assert (
        f"fix: {FIX}, or precision=bf16 (fp32's range) (fp16-cnn-digits); {FIX} (bf16-cnn-digits)."
        in text
    )


# ---------------------------------------------------------------- the loss scale


def test_a_scale_that_collapsed_to_its_minimum_names_where_the_overflow_began():
    runs = [
        run(
            "fp16", tags=origin(), amp__loss_scale=1.0, amp__skipped_steps=140.0, train__steps=200.0
        ),  # fmt: skip
        run(
            "fp16", lr="0.01", amp__loss_scale=0.5, amp__skipped_steps=150.0, train__steps=200.0
        ),  # fmt: skip
    ]
    found = numerics.scale_findings(report(runs).summary)
    assert found == [
        "fp16-cnn-digits: the loss scale collapsed to 1, at "
        "precision.scaler.min_scale=1 (140 of 200 steps skipped): the gradients overflow fp16 "
        f"at every scale, beginning in layer4.0.conv1; fix: {FIX}.",
        "fp16-cnn-digits: the loss scale collapsed to 2^-1, below "
        "precision.scaler.min_scale=1 (150 of 200 steps skipped): the gradients overflow fp16 "
        "at every scale; fix: precision=bf16 (fp32's range).",
    ]


def test_a_scaler_that_skips_more_than_one_step_in_20_says_so_with_the_fix():
    runs = [
        run("fp16_static", amp__loss_scale=65536.0, amp__skipped_steps=40.0, train__steps=200.0),
        run(
            "fp16",
            tags=origin(),
            amp__loss_scale=4096.0,
            amp__skipped_steps=30.0,
            train__steps=200.0,
            history=[(10, 4096.0), (200, 8192.0)],
        ),  # fmt: skip
    ]
    found = numerics.scale_findings(report(runs).summary)
    assert found == [
        "fp16_static-cnn-digits: the scaler skipped 40 of 200 steps (20%, more than 5%), each "
        "one's update thrown away on an overflow; fix: precision.scaler.dynamic=true, or a "
        "lower precision.scaler.init_scale.",
        "fp16-cnn-digits: the scaler skipped 30 of 200 steps (15%, more than 5%), each one's "
        f"update thrown away on an overflow, beginning in layer4.0.conv1; fix: {FIX}.",
    ]


def test_a_dynamic_scale_that_never_grew_over_more_than_its_growth_interval_says_so():
    flat = [(3000, 32768.0), (10, 32768.0), (1500, 16384.0)]  # MLflow's order is not the steps'
    runs = [run("fp16", amp__loss_scale=32768.0, amp__skipped_steps=4.0, train__steps=3000.0,
                history=flat)]  # fmt: skip
    (text,) = numerics.scale_findings(report(runs).summary)
    assert text.startswith(
        "fp16-cnn-digits: the dynamic loss scale never grew above its first logged value 32768 "
        "in 3000 steps, though it grows after precision.scaler.growth_interval=2000 steps "
        "without an overflow: an overflow came at least that often (4 of 3000 steps skipped)"
    )
    shorter = [run("fp16", amp__loss_scale=32768.0, amp__skipped_steps=4.0, train__steps=1500.0,
                   history=flat)]  # fmt: skip
    assert numerics.scale_findings(report(shorter).summary) == []
    fixed = [run("fp16_static", amp__loss_scale=32768.0, amp__skipped_steps=4.0,
                 train__steps=3000.0, history=flat)]  # fmt: skip
    assert numerics.scale_findings(report(fixed).summary) == []  # fp16_static never grows


def test_a_healthy_scaler_and_a_run_without_one_get_no_scale_finding():
    runs = [
        run("fp32", val__acc=0.9, train__steps=3000.0),
        run(
            "fp16",
            val__acc=0.9,
            amp__loss_scale=131072.0,
            amp__skipped_steps=3.0,
            train__steps=3000.0,
            history=[(10, 32768.0), (3000, 131072.0)],
        ),  # fmt: skip
        run("fp16_noscale", val__acc=0.9, train__steps=3000.0, amp__skipped_steps=0.0),
    ]
    assert numerics.scale_findings(report(runs).summary) == []
    assert not any("loss scale" in f or "skipped" in f for f in numeric_findings(runs))


# ---------------------------------------------------------------- probed runs (test_probe.py too)


def probed_runs(probe=TROUBLED, tags=TROUBLED_TAGS, lr="0.001"):
    """An fp32 and a bf16 run of one configuration, each with the same probe."""
    return [run(m, lr=lr, tags=tags, val__acc=0.9, **_logged(probe)) for m in ("fp32", "bf16")]


def _logged(metrics: dict[str, float]) -> dict[str, float]:
    return {k.replace("/", "__"): v for k, v in metrics.items()}


# ---------------------------------------------------------------- a pure mode's own steps


def test_a_pure_run_that_lost_updates_on_its_own_steps_says_so():
    runs = [
        run("bf16_pure", amp__update_lost_frac=0.3),
        run("fp16_pure", lr="0.1", amp__update_lost_frac=0.01),  # within the tolerance
    ]
    assert numerics.update_findings(report(runs).summary) == [
        "bf16_pure-cnn-digits: its bf16 weights rounded away 30% of the non-zero updates of a "
        "step it measured (amp/update_lost_frac: smaller than half a unit in the last place of "
        "the weight), so those weights did not learn; fix: precision=bf16_pure "
        "precision.master_weights=true keeps them in fp32 master weights (as much weight memory "
        "as fp32), or precision=bf16 (autocast, fp32 weights)."
    ]


# A pure run's step, part by part (MiB): bf16 weights, gradients and Adam's state, at batch 64
PURE_PARTS = {
    "mem__step_peak_mib": 30.0,
    "mem__params_mib": 2.0,
    "mem__grads_mib": 2.0,
    "mem__optimizer_mib": 4.0,
    "mem__activations_mib": 20.0,
    "mem__other_mib": 2.0,
}


def test_master_weights_are_offered_with_the_peak_predicted_from_the_runs_parts():
    pure = run("bf16_pure", params={"trainer.batch_size": "64"}, amp__update_lost_frac=0.3,
               **PURE_PARTS)  # fmt: skip
    (text,) = numerics.update_findings(report([pure]).summary)
    # fp32 copies (4 B a parameter: 4 MiB) and Adam's state in fp32 (4 -> 8 MiB)
    assert text.endswith(
        "fix: precision=bf16_pure precision.master_weights=true keeps them in fp32 master "
        "weights (the step's peak 30 MiB -> 38 MiB, predicted from its parts), or "
        "precision=bf16 (autocast, fp32 weights)."
    )


def pure_short_of_fp32(autocast_acc: float, master_weights: str = "False") -> list[RunData]:
    """fp32, bf16 and bf16_pure of one configuration: bf16_pure 5 points short of fp32."""
    params = {"precision.master_weights": "False"}
    return [
        run("fp32", params=params, val__acc=0.94),
        run("bf16", params=params, val__acc=autocast_acc),
        run("bf16_pure", params={"precision.master_weights": master_weights}, val__acc=0.89),
    ]


def test_a_pure_mode_short_of_fp32_where_autocast_held_is_offered_master_weights():
    (text,) = numerics.update_findings(report(pure_short_of_fp32(0.935)).summary)
    assert text == (
        "bf16_pure-cnn-digits: its accuracy did not hold within 1.5 points of its baseline's "
        "(-5.0 points vs fp32, a single run) while bf16, the same bf16 math with fp32 weights, "
        "held (-0.5 points vs fp32, a single run): its bf16 weights round away updates smaller "
        "than half a unit in their last place; fix: precision=bf16_pure "
        "precision.master_weights=true keeps them in fp32 master weights (as much weight memory "
        "as fp32), or precision=bf16 (autocast, fp32 weights)."
    )


def test_no_master_weights_where_autocast_lost_too_or_the_pure_run_had_them():
    assert numerics.update_findings(report(pure_short_of_fp32(0.89)).summary) == []
    runs = pure_short_of_fp32(0.935, master_weights="True")
    rows = report(runs).summary
    assert rows[2].master_weights and numerics.update_findings(rows) == []
    rows = report(pure_short_of_fp32(0.935)).summary  # the same configuration, said apart
    rows[2].master_weights = True
    assert numerics.update_findings(rows) == []


# ---------------------------------------------------------------- rows, repeats and files


def three_fp16_seeds(troubled_seed=None, grew=False) -> list[RunData]:
    runs = []
    for seed in range(3):
        history = [(10, 32768.0), (3000, 65536.0 if grew and seed == 2 else 32768.0)]
        tags = origin(where=f"step {seed}: conv1", fix="precision.keep_fp32=[conv1]",
                      module="conv1") if seed == troubled_seed else {}  # fmt: skip
        runs.append(
            run(
                "fp16",
                seed=seed,
                job=seed,
                tags={**tags, **TROUBLED_TAGS},
                history=history,
                amp__loss_scale=32768.0,
                amp__skipped_steps=2.0,
                train__steps=3000.0,
                val__acc=0.9,
                numerics__nonfinite_steps=2.0,
                **_logged(TROUBLED),
            )  # fmt: skip
        )
    return runs


def test_repeats_whose_scale_never_grew_in_any_run_say_so_once():
    (stuck,) = numerics.scale_findings(report(three_fp16_seeds()).summary)
    assert stuck.startswith("fp16-cnn-digits (3 runs): the dynamic loss scale never grew above")
    assert numerics.scale_findings(report(three_fp16_seeds(grew=True)).summary) == []


def test_the_csv_carries_the_origin_and_a_column_per_probe_metric():
    rows = list(csv.DictReader(io.StringIO(render.to_csv(report(three_fp16_seeds(1))))))
    assert [r["nonfinite_module"] for r in rows] == ["", "conv1", ""]
    assert float(rows[0]["numerics/suggested_init_scale"]) == pytest.approx(1024.0)
    assert "probe" not in rows[0]


def test_the_console_shows_a_fix_s_brackets_as_written():
    console = Console(width=100, record=True, soft_wrap=True)
    render.print_table(report(probed_runs()), console)
    assert "precision.keep_fp32=[amplify,blocks.1.attn] (those modules in fp32)" in (
        console.export_text()
    )
