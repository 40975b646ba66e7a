"""The paired never-slower matrix's statistic (benchmarks/bench_speculative.py --matrix --pairs):
summed off time over summed adaptive time with a bootstrap interval, and the verdict it gives."""

import importlib.util
import pathlib
import random

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_speculative.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_speculative", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _noisy(rng: random.Random, base: float, n: int, cv: float) -> list[float]:
    return [base * (1 + rng.gauss(0, cv)) for _ in range(n)]


def test_the_ratio_is_summed_off_time_over_summed_adaptive_time(bench):
    point, lo, hi = bench.bootstrap_ratio([1.0, 3.0], [2.0, 2.0])
    assert point == pytest.approx(1.0)
    assert lo <= point <= hi


def test_a_clear_loss_is_called_slower_and_a_clear_tie_met(bench):
    rng = random.Random(0)
    off = _noisy(rng, 1.0, 40, 0.02)
    slow = [x * 1.10 for x in _noisy(rng, 1.0, 40, 0.02)]  # adaptive takes 10% longer: 0.91x
    point, lo, hi = bench.bootstrap_ratio(off, slow)
    assert point == pytest.approx(1 / 1.10, abs=0.02)
    assert bench.verdict(lo, hi) == "slower"
    fast = [x * 0.95 for x in _noisy(rng, 1.0, 40, 0.02)]
    assert bench.verdict(*bench.bootstrap_ratio(off, fast)[1:]) == "met"


def test_noise_wider_than_the_gap_is_undecided_until_more_pairs_narrow_it(bench):
    rng = random.Random(1)
    few_off, few_ad = _noisy(rng, 1.0, 6, 0.15), _noisy(rng, 1.0, 6, 0.15)
    lo, hi = bench.bootstrap_ratio(few_off, few_ad)[1:]
    assert lo < 0.98 < hi and bench.verdict(lo, hi) == "undecided"
    many_off, many_ad = _noisy(rng, 1.0, 2000, 0.15), _noisy(rng, 1.0, 2000, 0.15)
    lo, hi = bench.bootstrap_ratio(many_off, many_ad, draws=400)[1:]
    assert hi - lo < 0.03 and bench.verdict(lo, hi) == "met"


def test_pairs_take_one_count_or_one_per_batch_size(bench):
    """``--pairs 40`` for every batch size, ``--pairs 1:100,4:40`` per batch size (a batch-1 pair
    is one request, a batch-16 pair sixteen); anything else is refused with the form it takes."""
    import argparse

    assert bench.parse_pairs("40") == 40
    assert bench.parse_pairs("1:100,4:40,16:40") == {1: 100, 4: 40, 16: 40}
    for bad in ("1:", "x", "1:100,4"):
        with pytest.raises(argparse.ArgumentTypeError, match="batch:count"):
            bench.parse_pairs(bad)
