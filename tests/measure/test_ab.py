"""The A/B helper every speed comparison uses: verdicts from measured times (exact, synthetic
times) and from real interleaved runs whose effects are large enough to survive a loaded machine."""

import time

import pytest
import torch

from ouro.measure.ab import ab_compare, verdict_from_times


def test_verdicts_from_times():
    a = [1.00, 1.02, 0.98, 1.01, 0.99, 1.00, 1.03]
    assert verdict_from_times(a, [t * 0.5 for t in a]).verdict == "faster"
    assert verdict_from_times(a, [t * 1.5 for t in a]).verdict == "slower"
    same = verdict_from_times(a, list(a))
    assert same.verdict == "no difference" and same.ratio == pytest.approx(1.0)
    assert same.low <= 1.0 <= same.high


def test_paired_rounds_see_through_a_drifting_machine():
    """Each round runs both sides; the machine slows by rounds (0.5x to 2x). B costs 6% more in
    every round: resampling rounds whole says so, resampling each side alone drowns it in the drift."""
    drift = [0.5, 2.0, 0.7, 1.6, 1.0, 0.6, 1.8, 1.2, 0.9]
    a = [d * 1.00 for d in drift]
    b = [d * 1.06 for d in drift]
    paired = verdict_from_times(a, b, paired=True)
    loose = verdict_from_times(a, b)
    assert paired.verdict == "slower" and paired.low == pytest.approx(1.06) == paired.high
    assert loose.verdict == "no difference" and loose.low < 1 < loose.high
    with pytest.raises(ValueError, match="as many times"):
        verdict_from_times(a, b[:-1], paired=True)


def test_small_effect_within_noise_is_no_difference():
    """A 1% shift inside 10% scatter is not a verdict; the same shift without scatter is below the
    minimum effect (2%) and is not one either."""
    a = [1.0, 1.1, 0.9, 1.2, 0.8, 1.05, 0.95]
    assert verdict_from_times(a, [t * 1.01 for t in a[::-1]]).verdict == "no difference"
    assert verdict_from_times([1.0] * 5, [1.01] * 5).verdict == "no difference"
    assert verdict_from_times([1.0] * 5, [1.05] * 5).verdict == "slower"


def test_noise_estimate():
    v = verdict_from_times([1.0, 1.1, 0.9, 1.2, 0.8], [2.0] * 5)
    assert v.noise == pytest.approx(0.1)            # median |x - median| / median of the noisier side
    assert verdict_from_times([1.0] * 4, [1.0] * 4).noise == 0.0
    assert v.median_a_s == pytest.approx(1.0) and v.median_b_s == pytest.approx(2.0)
    assert v.ratio == pytest.approx(2.0) and v.low <= v.ratio <= v.high
    assert "slower" in v.text()


def test_empty_side_is_refused():
    with pytest.raises(ValueError):
        verdict_from_times([], [1.0])


def sleeper(seconds):
    return lambda x: time.sleep(seconds)


def test_sleep_based_verdicts():
    slow, fast = sleeper(0.02), sleeper(0.004)
    assert ab_compare(slow, fast, repeats=7).verdict == "faster"
    assert ab_compare(fast, slow, repeats=7).verdict == "slower"


def test_identical_functions_show_no_difference():
    """Same function both sides: the verdict must not invent an effect (10 ms sleeps: scheduling
    jitter is well under the 2% minimum effect... but a loaded machine may still add a few ms once,
    which the medians absorb)."""
    f = sleeper(0.01)
    v = ab_compare(f, f, repeats=9)
    assert v.verdict == "no difference", v.text()
    assert v.noise < 0.5


def test_matmul_size_based_verdict():
    big, small = torch.randn(384, 384), torch.randn(48, 48)
    v = ab_compare(lambda x: [big @ big for _ in range(4)], lambda x: small @ small, repeats=7,
                   label_a="384", label_b="48")
    assert v.verdict == "faster" and v.ratio < 0.5, v.text()


def test_fresh_input_per_pair_and_alternating_order():
    calls = []
    ab_compare(lambda x: calls.append(("a", x)), lambda x: calls.append(("b", x)), make_input=lambda i: i,
               repeats=4, warmup=1)
    assert [x for _, x in calls] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]    # one fresh input per pair, both sides
    assert [s for s, _ in calls] == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]   # order alternates


def test_prefill_bench_reports_the_verdict(tiny_checkpoint):
    """`ouro bench prefill` states the A/B verdict of its interleaved repeats beside the ratio."""
    pytest.importorskip("transformers")
    from ouro.bench.prefill import bench_prefill, format_prefill
    r = bench_prefill(tiny_checkpoint, input_len=24, repeats=3, compare=True, progress=False)
    v = r["verdict"]
    assert (v["label_a"], v["label_b"], v["repeats"]) == ("transformers", "ouro", 3)
    assert v["ratio"] == pytest.approx(1 / r["ratio"])           # B / A time = ouro / transformers
    assert v["verdict"] in ("faster", "slower", "no difference")
    assert f"ouro is {v['verdict']}" in format_prefill(r)
