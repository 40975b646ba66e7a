"""Scheduler behaviour with hand-written runner outputs and no model at all."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailserve.config import SchedulerConfig
from tailserve.engine.request import Request, RequestStatus
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.scheduler_output import ModelRunnerOutput
from tailserve.memory.block_pool import BlockPool
from tailserve.sampling_params import SamplingParams

EOS = 1


def make(num_blocks=64, block_size=4, max_seqs=8, max_tokens_per_step=64, prefix=True, chunked=True, reserve=0):
    # reserve 0: admit while blocks are free and preempt when they run out (the tests below
    # drive preemption by hand); the engine's default reserve has its own tests.
    pool = BlockPool(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_seqs, max_tokens_per_step, chunked, reserve), pool)


def req(rid, n_prompt, max_tokens=4, start=10):
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   frozenset({EOS}), max_model_len=1024)


def run_step(s, token=5, per_request=None):
    out = s.schedule()
    per_request = per_request or {}
    result = ModelRunnerOutput({q.request_id: [per_request.get(q.request_id, token)]
                                for q in out.scheduled if q.sample})
    return out, s.update(out, result)


def test_decodes_and_prefills_share_a_step():
    s = make()
    s.add_request(req("a", 6))
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens, q.sample) for q in out.scheduled] == [("a", 6, True)]
    s.add_request(req("b", 9, start=100))
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens) for q in out.scheduled] == [("a", 1), ("b", 9)]


def test_chunked_prefill_splits_long_prompt_while_decodes_continue():
    s = make(max_tokens_per_step=8)
    s.add_request(req("a", 3, max_tokens=10))
    run_step(s)
    s.add_request(req("long", 20, start=100))
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens, q.sample) for q in out.scheduled] == [("a", 1, True), ("long", 7, False)]
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens, q.sample) for q in out.scheduled] == [("a", 1, True), ("long", 7, False)]
    out, updates = run_step(s)
    assert [(q.request_id, q.num_tokens, q.sample) for q in out.scheduled] == [("a", 1, True), ("long", 6, True)]
    assert {u.request_id for u in updates} == {"a", "long"}


def test_without_chunked_prefill_a_prompt_waits_for_budget():
    s = make(max_tokens_per_step=8, chunked=False)
    s.add_request(req("a", 3, max_tokens=10))
    run_step(s)
    s.add_request(req("b", 8))
    out, _ = run_step(s)
    assert [q.request_id for q in out.scheduled] == ["a"]  # 1 + 8 > 8


def test_one_long_prefill_per_step_staggers_a_burst():
    # Four prompts over the threshold arrive together: one is prefilled per step, beside the
    # decodes of those before it, so equal-length requests start (and finish) a step apart.
    pool = BlockPool(64, 4, True)
    s = Scheduler(SchedulerConfig(8, 64, True, 0, max_long_partial_prefills=1, long_prefill_token_threshold=5), pool)
    for i, r in enumerate("abcd"):
        s.add_request(req(r, 8, max_tokens=3, start=10 + 20 * i))
    steps = [[(q.request_id, q.num_tokens) for q in run_step(s)[0].scheduled] for _ in range(4)]
    assert steps == [[("a", 8)], [("a", 1), ("b", 8)], [("a", 1), ("b", 1), ("c", 8)], [("b", 1), ("c", 1), ("d", 8)]]


def test_short_prompts_are_not_held_behind_the_long_prefill_limit():
    pool = BlockPool(64, 4, True)
    s = Scheduler(SchedulerConfig(8, 64, True, 0, max_long_partial_prefills=1, long_prefill_token_threshold=5), pool)
    s.add_request(req("long", 8))
    for i, r in enumerate("xyz"):
        s.add_request(req(r, 5, start=100 + 10 * i))  # not over the threshold
    out, _ = run_step(s)
    assert [(q.request_id, q.num_tokens) for q in out.scheduled] == [("long", 8), ("x", 5), ("y", 5), ("z", 5)]


def test_one_prefill_per_step_whatever_its_length():
    # A burst of short prompts (cache hits leave each a few tokens to compute) is spread one
    # prompt a step, so it does not stay one wave.
    pool = BlockPool(64, 4, True)
    s = Scheduler(SchedulerConfig(16, 64, True, 0, max_num_partial_prefills=1), pool)
    for i, r in enumerate("abc"):
        s.add_request(req(r, 2, max_tokens=4, start=10 + 20 * i))
    steps = [[(q.request_id, q.num_tokens) for q in run_step(s)[0].scheduled] for _ in range(3)]
    assert steps == [[("a", 2)], [("a", 1), ("b", 2)], [("a", 1), ("b", 1), ("c", 2)]]
    s = Scheduler(SchedulerConfig(16, 64, True, 0, max_num_partial_prefills=2), BlockPool(64, 4, True))
    for i, r in enumerate("abc"):
        s.add_request(req(r, 2, max_tokens=4, start=10 + 20 * i))
    assert [q.request_id for q in run_step(s)[0].scheduled] == ["a", "b"]


def test_a_running_chunked_prefill_counts_against_the_step():
    pool = BlockPool(64, 4, True)
    s = Scheduler(SchedulerConfig(8, 3, True, 0, max_num_partial_prefills=1), pool)
    s.add_request(req("a", 5))  # chunked 3 + 2 by the step budget of 3 tokens
    s.add_request(req("b", 4, start=100))
    steps = [[(q.request_id, q.num_tokens) for q in run_step(s)[0].scheduled] for _ in range(3)]
    assert steps == [[("a", 3)], [("a", 2)], [("a", 1), ("b", 2)]]  # b waits beside a's rest (budget left: 1)


@pytest.mark.parametrize("limit,want", [(2, ["a", "b"]), (1, ["a"])])
def test_a_short_prompt_joins_a_long_prompts_step_with_two_prefills_one_long(limit, want):
    # The CPU server's limits (2 prefills, 1 long): a short prompt behind a long one shares its
    # step (long anyway) instead of waiting a step; a second long one waits.
    s = Scheduler(SchedulerConfig(8, 64, True, 0, max_long_partial_prefills=1, long_prefill_token_threshold=5,
                                  max_num_partial_prefills=limit), BlockPool(64, 4, True))
    s.add_request(req("a", 8))  # long
    s.add_request(req("b", 3, start=100))
    s.add_request(req("c", 8, start=200))
    assert [q.request_id for q in run_step(s)[0].scheduled] == want


def test_a_chunked_long_prefill_counts_until_its_rest_is_short():
    # The running chunk holds the one long slot; once what is left of it is under the
    # threshold, the next long prompt starts beside it.
    pool = BlockPool(64, 4, True)
    s = Scheduler(SchedulerConfig(8, 8, True, 0, max_long_partial_prefills=1, long_prefill_token_threshold=5), pool)
    s.add_request(req("a", 14))
    s.add_request(req("b", 8, start=100))
    steps = [[(q.request_id, q.num_tokens) for q in run_step(s)[0].scheduled] for _ in range(3)]
    assert steps == [[("a", 8)], [("a", 6)], [("a", 1), ("b", 7)]]  # a's rest of 6 is still long
    s = Scheduler(SchedulerConfig(8, 8, True, 0, max_long_partial_prefills=1, long_prefill_token_threshold=5),
                  BlockPool(64, 4, True))
    s.add_request(req("a", 12))
    s.add_request(req("b", 8, start=100))
    steps = [[(q.request_id, q.num_tokens) for q in run_step(s)[0].scheduled] for _ in range(3)]
    assert steps == [[("a", 8)], [("a", 4), ("b", 4)], [("a", 1), ("b", 4)]]  # a's rest of 4 is short


def test_no_long_prefill_limit_admits_the_whole_burst():
    s = make()
    for i, r in enumerate("abcd"):
        s.add_request(req(r, 8, start=10 + 20 * i))
    out, _ = run_step(s)
    assert [q.request_id for q in out.scheduled] == ["a", "b", "c", "d"]


def test_max_num_seqs_and_fcfs():
    s = make(max_seqs=2)
    for r in "abc":
        s.add_request(req(r, 4))
    out, _ = run_step(s)
    assert [q.request_id for q in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preempts_most_recent_request_and_readmits_it():
    # 4 blocks of 4 tokens. a: 6 prompt tokens (2 blocks); b: 7 (2 blocks). When a needs a
    # 3rd block, b (newest) is preempted and requeued at the front, later recomputed.
    s = make(num_blocks=4, block_size=4, prefix=False)
    s.add_request(req("a", 6, max_tokens=6))
    s.add_request(req("b", 7, max_tokens=6, start=100))
    run_step(s)  # both prefill
    out, _ = run_step(s)  # a decodes at pos 6 (block 2 ok), b at 7
    out, _ = run_step(s)  # a at pos 7; b needs a 3rd block at pos 8 -> preempted
    assert out.preempted_ids == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert s.waiting[0] is b and b.num_preemptions == 1
    outputs_before = list(b.output_token_ids)
    while s.requests.get("a"):
        run_step(s)
    out, _ = run_step(s)
    # Recompute covers prompt + the outputs it already had; nothing is sampled twice.
    assert out.scheduled[0].request_id == "b" and out.scheduled[0].num_tokens == 7 + len(outputs_before)
    assert b.output_token_ids[: len(outputs_before)] == outputs_before


def test_eos_and_max_tokens_finish_and_free_blocks():
    s = make()
    s.add_request(req("a", 5, max_tokens=3))
    s.add_request(req("b", 5, max_tokens=10))
    run_step(s)
    _, updates = run_step(s, per_request={"b": EOS})
    assert {u.request_id: u.finished for u in updates} == {"a": False, "b": True}
    assert s.requests["a"].output_token_ids == [5, 5]
    _, updates = run_step(s)
    assert updates[0].finished and updates[0].finish_reason == "length"
    assert s.pool.num_used_blocks == 0
    assert not s.has_unfinished_requests()


def test_prefix_hit_counts_and_skips_compute():
    s = make(block_size=16, num_blocks=32, max_tokens_per_step=512)
    shared = list(range(100, 164))  # 64 tokens = 4 blocks
    s.add_request(Request("a", [*shared, 7, 8], SamplingParams(max_tokens=5), frozenset(), 1024))
    run_step(s)
    a_blocks = list(s.requests["a"].block_ids)
    s.add_request(Request("b", [*shared, 9], SamplingParams(max_tokens=2), frozenset(), 1024))
    out, _ = run_step(s)
    b = next(q for q in out.scheduled if q.request_id == "b")
    assert b.start_pos == 64 and b.num_tokens == 1
    assert s.requests["b"].num_cached_tokens == 64
    assert s.pool.stats.hits_tokens == 64
    assert s.requests["b"].block_ids[:4] == a_blocks[:4]
    assert all(s.pool.blocks[b].ref_count == 2 for b in a_blocks[:4])


def test_forced_hash_collision_never_reuses_a_block():
    pool = BlockPool(32, 4, True, hash_fn=lambda parent, toks: 42)  # every block collides
    s = Scheduler(SchedulerConfig(8, 64, True), pool)
    s.add_request(Request("a", list(range(10, 22)), SamplingParams(max_tokens=5), frozenset(), 1024))
    run_step(s)
    s.add_request(Request("b", list(range(50, 62)), SamplingParams(max_tokens=2), frozenset(), 1024))
    out, _ = run_step(s)
    b = next(q for q in out.scheduled if q.request_id == "b")
    assert b.start_pos == 0 and s.requests["b"].num_cached_tokens == 0
    assert not set(s.requests["b"].block_ids) & set(s.requests["a"].block_ids)


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    pool = BlockPool(6, 4, True)
    s = Scheduler(SchedulerConfig(8, 64, True), pool)

    def one_token(rid, start):
        s.add_request(Request(rid, list(range(start, start + 9)), SamplingParams(max_tokens=1), frozenset(), 1024))
        run_step(s)  # finishes after one token; its 2 full blocks stay cached

    one_token("a", 10)
    one_token("b", 40)
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 4
    s.add_request(Request("a2", list(range(10, 19)), SamplingParams(max_tokens=1), frozenset(), 1024))
    out, _ = run_step(s)
    assert out.scheduled[0].start_pos == 8  # both of a's blocks reused
    # a's blocks are now the most recently used. A new 9-token request needs 3 blocks: the 2
    # unhashed tail blocks go first, then the least recently used cached block, one of b's
    # (a request's tail block before its head block).
    one_token("c", 70)

    def hits(start):
        toks = list(range(start, start + 9))
        return len(pool.lookup(toks, pool.hash_blocks(toks, 2)))

    assert (hits(10), hits(40)) == (2, 1) and pool.stats.evictions == 1


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(0, 9)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(12, 40), block_size=st.sampled_from([1, 2, 4, 8]),
       budget=st.integers(4, 64), prefix=st.booleans())
def test_random_add_step_abort_never_leaks_blocks(ops, num_blocks, block_size, budget, prefix):
    pool = BlockPool(num_blocks, block_size, prefix)
    s = Scheduler(SchedulerConfig(4, budget, True), pool)
    added = 0
    shared = list(range(200, 240))
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, share = op
            if -(-(n + max_tokens) // block_size) > num_blocks:
                continue  # the engine rejects requests that cannot fit; so do we here
            prompt = shared[: n // 2] + list(range(300, 300 + n - n // 2)) if share else list(range(n))
            s.add_request(Request(f"r{added}", prompt, SamplingParams(max_tokens=max_tokens), frozenset({EOS}), 1024))
            added += 1
        elif op[0] == "step":
            run_step(s, token=EOS if op[1] == 0 else 5)
        else:
            s.finish_request(f"r{op[1]}", RequestStatus.FINISHED_ABORTED)
        pool.check_consistency()
        in_use = sum(len(r.block_ids) for r in s.requests.values())
        # Shared prefix blocks are counted once per holder in `in_use`.
        assert pool.num_used_blocks <= in_use
        for r in s.requests.values():
            for b in r.block_ids:
                assert pool.blocks[b].ref_count >= 1
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        run_step(s)
    assert not s.has_unfinished_requests()
    pool.check_consistency()
    assert pool.num_used_blocks == 0
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert pool.num_free_blocks == num_blocks  # every block free or cached-and-evictable


def test_worker_gets_full_data_once_then_deltas_and_again_after_preemption():
    s = make(num_blocks=4, block_size=4, prefix=False)
    s.add_request(req("a", 6, max_tokens=6))
    s.add_request(req("b", 7, max_tokens=6, start=100))
    out, _ = run_step(s)
    assert [n.request_id for n in out.new_requests] == ["a", "b"] and not out.cached_requests
    assert out.new_requests[1].token_ids == tuple(range(100, 107)) and len(out.new_requests[1].block_ids) == 2
    out, _ = run_step(s)
    assert not out.new_requests and [(c.request_id, c.new_block_ids) for c in out.cached_requests] == [("a", ()),
                                                                                                         ("b", ())]
    out, _ = run_step(s)  # b preempted when it needs a third block
    assert out.preempted_ids == ["b"] and [c.request_id for c in out.cached_requests] == ["a"]
    out, _ = run_step(s)  # a at position 8: its third block is sent as a delta
    assert [len(c.new_block_ids) for c in out.cached_requests] == [1]
    # The output carries copies: later scheduler changes do not show through.
    sent = out.cached_requests[0].new_block_ids
    s.requests["a"].block_ids.append(99)
    assert sent == out.cached_requests[0].new_block_ids and 99 not in sent
    s.requests["a"].block_ids.pop()
    while s.requests.get("a"):
        run_step(s)
    out, _ = run_step(s)
    nb = out.new_requests[0]
    assert nb.request_id == "b" and len(nb.token_ids) == 7 + len(s.requests["b"].output_token_ids) - 1


def spec_scheduler(k=3, num_blocks=64, fixed=True):
    from tailserve.speculative.adaptive import AdaptiveSpeculation

    pool = BlockPool(num_blocks, 4, False)
    return Scheduler(SchedulerConfig(8, 64, True), pool, AdaptiveSpeculation(k_max=k, fixed_k=k if fixed else None))


def test_scheduler_owns_the_speculative_round():
    """Lookahead slots reserved in schedule(); drafts come back in ModelRunnerOutput, are
    verified next step, and rejected ones are rolled back."""
    s = spec_scheduler(k=3)
    s.add_request(req("a", 6, max_tokens=20))
    out = s.schedule()
    (a,) = out.scheduled
    assert a.sample and a.num_lookahead_tokens == 3
    # The step adds up to 6 + 1 tokens, the chain writes K/V up to 2 past them: 9 slots.
    assert len(s.requests["a"].block_ids) * 4 >= a.start_pos + a.num_tokens + 3
    s.update(out, ModelRunnerOutput({"a": [50]}, draft_token_ids={"a": [51, 52, 53]}, draft_caps={"a": 3}))
    out = s.schedule()
    (a,) = out.scheduled
    assert a.start_pos == 6 and a.num_tokens == 4 and a.draft_token_ids == (51, 52, 53)
    # Two drafts accepted, the third rejected: 51, 52 and the target's own 60.
    (co,) = s.update(out, ModelRunnerOutput({"a": [51, 52, 60]}, draft_token_ids={"a": [61]}, draft_caps={"a": 3}))
    assert co.new_token_ids == [51, 52, 60] and co.num_draft_tokens == 3 and co.num_accepted_tokens == 2
    r = s.requests["a"]
    assert r.num_computed_tokens == 9 and r.all_token_ids[6:] == [50, 51, 52, 60]  # 53's slot rolled back
    assert s.spec_stats.num_draft_tokens == 3 and s.spec_stats.num_accepted_tokens == 2


def test_drafts_are_trimmed_to_the_room_left():
    s = spec_scheduler(k=3)
    s.add_request(req("a", 6, max_tokens=3))
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"a": [50]}, draft_token_ids={"a": [51, 52, 53]}, draft_caps={"a": 3}))
    # 1 of 3 outputs so far: at most 1 draft, so that draft + bonus stay within max_tokens.
    assert s.requests["a"].spec_token_ids == [51]
    out = s.schedule()
    assert out.scheduled[0].draft_token_ids == (51,) and out.scheduled[0].num_lookahead_tokens <= 1


def test_no_lookahead_without_free_blocks_and_nobody_is_preempted_for_it():
    s = spec_scheduler(k=3, num_blocks=2)
    s.add_request(req("a", 7, max_tokens=1 + 0))
    out = s.schedule()
    assert out.scheduled[0].num_lookahead_tokens == 0 and not out.preempted_ids  # max_tokens leaves no room
    s2 = spec_scheduler(k=3, num_blocks=2)
    s2.add_request(req("b", 7, max_tokens=5))
    out = s2.schedule()
    # 7 tokens fill 2 blocks of 4 up to one slot; 3 drafts would need a third block.
    assert out.scheduled[0].num_lookahead_tokens == 0 and not out.preempted_ids


def test_seeded_sampled_requests_take_the_controllers_k_like_everyone_else():
    """Their output does not depend on k (the race, sample/sampler.py), so they need no rule
    of their own: off means off for them too, and on means the controller's k."""
    for chosen in (0, 3):
        s = spec_scheduler(k=8, fixed=False)
        s.add_request(Request("seeded", list(range(10, 16)), SamplingParams(temperature=1.0, seed=3, max_tokens=30),
                              frozenset({EOS}), 1024))
        s.add_request(Request("greedy", list(range(20, 26)), SamplingParams(temperature=0, max_tokens=30),
                              frozenset({EOS}), 1024))
        s.speculation.choose_k = lambda num_decoding, *args, chosen=chosen, **kwargs: chosen
        out = s.schedule()
        assert {q.request_id: q.num_lookahead_tokens for q in out.scheduled} == {"seeded": chosen, "greedy": chosen}


def test_a_lookup_drafts_nothing_where_the_next_step_computes_a_prompt():
    """With a lookup proposer (adaptive k), no draft slots are reserved while a prompt is
    left unfinished by the step or a waiting request has a slot to take: the drafts would be
    verified beside that prompt's chunk. A waiting request with no free slot does not hold them
    back, nor does anything hold back a draft model's (it would pay a catch-up) or a fixed k."""
    from tailserve.speculative.adaptive import AdaptiveSpeculation

    def sched(hold: bool, max_seqs: int = 8, fixed: bool = False) -> Scheduler:
        ctl = AdaptiveSpeculation(k_max=3, fixed_k=3 if fixed else None, hold_beside_prompts=hold)
        ctl.choose_k = lambda *args, **kwargs: 3
        # A step computes at most 8 tokens: a's decode with its 3 drafts takes 4.
        return Scheduler(SchedulerConfig(max_seqs, 8, True), BlockPool(64, 4, False), ctl)

    def lookahead(s: Scheduler) -> dict[str, int]:
        out = s.schedule()
        looked = {q.request_id: q.num_lookahead_tokens for q in out.scheduled if q.sample}
        drafts = {q.request_id: [7] * q.num_lookahead_tokens for q in out.scheduled if q.num_lookahead_tokens}
        s.update(out, ModelRunnerOutput({q.request_id: [5] for q in out.scheduled if q.sample},
                                        draft_token_ids=drafts, draft_caps={r: len(d) for r, d in drafts.items()}))
        return looked

    for hold, want in ((True, 0), (False, 3)):
        s = sched(hold)
        s.add_request(req("a", 6, max_tokens=40))
        assert lookahead(s) == {"a": 3}  # alone: nothing to prefill next
        s.add_request(req("long", 12, max_tokens=40))  # 12 prompt tokens, 4 a step beside a
        assert lookahead(s) == {"a": want}  # long's prompt unfinished after this step
        lookahead(s)
        assert lookahead(s) == {"a": 3, "long": 3}  # its last chunk: nothing to prefill next
        assert lookahead(s) == {"a": 3, "long": 3}
    # The batch is full: the waiting request cannot be admitted next step.
    s = sched(True, max_seqs=1)
    s.add_request(req("a", 6, max_tokens=40))
    s.add_request(req("b", 6, max_tokens=40))
    assert lookahead(s) == {"a": 3} and lookahead(s) == {"a": 3}
    # A fixed k is the user's: it drafts beside prompts too.
    s = sched(True, fixed=True)
    s.add_request(req("a", 6, max_tokens=40))
    lookahead(s)
    s.add_request(req("long", 12, max_tokens=40))
    assert lookahead(s) == {"a": 3}


def test_the_goodput_objective_sees_each_requests_decode_so_far_and_the_waiting_ages():
    """What the controller weighs per step (SloState): decoding requests' seconds since their
    first token, tokens after it and tokens it may still generate; requests without a first
    token (in prefill now, or queued behind max_num_seqs) by age, in the order they are
    served; the slots free."""
    from tailserve.config import SloBounds
    from tailserve.speculative.adaptive import AdaptiveSpeculation

    ctl = AdaptiveSpeculation(k_max=4, objective="goodput", slo=SloBounds(tpot_s=0.05, ttft_s=0.5))
    s = Scheduler(SchedulerConfig(2, 64, True), BlockPool(64, 4, False), ctl)
    seen = []
    ctl.choose_k = lambda num_decoding, slo_state=None, *args, **kwargs: seen.append(slo_state()) or 0
    s.add_request(req("a", 6, max_tokens=20))
    run_step(s)  # a's prompt and first token
    run_step(s)  # a: one token after the first
    s.add_request(req("b", 5, max_tokens=20, start=100))
    s.add_request(req("c", 5, max_tokens=20, start=200))  # queued: max_num_seqs is 2
    run_step(s)
    state = seen[-1]
    assert state.decode_tokens == (1,) and state.decode_elapsed_s[0] > 0
    assert len(state.waiting_ages_s) == 2 and all(a >= 0 for a in state.waiting_ages_s)  # b in prefill, c queued
    assert state.num_prefilling == 1 and state.free_slots == 0  # b is served first; c waits for a slot
    assert state.decode_remaining_tokens == (18,)  # a: 20 - its 2 tokens
    assert s.requests["a"].arrival_ns <= s.requests["a"].first_token_ns


def test_the_goodput_objective_sees_a_preempted_requests_decode_so_far_not_its_age():
    """A request preempted after its first token waits in the queue with its TTFT decided:
    SloState gives its seconds since its first token and tokens after it beside its place in
    the queue (``waiting_decoded``), and None for the queued requests without one."""
    from tailserve.config import SloBounds
    from tailserve.speculative.adaptive import AdaptiveSpeculation

    ctl = AdaptiveSpeculation(k_max=4, objective="goodput", slo=SloBounds(tpot_s=0.05, ttft_s=0.5))
    s = Scheduler(SchedulerConfig(8, 64, True, 0), BlockPool(4, 4, False), ctl)
    seen = []
    ctl.choose_k = lambda num_decoding, slo_state=None, *args, **kwargs: seen.append(slo_state()) or 0
    s.add_request(req("a", 6, max_tokens=6))
    s.add_request(req("b", 7, max_tokens=6, start=100))
    run_step(s)  # both prefill: first tokens
    run_step(s)
    out, _ = run_step(s)  # b needs a third block: preempted, queued at the front
    assert out.preempted_ids == ["b"]
    s.add_request(req("c", 5, max_tokens=6, start=200))  # queued behind b, no first token
    run_step(s)
    state = seen[-1]
    b = s.requests["b"]
    assert len(state.waiting_ages_s) == 2 and state.waiting_decoded[1] is None  # c
    elapsed, tokens = state.waiting_decoded[0]  # b: TPOT so far, not its age
    assert tokens == b.num_output_tokens - 1 and 0 < elapsed < state.waiting_ages_s[0]


def test_admission_hook_lets_a_contiguous_baseline_reserve_the_whole_context():
    """The capacity benchmark's baseline (benchmarks/bench_kv_capacity.py): reserving
    max_model_len per sequence at admission admits 16 / 8 = 2 sequences where paging admits
    all 6 (each needs 2 blocks now)."""

    class Contiguous(Scheduler):
        def _blocks_at_admission(self, req, num_tokens):
            return -(-32 // self.block_size)

    for cls, admitted in ((Scheduler, 6), (Contiguous, 2)):
        s = cls(SchedulerConfig(8, 256, True, 0), BlockPool(16, 4, False))
        for i in range(6):
            s.add_request(Request(f"r{i}", list(range(100 + 10 * i, 106 + 10 * i)), SamplingParams(max_tokens=20),
                                  frozenset({EOS}), 32))
        out = s.schedule()
        assert len(out.scheduled) == admitted and s.pool.num_used_blocks == admitted * (8 if cls is Contiguous else 2)


def test_admission_keeps_blocks_for_the_running_requests_growth():
    # 8 blocks of 4 tokens. a (6-token prompt, 40 new tokens) has run one step: 7 tokens in 2
    # blocks. With a reserve of 24 tokens a's growth to 31 tokens needs 8 blocks, 6 more than
    # it holds, so b (7 tokens, 2 blocks) waits; with none, b is admitted at once (and c, 17
    # tokens in 5 blocks, does not fit either way).
    for reserve, admitted in ((0, ["a", "b"]), (24, ["a"])):
        s = make(num_blocks=8, block_size=4, prefix=False, reserve=reserve)
        s.add_request(req("a", 6, max_tokens=40))
        run_step(s)
        s.add_request(req("b", 7, max_tokens=16, start=100))
        s.add_request(req("c", 17, max_tokens=16, start=200))
        run_step(s)
        assert [r.request_id for r in s.running] == admitted, reserve
    # The reserve is bounded by what a request may still produce: with 2 tokens left, a (7
    # tokens in 2 blocks) needs 1 more block, so b (7 tokens and 1 new: 2 blocks) fits in the
    # 3 free; with 39 left it does not.
    for a_max, admitted in ((3, ["a", "b"]), (40, ["a"])):
        s = make(num_blocks=5, block_size=4, prefix=False, reserve=64)
        s.add_request(req("a", 6, max_tokens=a_max))
        run_step(s)
        s.add_request(req("b", 7, max_tokens=1, start=100))
        out, _ = run_step(s)
        assert [x.request_id for x in out.scheduled] == admitted, a_max
    # Nothing is preempted in a run that would preempt without the reserve.
    for reserve, preempts in ((0, True), (64, False)):
        s = make(num_blocks=12, block_size=4, prefix=False, reserve=reserve)
        for i in range(4):
            s.add_request(req(f"r{i}", 6, max_tokens=20, start=10 + 30 * i))
        for _ in range(200):
            if not s.has_unfinished_requests():
                break
            run_step(s)
        assert (s.num_preemptions > 0) is preempts, reserve


def test_a_request_alone_is_admitted_whatever_its_growth():
    # 2 blocks of 4, a 7-token prompt with 5 new tokens: its growth can never fit, but with
    # nothing running nothing could free a block for it, so it runs (and is cut by the pool).
    s = make(num_blocks=2, block_size=4, prefix=False, reserve=64)
    s.add_request(req("a", 7, max_tokens=5))
    out, _ = run_step(s)
    assert [n.request_id for n in out.new_requests] == ["a"]


def test_the_speculation_policy_sees_the_batchs_remaining_and_unseen_tokens():
    """What the policy weighs a bucket's first exploration by: the most tokens a decoding
    request may still generate (max_tokens, or the context limit if nearer) and the decoding
    requests' context tokens that the draft has not seen (all of them until the worker reports
    a proposal's); a request still in its prompt's chunks counts in neither; and the requests
    waiting for a slot."""
    from tailserve.speculative.adaptive import AdaptiveSpeculation

    seen = []

    class Spy(AdaptiveSpeculation):
        def choose_k(self, num_decoding, slo_state=None, greedy=False, outlook=None, decode_only=True):
            seen.append((num_decoding, outlook()))
            return 0

    s = Scheduler(SchedulerConfig(8, 12, True), BlockPool(64, 4, False), Spy(k_max=3))
    s.add_request(req("a", 6, max_tokens=20))
    s.add_request(req("b", 5, max_tokens=3))
    s.add_request(req("c", 30, max_tokens=5))  # 12 tokens a step: its prompt takes chunks
    out = s.schedule()
    s.update(out, ModelRunnerOutput({"a": [50], "b": [51]}))
    assert seen[-1][0] == 2 and seen[-1][1].remaining_tokens == 20 and seen[-1][1].unseen_tokens == 11
    out = s.schedule()
    # a: 7 tokens, 19 left; b: 6 tokens, 2 left; c still in its prompt
    assert seen[-1][0] == 2 and seen[-1][1].remaining_tokens == 19 and seen[-1][1].unseen_tokens == 13
    # The worker's draft has seen a's first 6 tokens (its proposal's report): a 2 unseen of 8, b 7 of 7.
    s.update(out, ModelRunnerOutput({"a": [52], "b": [53]}, num_draft_computed={"a": 6}))
    s.schedule()
    assert seen[-1][0] == 2 and seen[-1][1].unseen_tokens == 9 and seen[-1][1].num_waiting == 0
    # One slot: the second request waits, and the policy hears of it.
    one = Scheduler(SchedulerConfig(1, 12, True), BlockPool(64, 4, False), Spy(k_max=3))
    one.add_request(req("d", 6, max_tokens=4))
    one.add_request(req("e", 6, max_tokens=4))
    out = one.schedule()
    one.update(out, ModelRunnerOutput({"d": [50]}))
    one.schedule()
    assert seen[-1][0] == 1 and seen[-1][1].num_waiting == 1


def test_a_quiet_step_of_the_policy_goes_unmeasured_and_only_decode_steps_may_be_quiet():
    """The policy is told whether a step has prompt tokens (admissions are measured, each
    one); a step it leaves quiet carries no ``spec_round`` (the engine core then takes no
    timing of it: test_stages.py)."""
    from tailserve.speculative.adaptive import AdaptiveSpeculation

    seen = []

    class Quiet(AdaptiveSpeculation):
        def choose_k(self, num_decoding, slo_state=None, greedy=False, outlook=None, decode_only=True):
            seen.append(decode_only)
            return self._set(0, num_decoding, quiet=decode_only)

    s = Scheduler(SchedulerConfig(8, 64, True), BlockPool(64, 4, False), Quiet(k_max=3))
    s.add_request(req("a", 6, max_tokens=20))
    out, _ = run_step(s)
    assert seen == [False] and out.spec_round is not None  # a's prompt: reported
    s.add_request(req("b", 5, max_tokens=20))
    out, _ = run_step(s)
    assert seen[-1] is False and out.spec_round is not None  # a decodes beside b's prompt
    out, _ = run_step(s)
    assert seen[-1] is True and out.spec_round is None  # decode only: quiet
