"""The adaptive-k controller alone: per-position acceptance figures and the choice of k."""

from __future__ import annotations

import itertools

import pytest

from tailserve.speculative.adaptive import AdaptiveSpeculation


def expected_tokens(a: float, k: int) -> float:
    """The geometric model's closed form: E[tokens] = (1 - a^(k+1)) / (1 - a)."""
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def _feed_costs(ctl: AdaptiveSpeculation, target: tuple[float, float], draft: tuple[float, float]) -> None:
    """Observations on the lines seconds = alpha + beta * tokens for both models."""
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        for _ in range(3):
            ctl.target_cost.observe(n, target[0] + target[1] * n)
            ctl.draft_cost.observe(n, draft[0] + draft[1] * n)


def test_without_early_stops_the_figures_are_geometric():
    """Rounds drafted to their cap whose acceptance is geometric with a = 0.75 (built
    exactly: of every 64 rounds, 16 reject draft 1, 12 draft 2, 9 draft 3, 27 accept all):
    the per-position figures give (1 - a^(k+1)) / (1 - a) tokens and k drafts."""
    ctl = AdaptiveSpeculation(k_max=3, forget=1.0)
    for accepted, count in ((0, 16), (1, 12), (2, 9), (3, 27)):
        for _ in range(count):
            ctl.observe_round(accepted, 3, cap=3)
    for k in (1, 2, 3):
        tokens, drafts = ctl.round_figures(k)
        assert tokens == pytest.approx(expected_tokens(0.75, k), rel=1e-9)
        assert drafts == pytest.approx(k)


def test_early_stops_shorten_rounds_under_every_cap():
    """Cap 6, but the chain always stops after 2 drafts, both accepted: any cap >= 2 gives
    3 tokens for 2 drafts; cap 1 gives 2 tokens for 1 draft."""
    ctl = AdaptiveSpeculation(k_max=6)
    for _ in range(50):
        ctl.observe_round(2, 2, cap=6)
    assert ctl.round_figures(1) == pytest.approx((2.0, 1.0))
    for k in (2, 4, 6):
        tokens, drafts = ctl.round_figures(k)
        assert tokens == pytest.approx(3.0, abs=0.02) and drafts == pytest.approx(2.0, abs=0.02)


def test_rounds_under_a_small_cap_say_nothing_of_later_positions():
    """Rounds capped at 2 must not count as "the chain stopped after draft 2"."""
    ctl = AdaptiveSpeculation(k_max=4)
    for _ in range(50):
        ctl.observe_round(2, 2, cap=2)
    _, drafts = ctl.round_figures(4)
    assert drafts > 3.5  # positions 3-4 fall back to the pooled "chain continues" figure


def test_choose_k_speculates_when_verification_is_free_and_stops_when_it_is_not():
    ctl = AdaptiveSpeculation(k_max=6, explore_every=10**9)
    for _ in range(40):
        ctl.observe_round(4, 4, cap=6)  # the draft is right, and stops after 4 on its own
    # Memory-bound target: 3 ms per forward whatever the tokens; draft 0.5 ms.
    _feed_costs(ctl, (3e-3, 1e-7), (5e-4, 1e-7))
    assert ctl.choose_k(1) >= 4
    # Compute-bound target: every verified token costs as much as a whole small forward.
    ctl2 = AdaptiveSpeculation(k_max=6, explore_every=10**9)
    for _ in range(40):
        ctl2.observe_round(1, 4, cap=6)
    _feed_costs(ctl2, (3e-3, 1e-3), (5e-4, 1e-5))
    assert ctl2.choose_k(64) == 0


def test_k_stays_within_the_verify_row_limit():
    """A target whose verification looks free would draft the cap at any batch; with the
    plan's 16-row limit k <= 16 // b - 1, and at 16 decoding requests nothing is drafted
    (nor explored). Without the limit the same figures draft the cap everywhere."""
    for max_rows, expected in ((16, [8, 3, 1, 0, 0]), (None, [8, 8, 8, 8, 8])):
        ctl = AdaptiveSpeculation(k_max=8, explore_every=10**9, max_rows=max_rows)
        for _ in range(40):
            ctl.observe_round(8, 8, cap=8)
        _feed_costs(ctl, (3e-3, 1e-9), (1e-5, 1e-9))
        assert [ctl.choose_k(b) for b in (1, 4, 8, 9, 16)] == expected


def test_a_fixed_k_is_kept():
    ctl = AdaptiveSpeculation(k_max=4, fixed_k=3)
    _feed_costs(ctl, (3e-3, 1e-3), (5e-4, 1e-5))
    assert [ctl.choose_k(b) for b in (1, 64)] == [3, 3]


def test_forgetting_survives_a_long_run():
    """Old rounds fade (a change in acceptance shows within ~100 rounds) and the internal
    weights are rescaled before they overflow (tens of thousands of rounds)."""
    ctl = AdaptiveSpeculation(k_max=3)
    for _ in range(30_000):
        ctl.observe_round(0, 3, cap=3)  # the draft is always wrong
    assert ctl.round_figures(3) == pytest.approx((1.0, 3.0), abs=1e-6)
    for _ in range(300):
        ctl.observe_round(3, 3, cap=3)  # ... then always right
    tokens, drafts = ctl.round_figures(3)
    assert tokens == pytest.approx(4.0, abs=0.02) and drafts == pytest.approx(3.0)


def _steady(ctl, b, k, tokens, seconds, steps=4):
    """Feed ``steps`` steady steps at batch b with k (forcing the choice) and their throughput."""
    for _ in range(steps):
        ctl._set(k, b)
        ctl.observe_throughput(tokens, seconds, *ctl.last_round)


def test_measured_throughput_overrides_the_cost_model():
    """The model says speculate (verification looks free); measured steps in the same batch
    bucket say k=4 delivered less than off: the controller turns speculation off there, and
    only there. The reverse too: the model says off, measured on beats off."""
    ctl = AdaptiveSpeculation(k_max=6, explore_every=10**9)
    for _ in range(40):
        ctl.observe_round(4, 4, cap=6)
    _feed_costs(ctl, (3e-3, 1e-7), (5e-4, 1e-7))
    k = ctl.choose_k(16)
    assert k >= 4
    _steady(ctl, 16, k, tokens=16 * 3, seconds=0.030)  # 1600 tok/s speculating
    _steady(ctl, 16, 0, tokens=16, seconds=0.008)  # 2000 tok/s off
    assert ctl.measured_rate(16, 0) == pytest.approx(2000) and ctl.measured_rate(9, k) == pytest.approx(1600)
    assert ctl.choose_k(16) == 0 and ctl.choose_k(12) == 0  # the same bucket (9-16)
    assert ctl.choose_k(1) >= 4  # nothing measured at batch 1: the model decides
    # A step whose k differs from the previous step's is not steady: not counted.
    ctl._set(2, 16)
    ctl._set(0, 16)
    before = ctl.rates[(ctl.bucket(16), 0)]
    ctl.observe_throughput(1, 1.0, *ctl.last_round)
    assert ctl.rates[(ctl.bucket(16), 0)] == before

    ctl2 = AdaptiveSpeculation(k_max=6, explore_every=10**9)
    for _ in range(40):
        ctl2.observe_round(1, 4, cap=6)
    _feed_costs(ctl2, (3e-3, 1e-3), (5e-4, 1e-5))
    assert ctl2.choose_k(64) == 0
    _, best_pos = ctl2._model_choice(64)
    _steady(ctl2, 64, 0, tokens=64, seconds=0.1)
    _steady(ctl2, 64, best_pos, tokens=100, seconds=0.1)
    assert ctl2.choose_k(64) == best_pos


def test_explorations_take_turns_and_last_several_steps():
    ctl = AdaptiveSpeculation(k_max=6, explore_every=5, explore_len=3)
    for _ in range(40):
        ctl.observe_round(4, 4, cap=6)
    _feed_costs(ctl, (3e-3, 1e-7), (5e-4, 1e-7))
    ks = [ctl.choose_k(1) for _ in range(40)]
    model_k = ctl._model_choice(1)[0]
    assert model_k >= 4
    # An exploration of speculation off, three steps long.
    assert any(ks[i:i + 3] == [0, 0, 0] for i in range(len(ks) - 2))
    assert ks.count(model_k) > len(ks) // 2


def test_explorations_back_off_where_they_keep_confirming_off():
    ctl = AdaptiveSpeculation(k_max=6, explore_every=6, explore_len=3, max_backoff=4)
    for _ in range(40):
        ctl.observe_round(4, 4, cap=6)
    _feed_costs(ctl, (3e-3, 1e-7), (5e-4, 1e-7))
    assert ctl._model_choice(16)[0] > 0
    _steady(ctl, 16, ctl._model_choice(16)[0], tokens=16, seconds=0.02)  # measured: speculating is slow
    _steady(ctl, 16, 0, tokens=16, seconds=0.008)
    ks = [ctl.choose_k(16) for _ in range(200)]
    assert ks.count(0) > 150
    assert ctl._backoff[ctl.bucket(16)] == 4  # explorations now come 4x less often in this bucket
    explored = sum(1 for a, b in itertools.pairwise(ks) if a == 0 and b != 0)
    assert explored <= 200 // (6 * 2) + 2


def test_a_steps_throughput_counts_for_the_k_it_ran_with():
    """The engine learns a step's whole cost after the next step's k is chosen (it is handed
    over with the next update): the sample must count for the k the step ran with."""
    ctl = AdaptiveSpeculation(k_max=6, explore_every=10**9)
    ctl._set(3, 4)
    ctl._set(3, 4)
    measured = ctl.last_round  # step N: 4 decoding, k 3, steady
    ctl._set(0, 4)  # step N + 1, chosen before step N's cost is known
    ctl.observe_throughput(12, 0.01, *measured)
    assert ctl.rates[(ctl.bucket(4), 3)][0] == pytest.approx(1200) and (ctl.bucket(4), 0) not in ctl.rates
