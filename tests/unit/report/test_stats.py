"""report.stats on known inputs: every expected interval is worked out by hand here from
Student's t critical values as printed in textbook tables (t_{0.975, dof}), not by calling scipy."""

from __future__ import annotations

import math

import pytest

from ampsweep.report import stats

# Two-sided 95% critical values of Student's t (any statistics textbook's table)
T_975 = {1: 12.706, 2: 4.303, 4: 2.776, 9: 2.262}


def test_t_quantiles_are_the_textbook_ones():
    for dof, value in T_975.items():
        assert stats.t_quantile(0.95, dof) == pytest.approx(value, abs=5e-4)


def test_mean_interval_of_one_to_five():
    # mean 3; sample sd sqrt(2.5); standard error sqrt(2.5)/sqrt(5) = sqrt(0.5)
    est = stats.mean_interval([1, 2, 3, 4, 5])
    half = 2.776 * math.sqrt(0.5)  # 1.963
    assert est.n == 5 and est.mean == pytest.approx(3.0)
    assert est.low == pytest.approx(3.0 - half, abs=1e-3)
    assert est.high == pytest.approx(3.0 + half, abs=1e-3)
    assert est.half_width == pytest.approx(half, abs=1e-3)


def test_two_values_give_the_wide_interval_of_one_degree_of_freedom():
    # [0, 2]: mean 1, sd sqrt(2), standard error 1: the interval is 1 +/- 12.706
    est = stats.mean_interval([0.0, 2.0])
    assert est.low == pytest.approx(1 - 12.706, abs=1e-3)
    assert est.high == pytest.approx(1 + 12.706, abs=1e-3)


def test_a_single_run_has_a_mean_and_no_interval():
    est = stats.mean_interval([0.986])
    assert est.mean == 0.986 and est.n == 1
    assert not est.has_interval and est.half_width is None
    assert stats.compare(est, 0.0) is None
    assert stats.mean_interval([]) is None
    assert stats.mean_interval([float("nan")]) is None  # a missing metric is not a value


def test_identical_values_give_a_zero_width_interval():
    est = stats.mean_interval([0.52, 0.52, 0.52])
    assert est.low == pytest.approx(0.52) and est.high == pytest.approx(0.52)


def test_paired_difference_uses_the_differences_of_each_seed():
    # Accuracy of a mode and of fp32 on seeds 0, 1, 2: differences 0.01, 0.00, 0.02,
    # mean 0.01, sd 0.01, standard error 0.01/sqrt(3); t(2) = 4.303
    mode = [0.98, 0.97, 0.99]
    fp32 = [0.97, 0.97, 0.97]
    est = stats.paired_difference(mode, fp32)
    half = 4.303 * 0.01 / math.sqrt(3)  # 0.02484
    assert est.mean == pytest.approx(0.01)
    assert est.half_width == pytest.approx(half, abs=1e-4)
    # Unpaired, the same numbers would carry fp32's spread too; paired, a shift common to both
    # runs of a seed cancels: here the mode beats fp32 by exactly 0.01 on every seed.
    shifted = stats.paired_difference([0.91, 0.96, 0.99], [0.90, 0.95, 0.98])
    assert shifted.mean == pytest.approx(0.01)
    assert shifted.half_width == pytest.approx(0.0, abs=1e-12)
    assert stats.compare(shifted, 0.0) == "higher"
    with pytest.raises(ValueError):
        stats.paired_difference([1.0], [1.0, 2.0])


def test_ratio_interval_is_a_geometric_mean_with_a_log_scale_interval():
    # ratios 2, 4, 8: logs ln2 * (1, 2, 3), mean ln 4 (geometric mean 4), sd ln 2,
    # standard error ln2/sqrt(3); t(2) = 4.303
    est = stats.ratio_interval([2.0, 4.0, 8.0])
    spread = 4.303 * math.log(2) / math.sqrt(3)  # 1.722
    assert est.mean == pytest.approx(4.0)
    assert est.low == pytest.approx(4.0 * math.exp(-spread), rel=1e-3)  # 0.715
    assert est.high == pytest.approx(4.0 * math.exp(spread), rel=1e-3)  # 22.39
    # x times faster and x times slower are symmetric: the interval of 1/ratio is 1/interval
    inverse = stats.ratio_interval([1 / 2, 1 / 4, 1 / 8])
    assert inverse.low == pytest.approx(1 / est.high) and inverse.high == pytest.approx(1 / est.low)


def test_paired_ratio_of_throughputs():
    # samples/s of fp16 and fp32 on three seeds: ratios 0.16, 0.16, 0.16
    est = stats.paired_ratio([160.0, 176.0, 144.0], [1000.0, 1100.0, 900.0])
    assert est.mean == pytest.approx(0.16)
    assert est.low == pytest.approx(0.16) and est.high == pytest.approx(0.16)
    assert stats.compare(est, 1.0) == "lower"


def test_compare_says_where_the_interval_lies():
    lower = stats.Estimate(-0.05, -0.08, -0.02, 5)
    higher = stats.Estimate(0.05, 0.02, 0.08, 5)
    across = stats.Estimate(-0.001, -0.004, 0.002, 5)
    assert stats.compare(lower, 0.0) == "lower"
    assert stats.compare(higher, 0.0) == "higher"
    assert stats.compare(across, 0.0) == "indistinguishable"
    assert stats.compare(stats.Estimate(1.02, 0.97, 1.07, 3), 1.0) == "indistinguishable"
    assert stats.compare(stats.Estimate(0.16, 0.15, 0.17, 3), 1.0) == "lower"


def test_ten_runs_shrink_the_interval_as_t_and_root_n_say():
    values = [0.980, 0.984, 0.986, 0.982, 0.988, 0.985, 0.983, 0.987, 0.981, 0.984]
    mean = sum(values) / 10
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 9)
    est = stats.mean_interval(values)
    assert est.half_width == pytest.approx(2.262 * sd / math.sqrt(10), rel=1e-3)


def test_fewer_than_three_runs_are_too_wide_for_a_tie_but_not_for_a_clear_verdict():
    assert stats.compare(stats.Estimate(1.48, 0.25, 8.69, 2), 1.0) == "too wide"
    assert stats.compare(stats.Estimate(0.04, 0.039, 0.041, 2), 1.0) == "lower"


def test_repeats_needed_is_where_the_t_interval_narrows_to_the_target():
    # a mean of 10 with sd 1 over 2 runs: half-width 12.706 / sqrt(2) = 8.98; to reach 0.5
    # needs t(n-1) / sqrt(n) <= 0.5: n=18 gives 2.110 / 4.243 = 0.497, n=17 2.120 / 4.123 = 0.514
    est = stats.mean_interval([10 - 0.5**0.5, 10 + 0.5**0.5])
    assert stats.repeats_needed(est, 0.5) == 18
    # a ratio: its half-width on the log scale against ln(1 + target)
    ratio = stats.ratio_interval([1.0, 1.02, 0.98])
    assert stats.repeats_needed(ratio, 0.10, ratio=True) <= 3
    huge = stats.mean_interval([0.0, 100.0])
    assert stats.repeats_needed(huge, 0.5) == stats.MAX_REPEATS + 1
    assert stats.repeats_needed(stats.mean_interval([1.0]), 0.5) is None


def test_an_interval_is_cut_at_the_range_its_quantity_cannot_leave():
    est = stats.mean_interval([0.98, 1.0, 0.5], bounds=(0.0, 1.0))
    free = stats.mean_interval([0.98, 1.0, 0.5])
    assert free.high > 1.0 and free.low < 1.0  # the t interval alone passes 1
    assert (est.mean, est.low, est.high) == (free.mean, max(0.0, free.low), 1.0)
