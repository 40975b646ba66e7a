"""The adaptive-k controller alone: per-position acceptance figures and the choice of k."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from tailserve.speculative.adaptive import AdaptiveSpeculation, BatchOutlook, VerifyCostProfile


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
    assert ctl._model_choice(1)[0] >= 4
    # Compute-bound target: every verified token costs as much as a whole small forward.
    ctl2 = AdaptiveSpeculation(k_max=6, explore_every=10**9)
    for _ in range(40):
        ctl2.observe_round(1, 4, cap=6)
    _feed_costs(ctl2, (3e-3, 1e-3), (5e-4, 1e-5))
    assert ctl2._model_choice(64)[0] == 0


def test_k_stays_within_the_verify_row_limit():
    """A target whose verification looks free would draft the cap at any batch; with the
    plan's 16-row limit k <= 16 // b - 1, and at 16 decoding requests nothing is drafted
    (nor explored). Without the limit the same figures draft the cap everywhere."""
    for max_rows, expected in ((16, [8, 3, 1, 0, 0]), (None, [8, 8, 8, 8, 8])):
        ctl = AdaptiveSpeculation(k_max=8, explore_every=10**9, max_rows=max_rows)
        for _ in range(40):
            ctl.observe_round(8, 8, cap=8)
        _feed_costs(ctl, (3e-3, 1e-9), (1e-5, 1e-9))
        assert [ctl._model_choice(b)[0] for b in (1, 4, 8, 9, 16)] == expected
        if max_rows is not None:
            assert [ctl.choose_k(16) for _ in range(20)] == [0] * 20


def test_a_fixed_k_is_kept():
    ctl = AdaptiveSpeculation(k_max=4, fixed_k=3)
    _feed_costs(ctl, (3e-3, 1e-3), (5e-4, 1e-5))
    assert [ctl.choose_k(b) for b in (1, 64)] == [3, 3]


def test_the_rounds_of_one_step_weigh_alike():
    """Forgetting runs per step, not per round: at batch 4 a step's four rounds are one
    moment of the text, so their order does not matter, and a change in acceptance takes as
    many steps to show as at batch 1 (per round, batch 4 forgot 4x faster in time: its
    acceptance followed the last ~12 steps' text, and batch 4 greedy on the built-in pair
    was ruled out where k = 2 paid 1.09x)."""
    figures = []
    for order in ((0, 3, 3, 3), (3, 3, 3, 0)):
        ctl = AdaptiveSpeculation(k_max=3)
        for _ in range(20):
            ctl._steps += 1
            for accepted in order:
                ctl.observe_round(accepted, 3, cap=3)
        figures.append(ctl.round_figures(3))
    assert figures[0] == pytest.approx(figures[1], rel=1e-12)
    by_step = []
    for per_step in (1, 4):
        ctl = AdaptiveSpeculation(k_max=3)
        for _ in range(400):
            ctl._steps += 1
            for _ in range(per_step):
                ctl.observe_round(0, 3, cap=3)
        for _ in range(30):  # then 30 steps of drafts always right
            ctl._steps += 1
            for _ in range(per_step):
                ctl.observe_round(3, 3, cap=3)
        by_step.append(ctl.round_figures(3)[0])
    assert by_step[1] == pytest.approx(by_step[0], abs=0.05) and 1.5 < by_step[0] < 3.9


def test_forgetting_survives_a_long_run():
    """Old rounds fade (a change in acceptance shows within ~100 rounds) and the internal
    weights are rescaled before they overflow (tens of thousands of rounds)."""
    ctl = AdaptiveSpeculation(k_max=3)
    for _ in range(30_000):
        ctl._steps += 1  # one round a step (batch 1): rounds are forgotten per step
        ctl.observe_round(0, 3, cap=3)  # the draft is always wrong
    assert ctl.round_figures(3) == pytest.approx((1.0, 3.0), abs=1e-6)
    for _ in range(300):
        ctl._steps += 1
        ctl.observe_round(3, 3, cap=3)  # ... then always right
    tokens, drafts = ctl.round_figures(3)
    assert tokens == pytest.approx(4.0, abs=0.02) and drafts == pytest.approx(3.0)


def _steady(ctl, b, k, tokens, seconds, steps=4):
    """Feed ``steps`` steady steps at batch b with k (forcing the choice) and their throughput;
    an off stretch first passes the settling steps the controller leaves out of its window
    after drafts (``off_settle_steps``), a stretch with drafts after off those it leaves out of
    k's (``spec_settle_steps``)."""
    if k == 0:
        ctl._steps += ctl.off_settle_steps + 1
    elif ctl._reported_k == 0:
        ctl._steps += 1
        ctl._set(k, b)
        ctl.observe_throughput(tokens, seconds, *ctl.last_round)  # the run's first report: left out
        ctl._steps += ctl.spec_settle_steps
    for _ in range(steps):
        ctl._steps += 1
        ctl._set(k, b)
        ctl.observe_throughput(tokens, seconds, *ctl.last_round)


def _run(ctl, b, step, steps, outlook=None):
    """Drive the controller as the engine does: choose k, run the step on a synthetic machine
    (``step(k) -> (tokens, seconds)``), report its throughput with the next choice. Returns
    the k of every step and the tokens/s over the whole run."""
    ks, tokens, seconds = [], 0, 0.0
    pending = None
    for _ in range(steps):
        k = ctl.choose_k(b, outlook=outlook)
        if pending is not None:
            ctl.observe_throughput(*pending)
        n, s = step(k)
        ks.append(k)
        tokens += n
        seconds += s
        r = ctl.last_round
        pending = None if r is None else (n, s, *r)  # None: a quiet step, not measured
    return ks, tokens / seconds


def _optimistic(k_max=6, **kw):
    """A controller whose cost model says speculate: the draft is right, verification free."""
    ctl = AdaptiveSpeculation(k_max=k_max, **kw)
    for _ in range(40):
        ctl.observe_round(4, 4, cap=k_max)
    _feed_costs(ctl, (3e-3, 1e-7), (5e-4, 1e-7))
    return ctl


def test_a_cold_controller_measures_off_first_then_the_models_k():
    """Measured beats modelled: the first steps run off, then the model's k, then off again
    (switching on needs off measured after the candidate), and only a k that measured above
    off is kept. The exploration of k from off lasts its settling steps longer."""
    ctl = _optimistic(explore_every=10**9)
    model_k = ctl._model_choice(1)[0]
    assert model_k >= 4
    n = ctl.explore_len + ctl.spec_settle_steps
    ks, _ = _run(ctl, 1, lambda k: (1 + k, 0.005 + 0.0005 * k), 40)  # speculating pays
    assert ks[:5] == [0] * 5 and ks[5:5 + n] == [model_k] * n and ks[5 + n:10 + n] == [0] * 5
    assert ks[10 + n:] == [model_k] * (30 - n)
    ctl = _optimistic(explore_every=10**9)
    ks, _ = _run(ctl, 1, lambda k: (1 + 0.1 * k, 0.005 * (1 + k)), 40)  # it does not
    assert ks[:5] == [0] * 5 and ks[5:5 + n] == [model_k] * n and ks[5 + n:] == [0] * (35 - n)


def test_measured_throughput_overrides_the_cost_model():
    """The model says speculate (verification looks free); measured steps in the same batch
    bucket say k=4 delivered less than off: the controller turns speculation off there, and
    only there. The reverse too: the model says off, measured on beats off."""
    ctl = _optimistic(explore_every=10**9)
    k = ctl._model_choice(16)[0]
    assert k >= 4
    _steady(ctl, 16, k, tokens=16 * 3, seconds=0.030)  # 1600 tok/s speculating
    _steady(ctl, 16, 0, tokens=16, seconds=0.008)  # 2000 tok/s off
    assert ctl.measured_rate(16, 0) == pytest.approx(2000) and ctl.measured_rate(9, k) == pytest.approx(1600)
    assert ctl.choose_k(16) == 0 and ctl.choose_k(12) == 0  # the same bucket (9-16)
    # A step whose k differs from the previous step's is not steady: not counted.
    ctl._set(2, 16)
    ctl._set(0, 16)
    before = list(ctl.rates[(ctl.bucket(16), 0)].steps)
    ctl.observe_throughput(1, 1.0, *ctl.last_round)
    assert list(ctl.rates[(ctl.bucket(16), 0)].steps) == before

    ctl2 = AdaptiveSpeculation(k_max=6, explore_every=10**9)
    for _ in range(40):
        ctl2.observe_round(1, 4, cap=6)
    _feed_costs(ctl2, (3e-3, 1e-3), (5e-4, 1e-5))
    _steady(ctl2, 64, 0, tokens=64, seconds=0.1)
    assert ctl2.choose_k(64) == 0  # the model says off, nothing speculative measured: off
    _, best_pos = ctl2._model_choice(64)
    _steady(ctl2, 64, best_pos, tokens=100, seconds=0.1)
    # Off was measured before the candidate: measured again first, then the candidate.
    ks, _ = _run(ctl2, 64, lambda k: (100 if k else 64, 0.1), 8)
    assert ks == [0] * 5 + [best_pos] * 3


def test_one_slow_step_does_not_decide():
    """A step that took several times the usual (the process was descheduled) is left out
    of the measured rate; without that it would make off look slower than speculation."""
    ctl = _optimistic(explore_every=10**9)
    k = ctl._model_choice(16)[0]
    _steady(ctl, 16, k, tokens=20, seconds=0.010, steps=8)  # 2000 tok/s speculating
    _steady(ctl, 16, 0, tokens=16, seconds=0.007, steps=7)  # ~2290 tok/s off
    _steady(ctl, 16, 0, tokens=16, seconds=0.100, steps=1)  # ... and one hiccup
    assert ctl.measured_rate(16, 0) == pytest.approx(16 / 0.007)
    assert ctl.choose_k(16) == 0


def test_a_machine_that_sped_up_meanwhile_does_not_switch_speculation_on():
    """Off measured while the machine was slow, then k measured after it sped up: k looks
    better only against the stale off. Off is measured again before switching on, and stays."""
    ctl = _optimistic(explore_every=10**9)
    model_k = ctl._model_choice(16)[0]
    slow = iter([3.0] * 5)  # the first five steps (off) run at a third of the speed

    def machine(k):
        return 16 * (1 + 0.5 * k), 0.006 * (1 + 0.6 * k) * next(slow, 1.0)  # k never pays

    ks, _ = _run(ctl, 16, machine, 40)
    n = ctl.explore_len + ctl.spec_settle_steps  # an exploration from off settles first
    assert ks[5:5 + n] == [model_k] * n and ks[5 + n:] == [0] * (35 - n)


def test_on_a_machine_where_no_k_pays_speculation_stays_off():
    """Every k is slower than off (a compute-bound target): over a long run the explorations
    cost at most a few percent of what off delivers."""
    ctl = _optimistic(explore_every=24)
    ks, rate = _run(ctl, 16, lambda k: (16 * (1 + 0.6 * k), 0.006 * (1 + k)), 2000)
    off_rate = 16 / 0.006
    assert ks.count(0) > 0.95 * len(ks) and rate > 0.97 * off_rate


def test_explorations_that_cost_come_rarely_enough_to_stay_within_the_budget():
    """Every switch from off to a k costs a catch-up of ten off steps (the draft replays what
    was generated meanwhile): the explorations of k wait long enough that over a long run
    they cost about ``explore_budget`` of the time, not the ~40% that one every 24 steps would."""
    ctl = _optimistic(explore_every=24, max_backoff=1)  # no doubling: the budget alone spaces them
    prev = [0]

    def machine(k):
        catch_up = 0.060 if k and not prev[0] else 0.0
        prev[0] = k
        return 16 * (1 + 0.5 * k), 0.006 * (1 + 0.5 * k) + catch_up  # k alone breaks even

    ks, rate = _run(ctl, 16, machine, 4000)
    switches = sum(1 for a, b in itertools.pairwise(ks) if a == 0 and b != 0)
    assert switches < 4000 * 0.006 * 0.03 / 0.060  # each costs 60 ms of a 24 s run: at most 3% of it
    assert rate > 0.96 * 16 / 0.006


def test_an_admission_inside_an_exploration_is_not_its_cost():
    """A step that admits a request (its prompt's prefill, paid whatever k is) reported while an
    exploration is costed does not count toward that exploration's cost: the bucket's next
    exploration is spaced by what its decode steps cost, not pushed thousands of steps away."""
    def explore_with(admission_s):
        ctl = _optimistic(explore_every=24)
        _steady(ctl, 1, 0, tokens=1, seconds=0.001, steps=40)  # off measured
        bkt = ctl.bucket(1)
        ctl._decided[bkt] = 0
        ctl._explore(2, bkt, 1)  # an exploration of k = 2, costed against off
        ctl.observe_throughput(1, 0.001, 1, 2, False)  # the report that is still the previous step's
        ctl.observe_throughput(1, admission_s, 1, 2, False, decode_only=False)  # a request admitted
        for _ in range(ctl.explore_len + 1):
            ctl.observe_throughput(2, 0.0012, 1, 2, True)  # its decode steps: 2 tokens in 1.2 ms
        return ctl._min_interval.get(bkt, 0)

    assert explore_with(0.2) == explore_with(0.001) == 0  # its decode steps beat off: nothing to pay back


def test_explorations_take_turns_and_last_several_steps():
    ctl = _optimistic(explore_every=5, explore_len=3)
    ks, _ = _run(ctl, 1, lambda k: (1 + 0.9 * k, 0.005 + 0.0002 * k), 60)  # speculating pays
    model_k = ctl._model_choice(1)[0]
    assert model_k >= 4
    # An exploration of speculation off, three steps long, after the first measurements.
    assert any(ks[i:i + 3] == [0, 0, 0] for i in range(10, len(ks) - 2))
    assert ks.count(model_k) > len(ks) // 2


def test_explorations_back_off_where_they_keep_confirming_off():
    ctl = _optimistic(explore_every=6, explore_len=3, max_backoff=4)
    assert ctl._model_choice(16)[0] > 0
    _steady(ctl, 16, ctl._model_choice(16)[0], tokens=16, seconds=0.02)  # measured: speculating is slow
    _steady(ctl, 16, 0, tokens=16, seconds=0.008)
    ks = [ctl.choose_k(16) for _ in range(200)]
    assert ks.count(0) > 150
    assert ctl._backoff[ctl.bucket(16)] == 4  # explorations now come 4x less often in this bucket
    explored = sum(1 for a, b in itertools.pairwise(ks) if a == 0 and b != 0)
    assert explored <= 200 // (6 * 2) + 2


def test_a_lookups_bucket_comes_back_soon_when_its_text_starts_repeating(engine_cache):
    """A lookup has no catch-up, so its confirmed-off buckets back off to a few intervals only
    (a draft model's may back off for good): after a long stretch where every k lost (drafts
    rejected), a text where drafts pay is found within about a thousand steps (the rate windows
    need several explorations to forget the stretch before). The engines set it by their
    proposer: suffix decoding the lookup's cap, a draft model the long one."""
    def run(max_backoff):
        ctl = _optimistic(explore_every=24, max_backoff=max_backoff)
        _run(ctl, 16, lambda k: (16, 0.006 * (1 + 0.3 * k)), 3000)  # drafts rejected: k only costs
        ks, _ = _run(ctl, 16, lambda k: (16 * (1 + 0.9 * k), 0.006 * (1 + 0.3 * k)), 2000)  # now k pays
        return ks

    assert sum(k > 0 for k in run(AdaptiveSpeculation.LOOKUP_MAX_BACKOFF)[-1000:]) > 900
    assert sum(k > 0 for k in run(1024)[-1000:]) < 100  # backed off 64x by then: no exploration came
    suffix = engine_cache(speculative_method="suffix")
    assert suffix.engine.core.scheduler.speculation.max_backoff == AdaptiveSpeculation.LOOKUP_MAX_BACKOFF


def test_a_steps_throughput_counts_for_the_k_it_ran_with():
    """The engine learns a step's whole cost after the next step's k is chosen (it is handed
    over with the next update): the sample must count for the k the step ran with."""
    ctl = AdaptiveSpeculation(k_max=6, explore_every=10**9, spec_settle_steps=0)
    ctl._set(3, 4)
    ctl._set(3, 4)
    measured = ctl.last_round  # step N: 4 decoding, k 3, steady
    ctl._set(0, 4)  # step N + 1, chosen before step N's cost is known
    ctl.observe_throughput(12, 0.01, *measured)
    assert list(ctl.rates[(ctl.bucket(4), 3)].steps) == [(12, 0.01, 0, 0)] and (ctl.bucket(4), 0) not in ctl.rates


def _measured(b, rates_by_k, objective="goodput", model_says_off=False, **slo):
    """A controller that has measured (tokens, seconds) a step for each k at batch b (its
    cost model says speculate, or with ``model_says_off`` says off: then no k is explored
    on the model's word)."""
    from tailserve.config import SloBounds

    ctl = AdaptiveSpeculation(k_max=6, explore_every=10**9, objective=objective, slo=SloBounds(**slo))
    for _ in range(40):
        ctl.observe_round(1 if model_says_off else 4, 4, cap=6)
    _feed_costs(ctl, (3e-3, 1e-3) if model_says_off else (3e-3, 1e-7), (5e-4, 1e-5) if model_says_off else (5e-4, 1e-7))
    assert (ctl._model_choice(b)[0] == 0) == model_says_off
    # Off last: switching on needs off measured after the candidates.
    for k, (tokens, seconds) in sorted(rates_by_k.items(), reverse=True):
        _steady(ctl, b, k, tokens=tokens, seconds=seconds)
    ctl._set(0, b)
    return ctl


def test_goodput_drops_speculation_when_its_longer_step_would_cost_a_waiting_request_its_ttft():
    """k = 3 makes 1.4x the tokens/s at batch 1 but a 2.5x longer step. A queued request
    with 8 ms of TTFT budget left misses it with k = 3 only: two requests in bound at off
    beat one at 1.4x the rate, so goodput runs off; throughput runs k = 3; without anyone
    waiting goodput agrees with throughput."""
    from tailserve.speculative.adaptive import SloState

    steps = {0: (1, 0.005), 3: (3.5, 0.0125)}  # 200 and 280 tok/s
    state = SloState(decode_elapsed_s=(0.1,), decode_tokens=(20,), waiting_ages_s=(0.492,))
    thr = _measured(1, steps, objective="throughput", ttft_s=0.5)
    assert thr.choose_k(1, state) == 3
    good = _measured(1, steps, ttft_s=0.5)
    assert good.choose_k(1, state) == 0 and good.num_goodput_overrides == 1
    assert good.goodput(1, 0, state) == pytest.approx(2 * 200) and good.goodput(1, 3, state) == pytest.approx(280)
    alone = _measured(1, steps, ttft_s=0.5)
    assert alone.choose_k(1, SloState((0.1,), (20,), ())) == 3 and alone.num_goodput_overrides == 0


def test_goodput_speculates_for_a_request_at_its_tpot_bound_where_throughputs_margin_stays_off():
    """k = 2 is 5% faster than off at batch 4: below the 7% that throughput asks before it
    switches on. One request's TPOT so far sits at its 5 ms bound: off (5 ms a token) pushes
    it over, k = 2 (4.76 ms) keeps it within, so goodput speculates. With every request well
    within the bound, goodput keeps throughput's choice."""
    from tailserve.speculative.adaptive import SloState

    # 5 and 4.76 ms a token a request; k = 1 measured below off, so the cost model, calibrated
    # by it, proposes no other k to explore.
    steps = {0: (4, 0.005), 1: (5.5, 0.0075), 2: (8.4, 0.010)}
    at_bound = SloState(decode_elapsed_s=(0.2, 0.2, 0.2, 0.0504), decode_tokens=(100, 100, 100, 10))
    thr = _measured(4, steps, objective="throughput", model_says_off=True, tpot_s=0.005)
    assert thr.choose_k(4, at_bound) == 0
    good = _measured(4, steps, model_says_off=True, tpot_s=0.005)
    assert good.choose_k(4, at_bound) == 2
    within = SloState(decode_elapsed_s=(0.2, 0.2, 0.2, 0.02), decode_tokens=(100, 100, 100, 10))
    good = _measured(4, steps, model_says_off=True, tpot_s=0.005)
    assert good.choose_k(4, within) == 0 and good.num_goodput_overrides == 0


def test_goodput_counts_a_queued_requests_wait_for_a_slot_at_ks_rate():
    """Where the batch is full, a queued request's TTFT is its wait for a decoding request to
    finish, which a k that emits more a request shortens. The request with 8 ms of TTFT
    budget that made goodput run off in the test above cannot be admitted before the one
    decoding request's 60 tokens are out under any k: both k count one request in bound,
    so goodput keeps throughput's k = 3 (with a free slot it is admitted next step: off, as
    above). And at batch 4, where k = 2 is only 5% faster than off (throughput stays off), a
    queued request 0.197 s old meets a 0.4 s TTFT bound only at k = 2's rate: its slot frees
    after the shortest remaining request's 40 tokens, in 0.205 s at off and 0.2005 s at k = 2
    (a step included)."""
    from tailserve.speculative.adaptive import SloState

    steps = {0: (1, 0.005), 3: (3.5, 0.0125)}
    full = SloState((0.1,), (20,), (0.492,), free_slots=0, decode_remaining_tokens=(60,))
    good = _measured(1, steps, ttft_s=0.5)
    assert good.choose_k(1, full) == 3 and good.num_goodput_overrides == 0
    good = _measured(1, steps, ttft_s=0.5)
    assert good.choose_k(1, SloState((0.1,), (20,), (0.492,), free_slots=1, decode_remaining_tokens=(60,))) == 0

    steps = {0: (4, 0.005), 1: (5.5, 0.0075), 2: (8.4, 0.010)}  # 200, 183 and 210 tok/s a request
    queued = SloState((0.2,) * 4, (100,) * 4, (0.197,), free_slots=0, decode_remaining_tokens=(40, 100, 100, 100))
    thr = _measured(4, steps, objective="throughput", model_says_off=True, ttft_s=0.4)
    assert thr.choose_k(4, queued) == 0
    good = _measured(4, steps, model_says_off=True, ttft_s=0.4)
    assert good.goodput(4, 0, queued) == pytest.approx(4 * 200)
    assert good.goodput(4, 2, queued) == pytest.approx(5 * 210)
    assert good.choose_k(4, queued) == 2 and good.num_goodput_overrides == 1


def test_goodput_judges_a_preempted_request_in_the_queue_by_its_tpot():
    """A request preempted after its first token waits for a slot like a queued one, but its
    TTFT is decided: 5 s old, it missed a 0.4 s TTFT bound long ago under every k, and so
    weighed nothing. Judged by its TPOT, 10 tokens in 0.297 s since its first, it meets a
    50 ms bound only if its slot frees in 0.203 s: after the shortest remaining request's 40
    tokens, 0.205 s at off and 0.2005 s at k = 2 (a step included), so goodput takes k = 2
    where throughput (5% faster) stays off."""
    from tailserve.speculative.adaptive import SloState

    steps = {0: (4, 0.005), 1: (5.5, 0.0075), 2: (8.4, 0.010)}  # 200, 183 and 210 tok/s a request
    decoding = dict(decode_elapsed_s=(0.2,) * 4, decode_tokens=(100,) * 4, free_slots=0,
                    decode_remaining_tokens=(40, 100, 100, 100))
    preempted = SloState(**decoding, waiting_ages_s=(5.0,), waiting_decoded=((0.297, 10),))
    good = _measured(4, steps, model_says_off=True, ttft_s=0.4, tpot_s=0.05)
    assert good.goodput(4, 0, preempted) == pytest.approx(4 * 200)
    assert good.goodput(4, 2, preempted) == pytest.approx(5 * 210)
    assert good.choose_k(4, preempted) == 2 and good.num_goodput_overrides == 1
    # Judged by its age, as a request without a first token, it is out of bound at every k.
    aged = SloState(**decoding, waiting_ages_s=(5.0,))
    good = _measured(4, steps, model_says_off=True, ttft_s=0.4, tpot_s=0.05)
    assert good.choose_k(4, aged) == 0 and good.num_goodput_overrides == 0


def test_goodput_charges_a_k_what_it_adds_to_admission_steps():
    """Steps that admit a request cost k = 3 10 ms more than off (the draft's prefill): the
    goodput figures spread that over k's tokens at the bucket's admissions per token, as the
    throughput objective's rate does, so k = 3's tokens/s a request falls and off's stays."""
    from tailserve.speculative.adaptive import SloState

    ctl = _measured(1, {0: (1, 0.005), 3: (3.5, 0.0125)}, tpot_s=0.05)
    state = SloState((0.1,), (20,), ())
    off, on = ctl.goodput(1, 0, state), ctl.goodput(1, 3, state)
    assert off == pytest.approx(200) and on == pytest.approx(280)
    for k, seconds in ((3, 0.030), (0, 0.020)) * 3:  # admission steps: k = 3 10 ms dearer
        ctl.observe_throughput(1, seconds, 1, k, True, decode_only=False, propose_s=0.004 if k else 0.0)
    adm = ctl._admissions[ctl.bucket(1)]
    per_token_s = adm.admissions / adm.tokens * 0.010
    assert per_token_s > 0
    assert ctl.goodput(1, 0, state) == pytest.approx(off)
    assert ctl.goodput(1, 3, state) == pytest.approx(3.5 / (0.0125 + 3.5 * per_token_s))


def test_goodput_of_a_k_never_measured_here_is_unknown():
    from tailserve.speculative.adaptive import SloState

    ctl = _measured(1, {0: (1, 0.005)}, ttft_s=0.001)
    assert ctl.goodput(1, 3, SloState((0.1,), (20,), (1.0,))) is None


def test_a_k_measured_badly_once_is_measured_again_while_off():
    """The model's k had one bad window (a slow stretch of the machine) and speculation went
    off. The explorations while off measure that k again rather than another one, so once it
    pays it is switched back on; a stale window must not keep it off for good."""
    ctl = _optimistic(explore_every=10)
    model_k = ctl._model_choice(1)[0]
    _steady(ctl, 1, model_k, tokens=1 + model_k, seconds=0.1)  # 1 + k tokens in 100 ms: bad
    _steady(ctl, 1, 0, tokens=1, seconds=0.005)
    ctl._decided[ctl.bucket(1)] = 0
    ks, _ = _run(ctl, 1, lambda k: (1 + 0.8 * k, 0.005 + 0.0005 * k), 300)  # every k pays now
    assert sum(1 for k in ks[-100:] if k > 0) > 80


def test_a_rounds_accepted_drafts_count_at_their_expectation():
    """How many drafts a round accepts varies from 0 to k; a window's rate counts each round
    at the acceptance figures' expectation, so two windows of the same steps that differ
    only in their luck measure the same rate. Without rounds reported, tokens count as they
    came."""
    lucky, unlucky = (AdaptiveSpeculation(k_max=4, spec_settle_steps=0) for _ in range(2))
    for ctl in (lucky, unlucky):
        for accepted in (0, 4) * 20:
            ctl.observe_round(accepted, 4, cap=4)
        ctl._set(4, 1)
        ctl._set(4, 1)
    expected = lucky.expected_accepted(4)
    assert 1.5 < expected < 2.5
    for _ in range(4):
        lucky.observe_throughput(5, 0.01, *lucky.last_round, num_rounds=1, num_accepted=4)
        unlucky.observe_throughput(1, 0.01, *unlucky.last_round, num_rounds=1, num_accepted=0)
    assert lucky.measured_rate(1, 4) == pytest.approx(unlucky.measured_rate(1, 4))
    assert lucky.measured_rate(1, 4) == pytest.approx((1 + expected) / 0.01)
    plain = AdaptiveSpeculation(k_max=4)
    _steady(plain, 1, 4, tokens=5, seconds=0.01)
    assert plain.measured_rate(1, 4) == pytest.approx(500)


def test_admission_steps_are_charged_apart_from_the_windows():
    """A step that admits a request (prompt tokens in it) stays out of k's window; what its
    proposal took (the draft's prefill of the prompt) is charged to k's rate at the bucket's
    admissions per token. Off pays the target's prefill like every k: nothing is charged."""
    ctl = AdaptiveSpeculation(k_max=4, spec_settle_steps=0)
    for k in (0, 2):
        ctl._set(k, 1)
        ctl._set(k, 1)
        for _ in range(9):
            ctl.observe_throughput(3 if k else 1, 0.006 if k else 0.003, *ctl.last_round)
        ctl.observe_throughput(1, 0.030, *ctl.last_round, decode_only=False, propose_s=0.010 if k else 0.0)
    assert ctl.measured_rate(1, 0) == pytest.approx(1 / 0.003)
    tokens = 9 * 1 + 1 + 9 * 3 + 1  # every step's tokens, both k's: the workload's mix
    per_token = 0.006 / 3 + 2 / tokens * 0.010
    assert ctl.measured_rate(1, 2) == pytest.approx(1 / per_token)
    # With a few admission steps on both sides, the charge is the difference of their
    # medians: everything a k adds to such a step, the verify rows beside the prompt too.
    for k, seconds in ((0, 0.030), (0, 0.031), (2, 0.050), (2, 0.052)):
        ctl._set(k, 1)
        ctl.observe_throughput(1, seconds, *ctl.last_round, decode_only=False, propose_s=0.010 if k else 0.0)
    per_token = 0.006 / 3 + 6 / (tokens + 4) * (0.050 - 0.030)
    assert ctl.measured_rate(1, 2) == pytest.approx(1 / per_token)


def test_an_admissions_charge_compares_steps_of_as_many_computed_tokens():
    """Off's admission steps came from cached prompts (a few tokens computed, 2 ms), k's from
    new ones (60-90 tokens, 8-11 ms, 1 ms of it the draft's prefill): what k is charged an
    admission is its steps beyond off's line through tokens -> seconds (0.1 ms a token here),
    1 ms, not the 7 ms between the two sides' medians."""
    ctl = AdaptiveSpeculation(k_max=4, spec_settle_steps=0)
    for computed, seconds in ((4, 0.0024), (6, 0.0026), (5, 0.0025), (70, 0.0090)):
        ctl._set(0, 1)
        ctl.observe_throughput(1, seconds, *ctl.last_round, decode_only=False, computed_tokens=computed)
    for computed in (60, 75, 90):
        ctl._set(2, 1)
        ctl.observe_throughput(1, 0.002 + 0.0001 * computed + 0.001, *ctl.last_round, decode_only=False,
                               propose_s=0.001, computed_tokens=computed)
    assert ctl._admissions[ctl.bucket(1)].extra_s() == pytest.approx(0.001)


def test_a_cold_controller_does_not_explore_the_models_k_after_k1_measured_below_off():
    """The cost model leaves out what drafts cost besides the forwards (the rejection
    sampler, bookkeeping): it says k = 2 at batch 4, where every k is slower than off. After
    the cold start's k = 1 measured below off, the model calibrated by it proposes nothing
    more, and the run stays off."""
    ctl = AdaptiveSpeculation(k_max=6, explore_every=10**9)
    for accepted, count in ((0, 16), (1, 10), (2, 6), (3, 4), (4, 6)):  # about 60% acceptance
        for _ in range(count):
            ctl.observe_round(accepted, 4, cap=4)
    for n in (1, 4, 16):
        ctl.target_cost.observe(n, 3e-3 + 1e-7 * n)

    def machine(k):
        if k:  # the engine reports the draft's forwards with the proposal
            ctl.draft_cost.observe(4, 5e-4)
        return 4 * (1 + 0.5 * min(k, 2)), 0.004 * (1 + 0.67 * k)  # k = 1: 0.9x off, then worse

    ks, _ = _run(ctl, 4, machine, 200)
    assert ctl._model_choice(4)[0] == 0
    uncalibrated = AdaptiveSpeculation(k_max=6)
    uncalibrated._all_round_figures = ctl._all_round_figures
    uncalibrated.target_cost, uncalibrated.draft_cost = ctl.target_cost, ctl.draft_cost
    assert uncalibrated._model_choice(4)[0] > 1
    n = ctl.explore_len + ctl.spec_settle_steps  # an exploration from off settles first
    assert ks[:5 + n] == [0] * 5 + [1] * n  # off measured first, then the draft's cost at k = 1
    assert ks[5 + n:] == [0] * (195 - n)


def test_an_exploration_ends_when_the_batch_moves_to_another_bucket():
    """An exploration of k = 2 begun at batch 1 (the last request of a load) is not carried
    over to the next load's batch of 4: that bucket decides for itself (here: the model's
    k, not measured there yet)."""
    ctl = _optimistic(explore_every=10**9)
    _steady(ctl, 4, 0, tokens=4, seconds=0.004)
    ctl._decided[ctl.bucket(4)] = 0
    ctl._explore(2, ctl.bucket(1), 1)
    assert ctl.choose_k(1) == 2  # the exploration goes on in its bucket
    model_k = ctl._model_choice(4)[0]
    assert model_k not in (0, 2)
    assert ctl.choose_k(4) == model_k


def test_a_held_decision_reads_no_window():
    """While a bucket's decision holds (``decide_every`` steps), choosing k reads no measured
    rate: re-summing off's window each step cost ~35 us, 2.5% of a 1.4 ms batch-4 step on an
    AVX-512 CPU, paid with speculation off. The held k is still the one decided, and the
    exploration that falls due inside the hold still comes."""
    ctl = AdaptiveSpeculation(k_max=4, explore_every=20, decide_every=8)
    _feed_costs(ctl, (3e-3, 1e-7), (5e-4, 1e-7))
    _steady(ctl, 4, 0, tokens=4, seconds=0.004)
    _steady(ctl, 4, 1, tokens=6, seconds=0.009)  # k = 1 measured well below off
    reads = []
    measured_rate = ctl.measured_rate
    ctl.measured_rate = lambda b, k: reads.append(k) or measured_rate(b, k)
    assert ctl.choose_k(4) == 0  # decided afresh: reads the windows
    assert reads
    reads.clear()
    assert [ctl.choose_k(4) for _ in range(7)] == [0] * 7
    assert reads == []  # held: nothing read
    ks = [ctl.choose_k(4) for _ in range(20)]
    assert 1 in ks  # the periodic exploration (of the best measured k, while off) came when due


def test_where_k_0_stands_one_decode_step_in_eight_is_reported_and_stands_for_the_rest():
    """A held k = 0 (or a ruled-out bucket, or no k fitting the rows) needs no step measured:
    one decode step in ``quiet_report_every`` is reported (``last_round``), the others are not
    (None), and the reported one stands for them: the bucket's tokens per admission and its
    time count them, and off's window keeps them one stretch. A step with prompt tokens is
    always reported, and a held k > 0 is never quiet."""
    ctl = AdaptiveSpeculation(k_max=4, explore_every=10**9, decide_every=8, quiet_report_every=8)
    _feed_costs(ctl, (3e-3, 1e-7), (5e-4, 1e-7))
    _steady(ctl, 4, 1, tokens=6, seconds=0.009)  # k = 1 measured well below off
    _steady(ctl, 4, 0, tokens=4, seconds=0.004)
    bkt = ctl.bucket(4)
    tokens_before = ctl._admissions[bkt].tokens
    reported, rounds = [], []
    for _ in range(64):
        k = ctl.choose_k(4)
        rounds.append(ctl.last_round)
        if ctl.last_round is not None:
            reported.append(k)
            ctl.observe_throughput(4, 0.004, *ctl.last_round)
    assert set(reported) == {0}
    assert 6 <= len(reported) <= 12 and sum(r is None for r in rounds) >= 52  # about 1 in 8
    assert ctl.num_quiet_steps == sum(r is None for r in rounds)
    # Every step's 4 tokens counted, reported or not (those since the last report: pending).
    pending_tokens = ctl._skipped.get(bkt, [0, 0])[1]
    assert ctl._admissions[bkt].tokens - tokens_before + pending_tokens == 4 * 64
    off = ctl.rates[(bkt, 0)]
    assert off.run >= len(reported)  # one stretch of off, quiet steps and all
    # A step with prompt tokens (an admission) is reported, quiet or not.
    assert all(ctl.choose_k(4, decode_only=False) == 0 and ctl.last_round is not None for _ in range(16))
    # A held k > 0 is never quiet.
    on = _optimistic(explore_every=10**9)
    ks, _ = _run(on, 1, lambda k: (1 + k, 0.005 + 0.0005 * k), 40)  # speculating pays
    assert ks[-1] > 0 and on.num_quiet_steps < 10  # only off's first steps were quiet
    quiet = on.num_quiet_steps
    for _ in range(16):
        assert on.choose_k(1) == ks[-1] and on.last_round is not None
    assert on.num_quiet_steps == quiet


def test_quiet_steps_stretch_a_held_k_0_over_its_reported_steps():
    """A k = 0 decision holds for ``decide_every`` reported steps: decided afresh on windows
    that quiet steps left unchanged it would decide the same, and a decision reads every
    window (~100 us after a forward on 2 AVX2 cores)."""
    ctl = AdaptiveSpeculation(k_max=4, explore_every=10**9, decide_every=8, quiet_report_every=8)
    _feed_costs(ctl, (3e-3, 1e-7), (5e-4, 1e-7))
    _steady(ctl, 4, 1, tokens=6, seconds=0.009)
    _steady(ctl, 4, 0, tokens=4, seconds=0.004)
    reads = []
    measured_rate = ctl.measured_rate
    ctl._measured_rates = lambda b, cap: reads.append(b) or {k: r for k in range(cap + 1)
                                                             if (r := measured_rate(b, k)) is not None}
    for _ in range(64):
        ctl.choose_k(4)
        if ctl.last_round is not None:
            ctl.observe_throughput(4, 0.004, *ctl.last_round)
    assert 1 <= len(reads) <= 2  # every 8 steps before: 8


def ceiling(profile: VerifyCostProfile, *args, **kwargs) -> float | None:
    """The bound's speed-up alone (``best_k``'s second figure; None where not profiled)."""
    best = profile.best_k(*args, **kwargs)
    return None if best is None else best[1]


def _linear_rows_profile(b: int, per_k: float, draft_per_k: float, k_max: int) -> VerifyCostProfile:
    """Verification at b requests where each k adds ``per_k`` of a 1 ms forward, and each
    draft ``draft_per_k`` ms of the proposal."""
    return VerifyCostProfile(tuple((b, k, 1e-3 * (1 + per_k * k)) for k in range(k_max + 1)),
                             tuple((b, k, 1e-3 * draft_per_k * k) for k in range(1, k_max + 1)))


def test_the_ceiling_is_the_geometric_speed_up_on_the_profiled_costs():
    """Verification free at batch 1, drafts at 0.1 ms each, off step 1.2 ms of which 1 ms is the
    forward: k = 2 with every draft accepted gives 3 tokens in 1.4 ms."""
    profile = _linear_rows_profile(1, 0.0, 0.1, 2)
    assert ceiling(profile, 1, 1.2e-3, 1e-3) == pytest.approx(3 * 1.2 / 1.4)
    assert ceiling(profile, 1, 1.2e-3, 1e-3, acceptance=0.5) == pytest.approx(expected_tokens(0.5, 2) * 1.2 / 1.4)
    # The engine runs twice as slow as the profile: the profiled costs scale with it.
    assert ceiling(profile, 1, 2.2e-3, 2e-3) == pytest.approx(3 * 2.2 / (0.2 + 2 * 1.2))
    assert ceiling(profile, 4, 1.2e-3, 1e-3) is None  # not profiled
    # Sampled requests take their own costs where profiled (a dearer verification here).
    both = VerifyCostProfile(profile.target_s, profile.draft_s, ((1, 0, 1e-3), (1, 1, 1.5e-3), (1, 2, 2e-3)),
                             ((1, 1, 0.1e-3), (1, 2, 0.2e-3)))
    assert ceiling(both, 1, 1.2e-3, 1e-3, greedy=False) == pytest.approx(max(2 * 1.2 / 1.8, 3 * 1.2 / 2.4))
    assert ceiling(both, 1, 1.2e-3, 1e-3, greedy=True) == pytest.approx(3 * 1.2 / 1.4)
    # Each k adds a whole forward and its drafts: at best even with off (k = 1, all accepted),
    # and below it at any lower acceptance.
    assert ceiling(_linear_rows_profile(4, 1.0, 0.1, 3), 4, 1.1e-3, 1e-3) == pytest.approx(1.0)
    assert ceiling(_linear_rows_profile(4, 1.0, 0.1, 3), 4, 1.1e-3, 1e-3, acceptance=0.9) == 1.0


def _profiled(profile: VerifyCostProfile, **kw) -> AdaptiveSpeculation:
    ctl = AdaptiveSpeculation(k_max=3, explore_every=24, cost_profile=profile, **kw)
    _feed_costs(ctl, (1e-3, 0.0), (1e-4, 0.0))  # the forward the profile measured: 1 ms
    return ctl


def test_a_bucket_where_no_k_could_pay_is_never_explored():
    """Rows cost linearly past the batch (each k adds a forward): even an acceptance of 0.9
    cannot beat off by the switch-on margin, so after off's first measurements the controller
    stays at k = 0 without one exploration and stops keeping windows there. The same
    controller with free verification explores."""
    ctl = _profiled(_linear_rows_profile(4, 1.0, 0.05, 3))
    ks, _ = _run(ctl, 4, lambda k: (4 * (1 + 0.9 * k), 1.1e-3 * (1 + k)), 400)
    assert ks == [0] * 400
    assert ctl.bucket(4) in ctl.ruled_out
    assert len(ctl.rates[(ctl.bucket(4), 0)].steps) < 10  # no bookkeeping after the verdict
    ctl = _profiled(_linear_rows_profile(4, 0.0, 0.05, 3))
    ks, _ = _run(ctl, 4, lambda k: (4 * (1 + 0.9 * k), 1.1e-3 * (1 + 0.1 * k)), 400)
    assert any(ks) and not ctl.ruled_out


def test_a_ruled_out_bucket_returns_when_acceptance_measured_elsewhere_is_higher():
    """Ruled out at the optimistic 0.9 (the ceiling there 1.045x, 1.16x at 1.0); rounds verified
    at another batch size then accept every draft, and the bucket is weighed again: explored."""
    ctl = _profiled(_linear_rows_profile(4, 0.85, 0.05, 3))
    machine = lambda k: (4 * (1 + k), 1.1e-3 + 0.95e-3 * k)  # noqa: E731 (every draft accepted)
    ks, _ = _run(ctl, 4, machine, 40)
    assert ks == [0] * 40 and ctl.bucket(4) in ctl.ruled_out
    for _ in range(16):  # rounds elsewhere (batch 1, one a step) that reject every draft: weighed once, still out
        ctl._steps += 1
        ctl.observe_round(0, 3, cap=3)
    assert _run(ctl, 4, machine, 4)[0] == [0] * 4 and ctl.ruled_out[ctl.bucket(4)] == ctl._rounds_verified
    for _ in range(120):  # then rounds that accept every draft, long enough to outweigh those
        ctl._steps += 1
        ctl.observe_round(3, 3, cap=3)
    ks, _ = _run(ctl, 4, machine, 40)
    assert any(ks) and ctl.bucket(4) not in ctl.ruled_out


def test_off_steps_right_after_drafts_stay_out_of_offs_window():
    """Off's first steady steps after speculation ran slower than its later ones: they are not
    off's rate. The steps of a stretch are reported one per step, as the engine does."""
    ctl = AdaptiveSpeculation(k_max=4)
    for step_s in (2e-3, 2e-3):  # two steps with drafts
        ctl._steps += 1
        ctl._set(2, 1)
        ctl.observe_throughput(3, step_s, *ctl.last_round)
    for step_s in (5e-3, 1.5e-3, 1.2e-3, 1e-3, 1e-3, 1e-3):  # then off, settling
        ctl._steps += 1
        ctl._set(0, 1)
        ctl.observe_throughput(1, step_s, *ctl.last_round)
    window = ctl.rates[(ctl.bucket(1), 0)]
    assert [s[1] for s in window.steps] == [1e-3, 1e-3, 1e-3]
    # Off explored while speculating lasts those steps longer than another k's exploration.
    ctl._decided[ctl.bucket(1)] = 2
    ctl._explore(0, ctl.bucket(1), 1)
    assert ctl._explore_left == ctl.explore_len - 1 + ctl.off_settle_steps


def test_the_ceiling_anchored_on_a_measured_step_takes_its_cost_besides_the_profile():
    """A k = 1 step measured at 2 ms where the profile puts it at 1.3 (0.2 ms besides a 1 ms
    forward + 0.1 ms drafts): every k then costs 0.7 ms more than profiled."""
    profile = _linear_rows_profile(1, 0.0, 0.1, 2)
    unanchored = ceiling(profile, 1, 1.2e-3, 1e-3)
    assert unanchored == pytest.approx(3 * 1.2 / 1.4)
    anchored = ceiling(profile, 1, 1.2e-3, 1e-3, measured={1: 2e-3})
    assert anchored == pytest.approx(max(2 * 1.2 / 2.0, 3 * 1.2 / 2.1))
    # The anchor's k was not profiled: the profile alone.
    assert ceiling(profile, 1, 1.2e-3, 1e-3, measured={5: 2e-3}) == pytest.approx(unanchored)
    # A profiled k = 1 that read slow (5 ms: a thread waking late) against its 2 ms measured
    # step: nothing besides the forward and drafts is left, not less than nothing, so k = 2
    # costs what the profile says (1.2 ms), not a negative time and a bound in the millions.
    slow_k1 = VerifyCostProfile(((1, 0, 1e-3), (1, 1, 5e-3), (1, 2, 1e-3)), ((1, 1, 1e-4), (1, 2, 2e-4)))
    assert ceiling(slow_k1, 1, 1.2e-3, 1e-3, measured={1: 2e-3}) == pytest.approx(3 * 1.2 / 1.2)


def test_a_bucket_whose_measured_k_costs_more_than_profiled_is_ruled_out():
    """The profile says k = 2 could reach 2x off (drafts and verification nearly free), but
    the engine measures a k = 1 step at 2.2x an off step (its bookkeeping, the draft evicting
    the target's weights): anchored there no k can pay, and the bucket is ruled out after the
    exploration that measured it, not explored again."""
    ctl = _profiled(_linear_rows_profile(1, 0.05, 0.05, 3))
    machine = lambda k: (1 + 0.6 * k, 1e-3 * (1 + 1.2 * k))  # noqa: E731
    ks, _ = _run(ctl, 1, machine, 600)
    assert ctl.bucket(1) in ctl.ruled_out
    first_off = max(i for i, k in enumerate(ks) if k)  # the last step with drafts
    assert first_off < 60 and not any(ks[first_off + 1:])


def test_drafts_first_steps_after_off_stay_out_of_ks_window():
    """After off, k's first steady steps ran slower than its later ones: they are not k's rate;
    a stretch of k right after another k > 0 settles no longer. An exploration of k > 0 from
    off lasts those steps longer."""
    ctl = AdaptiveSpeculation(k_max=4)
    for step_s in (1e-3, 1e-3):  # off
        ctl._steps += 1
        ctl._set(0, 1)
        ctl.observe_throughput(1, step_s, *ctl.last_round)
    for step_s in (5e-3, 2e-3, 1.8e-3, 1.5e-3, 1.5e-3, 1.5e-3):  # then k = 2, settling
        ctl._steps += 1
        ctl._set(2, 1)
        ctl.observe_throughput(3, step_s, *ctl.last_round)
    assert [s[1] for s in ctl.rates[(ctl.bucket(1), 2)].steps] == [1.5e-3] * 3
    for step_s in (1.6e-3, 1.6e-3):  # k = 3 right after k = 2: only the unsteady first left out
        ctl._steps += 1
        ctl._set(3, 1)
        ctl.observe_throughput(4, step_s, *ctl.last_round)
    assert [s[1] for s in ctl.rates[(ctl.bucket(1), 3)].steps] == [1.6e-3]
    ctl._set(0, 1)
    ctl._explore(2, ctl.bucket(1), 1)
    assert ctl._explore_left == ctl.explore_len - 1 + ctl.spec_settle_steps


def test_a_buckets_first_exploration_with_drafts_waits_until_the_run_can_pay_for_it():
    """By the profile, a first exploration of k = 1 costs 7 steps x 0.1 ms of drafts plus the
    draft's catch-up over 500 context tokens at 10 us each: 5.7 ms, which at a 1% budget needs
    a 0.57 s horizon (6.4 ms and 0.64 s for k = 2). Requests with 128 tokens left (0.14 s at
    1.1 ms a step) stay off without exploring, though speculation would pay; with 4,000 tokens
    left the bucket explores at once; short requests one after another explore once the
    bucket's own time covers it."""
    profile = replace(_linear_rows_profile(1, 0.0, 0.1, 2), catch_up_s_per_token=1e-5)
    assert profile.first_exploration_s(1, 1, 1e-3, True, 7, 500) == pytest.approx(7 * 0.1e-3 + 5e-3)
    machine = lambda k: (1 + 0.9 * k, 1.1e-3 + 0.1e-3 * k)  # noqa: E731 (drafts pay)
    short = lambda: BatchOutlook(remaining_tokens=128, unseen_tokens=500)  # noqa: E731
    ctl = _profiled(profile)
    ks, _ = _run(ctl, 1, machine, 128, outlook=short)
    assert ks == [0] * 128 and ctl.num_first_explorations_waited > 0
    assert not ctl.ruled_out  # not ruled out: put off
    ctl = _profiled(profile)
    ks, _ = _run(ctl, 1, machine, 40, outlook=lambda: BatchOutlook(remaining_tokens=4000, unseen_tokens=500))
    assert any(ks[:20]) and ctl.num_first_explorations_waited == 0
    ctl = _profiled(profile)
    ks, _ = _run(ctl, 1, machine, 1000, outlook=short)
    first = next(i for i, k in enumerate(ks) if k)
    # (k = 1's cost, or the bound's best k = 2: 6.4 ms, 6.7 at the forward the run fitted)
    assert 0.57 / 1.1e-3 <= first <= 0.67 / 1.1e-3 + ctl.explore_every + 1
    assert sum(1 for k in ks[first:] if k) > 300  # then it speculates
    # Without the scheduler's outlook (or a profile) nothing waits, as before; nor where the
    # proposer has nothing to catch up on (a lookup: its first exploration costs no more than
    # its later ones).
    ctl = _profiled(profile)
    assert any(_run(ctl, 1, machine, 40)[0][:20])
    ctl = _profiled(replace(profile, catch_up_s_per_token=0.0))
    assert any(_run(ctl, 1, machine, 40, outlook=short)[0][:20]) and ctl.num_first_explorations_waited == 0
    # Once put off, weighed again only when the bucket's own time could cover the cost (here
    # ~500 steps away), at most 4 x explore_every steps later, under either objective: each
    # weighing walks the batch's requests and the bound.
    for objective in ("throughput", "goodput"):
        calls = []
        ctl = _profiled(profile, objective=objective)
        ks, _ = _run(ctl, 1, machine, 200, outlook=lambda: calls.append(1) or short())  # noqa: B023
        assert ks == [0] * 200 and 1 <= len(calls) <= 200 // (4 * ctl.explore_every) + 2


def test_a_first_exploration_counts_the_acceptance_measured_elsewhere_and_only_unseen_tokens():
    """A batch's requests finish apart, so a warm batch-4 engine runs tails of 1-3 requests
    whose draft is in step (it drafted for them at batch 4) and whose acceptance is known.
    By the profile a first exploration of k = 1 at batch 1 adds 0.5 ms of drafts a step: 3.5 ms
    over its 7 steps, more than 1% of a 0.14 s horizon, so a cold controller puts it off. With
    this class's acceptance measured (2 of 3 drafts a round, verified elsewhere) its drafts are
    expected to save 0.67 x 1.1 ms a step, more than they add: it explores at once, unless the
    draft has 500 tokens to catch up on (5 ms at 10 us each)."""
    profile = replace(_linear_rows_profile(1, 0.0, 0.5, 2), catch_up_s_per_token=1e-5)
    machine = lambda k: (1 + 0.9 * k, 1.1e-3 + 0.5e-3 * k)  # noqa: E731 (drafts pay)

    def controller(measured: bool) -> AdaptiveSpeculation:
        ctl = _profiled(profile)
        for _ in range(40 if measured else 0):
            ctl._steps += 1
            ctl.observe_round(2, 3, cap=3)
        return ctl

    in_step = lambda: BatchOutlook(remaining_tokens=128, unseen_tokens=0)  # noqa: E731
    ctl = controller(measured=False)
    ks, _ = _run(ctl, 1, machine, 60, outlook=in_step)
    assert ks == [0] * 60 and ctl.num_first_explorations_waited > 0
    ctl = controller(measured=True)
    ks, _ = _run(ctl, 1, machine, 60, outlook=in_step)
    assert any(ks[:20]) and ctl.num_first_explorations_waited == 0
    ctl = controller(measured=True)
    ks, _ = _run(ctl, 1, machine, 60, outlook=lambda: BatchOutlook(remaining_tokens=128, unseen_tokens=500))
    assert ks == [0] * 60 and ctl.num_first_explorations_waited > 0


def test_the_bound_takes_each_measured_k_and_grows_the_rest_between_and_past_them():
    """Profiled steps 1.15, 1.2, 1.25, 1.3 ms for k = 1..4 (1 ms forward + 0.05 ms a k, no
    drafts), off 1.2 ms. Measured k = 1 at 2 ms and k = 3 at 3 ms: residuals 0.85 and 1.75
    ms; k = 2 costs its profile plus the residual halfway (1.3 ms), k = 4 plus 1.75 + 0.45
    (the growth per k between the two largest measured), the measured k what they measured."""
    profile = _linear_rows_profile(1, 0.05, 0.0, 4)
    measured = {1: 2e-3, 3: 3e-3}
    steps = {1: 2e-3, 2: 1.2e-3 + 1.3e-3, 3: 3e-3, 4: 1.3e-3 + 1.75e-3 + 0.45e-3}
    expected = {k: expected_tokens(0.8, k) * 1.2 / (s * 1e3) for k, s in steps.items()}
    best = max(expected, key=expected.get)
    assert profile.best_k(1, 1.2e-3, 1e-3, 0.8, measured=measured) == (best, pytest.approx(expected[best]))
    # A residual that shrinks past the measured k is not extrapolated down: the largest's holds.
    shrinking = {1: 3e-3, 3: 2e-3}
    k4 = 5 * 1.2 / (1.3 + 2.0 - 1.25)  # every draft accepted: k + 1 tokens
    assert profile.best_k(1, 1.2e-3, 1e-3, measured=shrinking) == (4, pytest.approx(k4))
    # Below the smallest measured k its residual holds; nothing beats off: (0, 1.0).
    assert profile.best_k(1, 1.2e-3, 1e-3, 0.5, measured={3: 9e-3}) == (0, 1.0)


def test_a_sampled_buckets_bound_takes_the_acceptance_of_sampled_rounds_alone():
    """Drafts cost half a forward each by the profile: at the acceptance of the sampled
    rounds (~0.2, pooled with the optimistic prior ~0.45) no k pays, at ~0.8 k = 1-3 would.
    Greedy requests accepting every draft leave the bound of a sampled bucket at its own
    rounds' acceptance: ruled out after off's first measurements. The same rounds all
    counted as sampled keep it open (explored)."""
    profile = _linear_rows_profile(1, 0.0, 0.5, 3)
    machine = lambda k: (1 + 0.25 * k, 1.1e-3 + 0.6e-3 * k)  # noqa: E731
    for greedy_counted_apart in (True, False):
        ctl = _profiled(profile)
        for i in range(200):
            ctl.observe_round(3, 3, cap=3, greedy=greedy_counted_apart)
            ctl.observe_round(1 if i % 4 == 0 else 0, 3, cap=3)
        ks, _ = _run(ctl, 1, machine, 200)
        assert (ctl.bucket(1) in ctl.ruled_out) == greedy_counted_apart
        assert any(ks) != greedy_counted_apart


def test_while_off_the_bounds_best_k_is_probed_then_ruled_out_by_its_own_step():
    """The profile makes drafts nearly free (k = 3 would pay ~2x at an optimistic acceptance)
    and the cost model makes them dear (it never proposes a k): the exploration while off
    probes the bound's k = 3 (not the cheapest, k = 1, whose measured step would leave the
    bound open at k = 3 and be explored again and again), which costs three off steps, and
    the bucket is ruled out for good."""
    profile = _linear_rows_profile(1, 0.05, 0.05, 3)
    ctl = AdaptiveSpeculation(k_max=3, explore_every=24, cost_profile=profile)
    _feed_costs(ctl, (1e-3, 0.0), (1e-3, 0.0))
    for _ in range(30):
        ctl.observe_round(2, 3, cap=3)
    machine = lambda k: (expected_tokens(0.75, k), 1.1e-3 * (1 + k) if k < 3 else 3.6e-3)  # noqa: E731
    ks, _ = _run(ctl, 1, machine, 1500)
    assert sorted(set(ks)) == [0, 3]
    assert ctl.bucket(1) in ctl.ruled_out
    last = max(i for i, k in enumerate(ks) if k)
    assert ks.index(3) < 200 and last < 300


def _drive_with_leases(ctl: AdaptiveSpeculation, phases, leases: bool):
    """Drive ``ctl`` as the engine does over ``phases`` of (batch, steps, machine), with an
    admission every 50th step: the scheduler first offers a decode-only step to
    ``take_quiet_step`` (``leases``), else calls ``choose_k``; the update then reports the
    previous step's cost and verifies its drafts (``machine(k) -> (tokens, seconds,
    accepted)``). Returns each step's k and report, and how many steps a lease took."""
    log, pending, taken, i = [], None, 0, 0
    for b, steps, machine in phases:
        for _ in range(steps):
            i += 1
            decode_only = i % 50 != 0
            if leases and decode_only and ctl.take_quiet_step(b, False):
                k, report = 0, None
                taken += 1
            else:
                k, report = ctl.choose_k(b, decode_only=decode_only), ctl.last_round
            if pending is not None:
                n, s, prev_report, prev_decode_only, prev_k, accepted = pending
                if prev_decode_only:
                    ctl.observe_step(b * (1 + prev_k), 0.8 * s, 0.2 * s)
                ctl.observe_throughput(n, s, *prev_report, decode_only=prev_decode_only)
                for _ in range(b if prev_k else 0):
                    ctl.observe_round(accepted, prev_k)
            n, s, accepted = machine(k)
            log.append((k, report))
            pending = None if report is None else (n, s, report, decode_only, k, accepted)
    return log, taken


def _controller_state(ctl: AdaptiveSpeculation) -> dict:
    if ctl._lease is not None:
        ctl._settle()
    return {"steps": ctl._steps, "quiet": (ctl._quiet_count, ctl.num_quiet_steps), "skipped": ctl._skipped,
            "since": ctl._since_explore, "held": ctl._held, "ruled_out": ctl.ruled_out, "backoff": ctl._backoff,
            "decided": ctl._decided, "k": (ctl.last_k, ctl._prev_k, ctl._last_b, ctl._unreported),
            "windows": {key: (len(w.steps), w.run) for key, w in ctl.rates.items()},
            "tokens": {b: (a.tokens, a.admissions) for b, a in ctl._admissions.items()},
            "rechecks": (ctl.num_rechecks, ctl._recheck_every, ctl._ruled_at)}


def test_quiet_steps_under_a_lease_are_the_steps_choose_k_would_have_made():
    """Where k = 0 stands, the scheduler takes the next quiet steps without a decision
    (``take_quiet_step``, ~1% of a batch-1 step on 2 AVX2 cores): every step's k and report,
    and the controller's state after, equal those of a controller that decided every step,
    across held decisions, explorations, admissions, a bucket ruled out and batch changes."""
    pays_not = lambda k: (4 * (1 + 0.5 * k), 1e-3 * (1 + k), min(k, 1))  # noqa: E731
    pays = lambda k: (1 + 0.8 * k, 1e-3 * (1 + 0.1 * k), k)  # noqa: E731
    profile = VerifyCostProfile(tuple((b, k, 1e-3 * (1 + (k if b == 4 else 0.1 * k))) for b in (1, 4)
                                      for k in range(4)),
                                tuple((b, k, 1e-4 * k) for b in (1, 4) for k in range(1, 4)))
    hard = lambda k: (1, 1e-3 * (1 + 0.1 * k), 0)  # noqa: E731 (no draft accepted: ruled out, rechecked)
    phases = [(2, 300, pays_not), (4, 400, pays_not), (1, 300, pays), (2, 500, pays_not), (1, 100, pays),
              (1, 1200, hard)]
    runs = []
    for leases in (False, True):
        ctl = AdaptiveSpeculation(k_max=3, explore_every=10, max_backoff=2, explore_budget=0.3,
                                  quiet_report_every=8, cost_profile=profile, ruled_out_recheck_steps=60,
                                  ceiling_prior_rounds=2.0)
        _feed_costs(ctl, (1e-3, 0.0), (1e-4, 0.0))
        log, taken = _drive_with_leases(ctl, phases, leases)
        runs.append((log, taken, _controller_state(ctl)))
    (log0, _, state0), (log1, taken, state1) = runs
    assert log1 == log0
    assert state1 == state0
    assert taken > 400  # many quiet steps came from a lease: not a test of choose_k alone
    assert any(k for k, _ in log1) and state1["ruled_out"]  # it speculated somewhere, ruled a bucket out
    assert state1["rechecks"][0] > 0  # and weighed a ruled-out bucket again by drafting


def test_a_ruled_out_bucket_reports_one_decode_step_in_sixty_four():
    """Where a bucket is ruled out its windows are not kept, and a report feeds only the
    target's cost model and the bucket's time: one decode step in ``ruled_out_report_every``
    (64) is reported there, against one in ``quiet_report_every`` (8) for a held k = 0; each
    reported step and the one that observes it cost ~15-25 us more after a forward."""
    ctl = _profiled(_linear_rows_profile(4, 1.0, 0.05, 3))
    _run(ctl, 4, lambda k: (4 * (1 + 0.9 * k), 1.1e-3 * (1 + k)), 100)
    assert ctl.bucket(4) in ctl.ruled_out
    reported = 0
    for _ in range(640):
        assert ctl.choose_k(4) == 0
        if ctl.last_round is not None:
            reported += 1
            ctl.observe_throughput(4, 1.1e-3, *ctl.last_round)
    assert 9 <= reported <= 11


def _one_bucket(recheck_steps: int, phases) -> tuple[AdaptiveSpeculation, list[int]]:
    """Batch 1 alone (greedy, verification nearly free by the profile): the ks of every step."""
    profile = _linear_rows_profile(1, 0.1, 0.05, 3)
    ctl = AdaptiveSpeculation(k_max=3, explore_every=24, cost_profile=profile, ruled_out_recheck_steps=recheck_steps,
                              ceiling_prior_rounds=2.0)  # the bound soon takes the measured acceptance
    _feed_costs(ctl, (1e-3, 0.0), (1e-4, 0.0))
    log, _ = _drive_with_leases(ctl, [(1, n, m) for n, m in phases], leases=True)
    return ctl, [k for k, _ in log]


def test_a_bucket_ruled_out_on_hard_text_is_weighed_again_by_drafting():
    """In a workload that runs in one bucket no round is verified elsewhere, so a bucket ruled
    out on the acceptance of hard text stayed off for good when the text turned easy (greedy
    batch 1 on the built-in pair: 1.07-1.12x of off in some runs, ruled out for good in
    others). Now it drafts again after ``ruled_out_recheck_steps``, and speculates once the
    drafts are accepted; with rechecks put off past the run, it stays off as before."""
    hard = lambda k: (1, 1e-3 * (1 + 0.1 * k), 0)  # noqa: E731 (nothing accepted)
    easy = lambda k: (1 + k, 1e-3 * (1 + 0.1 * k), k)  # noqa: E731 (everything accepted)
    ctl, ks = _one_bucket(500, [(600, hard), (3000, easy)])
    assert ctl.num_rechecks >= 1
    assert sum(k > 0 for k in ks[-1000:]) > 900  # speculating on the easy text
    ctl, ks = _one_bucket(10**9, [(600, hard), (3000, easy)])
    assert ctl.bucket(1, False) in ctl.ruled_out and not any(ks[-1000:])  # the old way: off for good


def test_rechecks_of_a_bucket_that_stays_hard_back_off_and_one_no_text_could_pay_is_never_rechecked():
    """Each recheck that rules the bucket out again doubles the wait for the next (so their
    cost shrinks as a share of the run); a bucket where even an acceptance of
    ``recheck_acceptance`` could not pay (verification as dear as a step per draft) is never
    drafted again."""
    hard = lambda k: (1, 1e-3 * (1 + 0.1 * k), 0)  # noqa: E731
    ctl, ks = _one_bucket(200, [(6000, hard)])
    assert 2 <= ctl.num_rechecks <= 6  # ~200, 400, 800, 1600, 3200 steps apart: not 30
    assert sum(k > 0 for k in ks) < 0.02 * len(ks)
    ctl = _profiled(_linear_rows_profile(4, 1.0, 0.05, 3), ruled_out_recheck_steps=50)
    ks, _ = _run(ctl, 4, lambda k: (4 * (1 + 0.9 * k), 1.1e-3 * (1 + k)), 2000)
    assert ctl.bucket(4) in ctl.ruled_out and ctl.num_rechecks == 0 and not any(ks)


def test_a_bucket_speculating_is_weighed_by_the_bound_at_the_margin_that_keeps_it_on():
    """k = 1 pays 1.43x, then its step grows until it pays 1.06x: above the 5% that keeps a
    bucket on, under the 7% that switches one on. The bound, which reads the same step at the
    same acceptance, keeps it on too (not ruled out at the switch-on margin); a cold bucket
    at 1.06x is ruled out; at 1.03x the speculating one switches off."""
    profile = _linear_rows_profile(1, 0.3, 0.05, 1)  # k = 1 adds 0.35 ms to a 1 ms forward: explored

    def controller() -> AdaptiveSpeculation:
        ctl = AdaptiveSpeculation(k_max=1, explore_every=24, cost_profile=profile)
        _feed_costs(ctl, (1e-3, 0.0), (1e-4, 0.0))
        return ctl

    def machine(k1_s):  # no round is verified: the bound assumes its prior, 0.9
        return lambda k: (1.9, k1_s) if k else (1, 1.2e-3)

    bkt = AdaptiveSpeculation.bucket(1)
    ctl = controller()
    ks, _ = _run(ctl, 1, machine(1.6e-3), 200)
    assert ks[-100:].count(1) > 80
    ks, _ = _run(ctl, 1, machine(1.9 * 1.2e-3 / 1.06), 600)
    assert ks[-200:].count(1) > 140 and bkt not in ctl.ruled_out  # on, but for its off probes
    ks, _ = _run(ctl, 1, machine(1.9 * 1.2e-3 / 1.03), 600)
    assert ks[-200:].count(1) < 20
    ctl = controller()
    ks, _ = _run(ctl, 1, machine(1.9 * 1.2e-3 / 1.06), 400)
    assert ks[-200:].count(1) < 20 and bkt in ctl.ruled_out


def test_explorations_back_off_while_they_keep_confirming_speculation_on():
    """Where speculation steadily pays, the off probes (each a stretch of slower steps, then
    the draft's catch-up) come half as often each time they confirm it, down to 1 in
    ``max_on_backoff`` x explore_every steps; when the machine turns and k loses, the bucket
    switches off and its probes of k start again at every explore_every."""
    def machine(pays):
        # Paying: k >= 2 emits 2 tokens in 1.35 off steps (1.48x); an off probe costs little.
        return (lambda k: (1 + 0.5 * min(k, 2), 0.005 * (1 + 0.35 * min(k, 2)))) if pays \
            else (lambda k: (1 + 0.1 * k, 0.005 * (1 + k)))

    def off_probes(ks):
        return sum(1 for a, b in itertools.pairwise(ks) if a > 0 and b == 0)

    probes = {}
    for cap in (1, 8):
        ctl = _optimistic(explore_every=24, max_on_backoff=cap)
        ks, _ = _run(ctl, 1, machine(True), 4000)
        assert ks[-1000:].count(0) < 200  # on
        probes[cap] = off_probes(ks[1000:])
    assert ctl._backoff[ctl.bucket(1)] == 8
    assert probes[8] * 3 < probes[1]  # 35 against 7 when written
    ks, _ = _run(ctl, 1, machine(False), 1000)  # now every k loses
    assert ks[100:].count(0) > 850 and ctl._backoff[ctl.bucket(1)] < 8


def test_while_off_the_cheaper_ks_the_bound_leaves_open_are_probed_too():
    """Off in a bucket where k = 1 and the bound's best k = 3 measured no better than off (the
    bound still open: the profile makes drafts free): the next exploration probes k = 2, the
    unmeasured k below the bound's, not the best measured one again. Built-in pair, batch 4
    greedy (2 AVX-512 cores): k = 1 and 3 read off's rate there, and k = 2, which ran 1.05x of
    off as a fixed k, was never measured."""
    ctl = AdaptiveSpeculation(k_max=3, explore_every=24, cost_profile=_linear_rows_profile(1, 0.0, 0.0, 3))
    _feed_costs(ctl, (1e-3, 0.0), (1e-4, 0.0))
    for _ in range(40):
        ctl.observe_round(3, 3, cap=3)
    for k in (0, 1, 3, 0):
        _steady(ctl, 1, k, tokens=1, seconds=1e-3, steps=8)  # every k at off's rate
    bkt = ctl.bucket(1)
    ctl._decided[bkt] = 0
    ctl._since_explore[bkt] = 10**6  # an exploration is due
    assert ctl.choose_k(1) == 2
    assert ctl._bound_k[bkt] == 3


def test_no_exploration_starts_where_the_batch_ends_before_it_would():
    """An exploration from off is due, but every request of the batch has fewer tokens left
    than the exploration lasts (the tail of a batch whose requests finished apart): the
    controller stays off and explores at the next step whose batch can finish it; the same
    for a ruled-out bucket's recheck."""
    ctl = _optimistic(explore_every=24)
    _steady(ctl, 1, 0, tokens=1, seconds=1e-3, steps=8)
    bkt = ctl.bucket(1)
    ctl._decided[bkt] = 0
    ctl._since_explore[bkt] = 10**6  # due
    ending = lambda: BatchOutlook(remaining_tokens=ctl.explore_len, unseen_tokens=0)  # noqa: E731
    fresh = lambda: BatchOutlook(remaining_tokens=128, unseen_tokens=0)  # noqa: E731
    assert [ctl.choose_k(1, outlook=ending) for _ in range(3)] == [0, 0, 0]
    assert ctl._explore_left == 0 and bkt not in ctl._drafted
    queued = lambda: BatchOutlook(remaining_tokens=2, unseen_tokens=0, num_waiting=1)  # noqa: E731
    assert ctl.choose_k(1, outlook=queued) > 0  # a request waits for the slot: the bucket goes on
    ruled = _optimistic(explore_every=24)
    _steady(ruled, 1, 0, tokens=1, seconds=1e-3, steps=8)
    ruled.ruled_out[bkt], ruled._ruled_at[bkt], ruled._recheck_every[bkt] = ruled._rounds_verified, 0, 10
    ruled._steps = 100  # the recheck is due
    assert ruled.choose_k(1, outlook=ending) == 0 and bkt in ruled.ruled_out
    assert ruled.choose_k(1, outlook=fresh) > 0 and ruled.num_rechecks == 1


def test_a_batch_that_shrinks_keeps_the_k_of_the_bucket_it_shrank_from():
    """Speculation on at batch 4; the batch's requests finish apart and it shrinks to 2, then 1
    (a closed batch's tail): those steps take batch 4's k, with no off probe or decision of
    their own, for ``drain_inherit_steps`` steps after batch 4 last decided it; then the
    smaller bucket decides for itself (cold here: off measured first). Where batch 4 decided
    off, or for the other class of requests, a smaller batch decides for itself at once."""
    pays = lambda k: (4 * (1 + 0.5 * min(k, 2)), 0.004 * (1 + 0.35 * min(k, 2)))  # noqa: E731
    loses = lambda k: (4 * (1 + 0.1 * k), 0.004 * (1 + k))  # noqa: E731
    ctl = _optimistic(explore_every=24)
    ks, _ = _run(ctl, 4, pays, 300)
    while ctl._explore_left or ks[-1] == 0:  # end on a decided k, not inside a probe
        ks += _run(ctl, 4, pays, 1)[0]
    on = ks[-1]
    assert on > 0 and ctl._on_from[0] == ctl.bucket(4)
    tail, _ = _run(ctl, 2, lambda k: (2 * (1 + 0.5 * min(k, 2)), 0.003), 8)
    tail += _run(ctl, 1, lambda k: (1 + 0.5 * min(k, 2), 0.002), ctl.drain_inherit_steps - 8)[0]
    assert tail == [on] * ctl.drain_inherit_steps and ctl.num_inherited_steps == ctl.drain_inherit_steps
    assert ctl.choose_k(1) == 0  # past the bound: batch 1's own (cold) decision
    assert ctl.choose_k(2, greedy=True) == 0  # greedy requests never took a sampled bucket's k

    off = _optimistic(explore_every=24)
    ks, _ = _run(off, 4, loses, 300)
    while off._explore_left or ks[-1] != 0:
        ks += _run(off, 4, loses, 1)[0]
    assert off._on_from is None and off.choose_k(2) == 0 and off.num_inherited_steps == 0
