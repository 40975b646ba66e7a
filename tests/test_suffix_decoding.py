"""Suffix decoding: the cache and the draft rule alone, then the engine (greedy identical to
plain decoding on held-out stdlib prompts, drafts from finished requests, hybrid's first
source, its figures) and the exact sampled distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tailserve.kernels.cpu import kernels
from tailserve.sampling_params import SamplingParams
from tailserve.speculative.suffix import GLOBAL, LOCAL, DraftCalibration, SuffixCache, SuffixConfig, SuffixProposer

KERNELS = kernels()


def _cache_draft(cache: SuffixCache, context: list[int], k: int = 8) -> list[int]:
    return cache.draft(np.asarray(context[-cache.cfg.max_depth:], dtype=np.int64), k).tokens


# -- the rule, alone ------------------------------------------------------------------------------
def test_a_request_repeating_its_own_text_drafts_what_followed_and_one_that_does_not_drafts_nothing():
    p = SuffixProposer(SuffixConfig(max_spec_factor=4.0))
    text = [5, 6, 7, 8, 9, 10, 11]
    # A match of 3 allows 12 drafts; the continuation runs up to the context's own end.
    assert p.propose_one([*text, 5, 6, 7], k=8) == [8, 9, 10, 11, 5, 6, 7]
    assert p.propose_one([1, 2, 3, 4], k=8) == []


@pytest.mark.parametrize("kind", ["suffix", "ngram"])
def test_a_lookup_keeps_each_requests_tokens_as_they_grow_and_drops_them_when_it_finishes(kind):
    """The per-request token copy a lookup keeps (instead of converting the whole list every
    step) follows the list as it grows, mid-prefill (num_valid short of it) included, starts
    afresh for a different sequence under the same id, and is dropped at the finish; the
    drafts are the ones the list itself gives."""
    from tailserve.speculative.proposer import NgramProposer, ProposalInput

    # (No minimum probability: the calibration then holds no draft back, and a lookup on the
    # list drafts what one on the kept copy drafts.)
    p = SuffixProposer(SuffixConfig(min_token_prob=0.0)) if kind == "suffix" else NgramProposer(1, 3)
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(0, 50, 40)]

    def inp(rid: str, tokens: list[int], valid: int) -> ProposalInput:
        return ProposalInput(rid, tokens, 0, valid, [], 4, SamplingParams(), None)

    assert p.tokens_of(inp("a", toks, 30)).tolist() == toks[:30]  # mid-prefill
    for _ in range(100):  # decode: one to several tokens a step, past the first buffer's size
        toks += [int(t) for t in rng.integers(0, 50, int(rng.integers(1, 4)))]
        got = p.propose_input(inp("a", toks, len(toks)))
        assert p.tokens_of(inp("a", toks, len(toks))).tolist() == toks
        assert got == p.propose_one(list(toks), 4)
    other = [int(t) for t in rng.integers(50, 100, len(toks) + 20)]  # the same id, another (longer) sequence
    assert p.tokens_of(inp("a", other, len(other))).tolist() == other
    p.observe_finished("a", other, 10)
    assert "a" not in p._copies


def test_the_draft_is_at_most_the_spec_factor_times_the_match():
    p = SuffixProposer(SuffixConfig(max_spec_factor=1.0))
    # Only the last token (9) matches earlier text: a one-token match earns one draft.
    assert p.propose_one([9, 1, 2, 3, 4, 5, 7, 9], k=8) == [1]
    # A three-token match earns three.
    assert p.propose_one([7, 8, 9, 1, 2, 3, 4, 5, 7, 8, 9], k=8) == [1, 2, 3]


def test_drafts_stop_below_the_minimum_empirical_probability():
    cache = SuffixCache(SuffixConfig(min_token_prob=0.6, max_spec_factor=8.0))
    for cont in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6]):
        cache.add([9, 9, *cont])
    # After 9 9: 1 (3/3), 2 (3/3), then 3 (2/3 = 0.67 >= 0.6), then 4 (1 x 0.67 = 0.67), ...
    assert _cache_draft(cache, [0, 9, 9]) == [1, 2, 3, 4]
    strict = SuffixCache(SuffixConfig(min_token_prob=0.7, max_spec_factor=8.0))
    for cont in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6]):
        strict.add([9, 9, *cont])
    assert _cache_draft(strict, [0, 9, 9]) == [1, 2]  # 3 is only 2/3 likely after 9 9 1 2


def test_a_match_never_runs_across_two_cached_requests():
    cache = SuffixCache(SuffixConfig(max_spec_factor=8.0))
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    assert _cache_draft(cache, [0, 2, 3]) == []  # 3 ends its request: nothing followed it
    assert _cache_draft(cache, [0, 4]) == [5, 6]


def test_the_global_cache_is_bounded_and_forgets_the_oldest():
    cache = SuffixCache(SuffixConfig(max_requests=10, max_spec_factor=8.0))
    for i in range(200):
        cache.add([1000 + i, 1, 2, 3])
    assert cache.num_requests == 10 and cache.num_tokens == 10 * 4
    assert cache.nbytes <= 4 * 2 * (2 * 10 * 5)  # compacted: at most about twice what it holds
    assert _cache_draft(cache, [1000 + 5]) == []  # evicted long ago
    assert _cache_draft(cache, [1000 + 199]) == [1, 2, 3]


def test_finished_requests_feed_the_global_cache_with_their_prompt_tail():
    p = SuffixProposer(SuffixConfig(max_spec_factor=8.0))
    prompt = list(range(100, 200))  # 100 tokens: the last 64 are kept
    p.observe_finished("r0", [*prompt, 7, 8, 9, 10], len(prompt))
    assert p.cache.num_tokens == 64 + 4
    assert p.propose_one([1, 2, 196, 197, 198, 199], k=8) == [7, 8, 9, 10]
    assert p.num_global_drafts == 1


def _input(rid: str, tokens: list[int], k: int = 8):
    from tailserve.speculative.proposer import ProposalInput

    return ProposalInput(rid, tokens, 0, len(tokens), [], k, SamplingParams(), None)


def _walk_step_by_step(tokens, ends, pattern, k, cfg, source, calibration):
    """The suffix walk as the paper states it, one token at a time: extend the match while an
    occurrence still agrees, then draft the most frequent successor while its cumulative
    probability (scaled by the calibration) stays above min_token_prob."""
    m = 1
    while m < len(pattern) and ends.size:
        prev = ends - m
        keep = ends[prev >= 0][tokens[prev[prev >= 0]] == pattern[-1 - m]]
        if not keep.size:
            break
        ends, m = keep, m + 1
    bucket = DraftCalibration.bucket(m)
    scale = float(calibration.scales[source, bucket])
    draft, cum, prob, score = [], [], 1.0, 0.0
    while len(draft) < min(k, int(cfg.max_spec_factor * m)):
        ends = ends[ends + 1 < len(tokens)]
        nxt = tokens[ends + 1]
        if not (nxt >= 0).any():
            break
        values, counts = np.unique(nxt[nxt >= 0], return_counts=True)
        best = int(np.argmax(counts))
        prob *= counts[best] / int((nxt >= 0).sum())
        scaled = min(prob * scale, 1.0)
        if scaled < cfg.min_token_prob:
            if draft or prob < cfg.min_token_prob or calibration.hold(source, bucket):
                break
            scale, scaled = 1.0, prob
        draft.append(int(values[best]))
        cum.append(float(prob))
        score += scaled
        ends = ends[nxt == values[best]] + 1
    return draft, cum, m, score


def _noisy_repetition(rng: np.random.Generator) -> np.ndarray:
    """A random text that repeats a random base with some noise: few or many occurrences of
    every token, matches of every length."""
    vocab = int(rng.choice([3, 8, 50]))
    n = int(rng.integers(2, 400))
    base = rng.integers(0, vocab, size=int(rng.integers(1, 40)))
    tokens = np.resize(base, n).astype(np.int64)
    noisy = rng.random(n) < rng.choice([0.0, 0.05, 0.3])
    tokens[noisy] = rng.integers(0, vocab, size=int(noisy.sum()))
    return tokens


def test_the_walks_shortcuts_make_the_step_by_step_walks_drafts():
    """The walk extends a match over few occurrences in one comparison and takes a continuation
    that every occurrence shares in one gather: on repetitive texts with noise, request
    boundaries, many and few occurrences, calibrated or not, its drafts, probabilities, match
    lengths, scores and held-back counts are exactly the step-by-step walk's."""
    from tailserve.speculative.suffix import _walk

    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(1500):
        tokens = _noisy_repetition(rng)
        n = tokens.size
        if rng.random() < 0.3:
            tokens[rng.random(n) < 0.02] = -1  # request boundaries, as in the global cache
        cfg = SuffixConfig(max_depth=int(rng.choice([4, 24])), max_spec_factor=float(rng.choice([0.5, 1.0, 3.0])),
                           min_token_prob=float(rng.choice([0.0, 0.1, 0.5])))
        context = tokens[tokens >= 0]
        if context.size < 2:
            continue
        pattern = context[-cfg.max_depth:]
        ends = np.flatnonzero(tokens[:-1] == pattern[-1])
        k = int(rng.integers(1, 16))
        ours, theirs = DraftCalibration(), DraftCalibration()
        if rng.random() < 0.5:
            ours.scales = rng.random((2, 8)) * 2
            theirs.scales = ours.scales.copy()
        got = _walk(tokens, ends, pattern, k, cfg, GLOBAL, ours)
        if not ends.size:
            assert got.tokens == []
            continue
        assert (got.tokens, got.cum_probs, got.match_len, got.score) == \
            _walk_step_by_step(tokens, ends, pattern, k, cfg, GLOBAL, theirs)
        assert np.array_equal(ours.num_held, theirs.num_held)
        checked += 1
    assert checked > 1000


@pytest.mark.skipif(KERNELS is None, reason="no compiled CPU kernels")
def test_the_compiled_walk_makes_the_numpy_walks_drafts():
    """The compiled walk (CpuKernels.suffix_walk) on the texts of the test above, as the
    request's own text (int64, occurrences found in it) and as the global cache (int32, a
    position list, evicted positions skipped), calibrated or not and with holds that probe:
    exactly the NumPy walk's drafts, probabilities, match lengths, scores and hold counts."""
    from tailserve.speculative.suffix import _walk, _walk_compiled

    rng = np.random.default_rng(1)
    checked = drafted = consulted = 0
    for _ in range(1500):
        tokens = _noisy_repetition(rng)
        n = tokens.size
        own = rng.random() < 0.5
        if not own and rng.random() < 0.5:
            tokens[rng.random(n) < 0.02] = -1  # request boundaries, as in the global cache
        cfg = SuffixConfig(max_depth=int(rng.choice([4, 24])), max_spec_factor=float(rng.choice([0.5, 1.0, 3.0])),
                           min_token_prob=float(rng.choice([0.0, 0.1, 0.5])))
        context = tokens if own else tokens[tokens >= 0]
        if context.size < 2:
            continue
        pattern = context[-cfg.max_depth:]
        k = int(rng.integers(1, 16))
        ours, theirs = DraftCalibration(), DraftCalibration()
        if rng.random() < 0.5:  # factors that hold drafts back, holds at every phase of their probe cycle
            ours.scales = rng.random((2, 8)) * 2
            ours.num_held[:] = rng.integers(0, 3 * DraftCalibration.PROBE_EVERY, size=(2, 8))
            theirs.scales, theirs.num_held[:] = ours.scales.copy(), ours.num_held
        held_before = ours.num_held.copy()
        calibration = (ours, theirs) if rng.random() < 0.8 else (None, None)
        source = LOCAL if own else GLOBAL
        if own:
            ends = np.flatnonzero(tokens[:-1] == tokens[-1])
            got = _walk_compiled(KERNELS, tokens, None, 0, pattern, k, cfg, source, calibration[0])
        else:
            ends = np.flatnonzero(tokens[:-1] == pattern[-1])
            evicted = int(rng.integers(0, n // 2 + 1)) if rng.random() < 0.3 else 0
            got = _walk_compiled(KERNELS, tokens.astype(np.int32), ends.astype(np.int32), evicted,
                                 pattern.astype(np.int32), k, cfg, source, calibration[0])
            ends = ends[ends >= evicted]
        want = _walk(tokens, ends, pattern, k, cfg, source, calibration[1]) if ends.size else None
        if want is None:
            assert got.tokens == [] and got.match_len == 0
            continue
        assert (got.tokens, got.cum_probs, got.match_len, got.score) == \
            (want.tokens, want.cum_probs, want.match_len, want.score)
        if calibration[0] is not None:
            assert np.array_equal(ours.num_held, theirs.num_held)
            consulted += int((ours.num_held != held_before).any())
        checked += 1
        drafted += bool(got.tokens)
    assert checked > 1000 and drafted > 500 and consulted > 50


def test_the_next_tokens_calibrate_the_drafts_of_their_source_and_match_length():
    """A draft's next tokens say how many of it the target kept (a one-hot q accepts a draft
    token exactly when the target's token equals it); the factor on that (source, match
    length)'s probabilities is (accepted + 2 f) / (expected + 2), f the factor of all buckets
    pooled, where a bucket without drafts yet stands. Tokens not yet generated are left out
    of the expectation."""
    p = SuffixProposer()
    ctx = [5, 6, 7, 8, 5, 6, 7, 8, 9, 5, 6, 7]  # "5 6 7" matches twice: 8 follows both
    draft = p.propose_input(_input("r", ctx, k=3))
    assert draft == [8, 5, 6]  # 8 follows both occurrences, then 5 or 9 (a tie: the smaller id), then 6
    assert p._pending["r"].draft.cum_probs == [1.0, 0.5, 0.5]
    p.propose_input(_input("r", [*ctx, 8, 9, 1], k=3))  # the target kept 8, then took 9: one accepted
    bucket = DraftCalibration.bucket(3)
    assert p.calibration.accepted[LOCAL, bucket] == 1 and p.calibration.expected[LOCAL, bucket] == 2.0
    pooled = (1 + 2) / (2 + 2)
    assert p.calibration.scales[LOCAL, bucket] == pytest.approx((1 + 2 * pooled) / (2 + 2))
    assert p.calibration.scales[GLOBAL, bucket] == pytest.approx(pooled)  # no drafts there yet
    q = SuffixProposer()
    q.propose_input(_input("r", ctx, k=3))
    q.propose_input(_input("r", [*ctx, 8], k=3))  # one token so far, the draft's first: decided 1 of 3
    assert q.calibration.accepted[LOCAL, bucket] == 1 and q.calibration.expected[LOCAL, bucket] == 1.0


def test_drafts_the_target_keeps_rejecting_stop_except_for_probes_and_accepted_ones_go_on():
    """Text that does not repeat (ids from a large vocabulary) still matches one token: the
    occurrences' successors are drafted with probability 0.5-1.0 and the target rejects them.
    Once calibrated, only one held draft in PROBE_EVERY is made. Text that repeats keeps
    drafting at full length."""
    rng = np.random.default_rng(1)
    p = SuffixProposer()
    toks = [int(t) for t in rng.integers(0, 1000, 300)]
    made = []
    for _ in range(1500):
        d = p.propose_input(_input("r", toks))
        made.append(bool(d))
        nxt = int(rng.integers(0, 1000))
        while d and nxt == d[0]:  # the target never takes the draft
            nxt = int(rng.integers(0, 1000))
        toks.append(nxt)
    assert sum(made[:20]) >= 3  # not calibrated yet: a token seen before drafts what followed it
    late = sum(made[-1000:])
    assert 0 < late < 1000 / DraftCalibration.PROBE_EVERY + 15, late
    assert p.calibration.scales[LOCAL, 0] < 0.2
    # Repeating text: every draft accepted, the factor at or above 1, drafts as long as k.
    r = SuffixProposer(SuffixConfig(max_spec_factor=4.0))
    period = [int(t) for t in rng.integers(0, 1000, 40)]
    toks = period * 2
    lengths = []
    for _ in range(200):
        d = r.propose_input(_input("s", toks))
        lengths.append(len(d))
        toks.append(period[len(toks) % 40])
    assert min(lengths[-100:]) == 8 and r.calibration.scales[LOCAL].min() >= 1.0


# -- the engine -----------------------------------------------------------------------------------
def _held_out_prompts(n: int = 6) -> list[str]:
    import pathlib
    import sysconfig

    from tailserve.assets import DEFAULT_TARGET_DIR

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = (DEFAULT_TARGET_DIR / "held_out_files.txt").read_text().split()
    files = [root / n for n in names if (root / n).is_file()][:n]
    return [f.read_text(encoding="utf-8")[:200] for f in files]


@pytest.fixture(scope="module")
def suffix_llm(engine_cache):
    # k fixed at 8: what is drafted then depends on the suffix matches alone, not on the adaptive
    # controller's timings (on a loaded machine it measured drafts as not paying and drafted one).
    return engine_cache(speculative_method="suffix", num_speculative_tokens=8)


def test_greedy_suffix_decoding_is_plain_decoding_and_repeats_draft_from_the_cache(engine_cache, suffix_llm):
    prompts = _held_out_prompts()
    p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in engine_cache().generate(prompts, p)]
    assert [o.outputs[0].token_ids for o in suffix_llm.generate(prompts, p)] == plain
    proposer = suffix_llm.engine.core.worker.local.proposer
    before = proposer.num_global_drafts
    accepted = suffix_llm.engine.spec_stats.num_accepted_tokens
    # The same requests again, one at a time (six at once may draft at most 16 // 6 - 1 = 1
    # token each: the plan's verify-row limit): their earlier outputs are in the global cache.
    assert [suffix_llm.generate([q], p)[0].outputs[0].token_ids for q in prompts] == plain
    assert proposer.num_global_drafts > before
    assert suffix_llm.engine.spec_stats.num_accepted_tokens - accepted > 0.5 * 6 * 64  # most tokens drafted
    stats = suffix_llm.stats()["speculative"]["suffix_cache"]
    assert stats["num_requests"] >= 6 and stats["nbytes"] > 0 and stats["max_requests"] == 4096
    assert "tailserve:suffix_cache_bytes" in suffix_llm.engine.metrics_exposition().decode()


def test_hybrid_tries_suffix_first(engine_cache):
    llm = engine_cache(speculative_model="builtin", speculative_method="hybrid", num_speculative_tokens=4)
    prompts = _held_out_prompts(3)
    p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in engine_cache().generate(prompts, p)]
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == plain
    suffix = llm.engine.core.worker.local.proposer.lookups[0]
    assert isinstance(suffix, SuffixProposer) and suffix.num_global_drafts > 0


@pytest.mark.slow
def test_sampled_tokens_under_suffix_decoding_follow_the_target(tmp_path):
    """Temperature 1: the first three tokens follow the target's exact distribution while
    the global cache (the earlier samples' outputs) drafts them."""
    from tailserve import LLM
    from test_rejection_sampler import chi2_pvalue
    from test_speculative import _tiny_vocab_model, exact_first_three

    target_path, target = _tiny_vocab_model(tmp_path, "target", seed=0)
    prompt = [3, 1, 4]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    exact = exact_first_three(target, prompt, params)
    llm = LLM(str(target_path), dtype="float32", kv_cache_memory_bytes=64 << 20, max_num_seqs=512,
              max_num_batched_tokens=4096, speculative_method="suffix", num_speculative_tokens=2, seed=5,
              enable_prefix_caching=False, suffix_min_token_prob=0.0, suffix_max_spec_factor=4.0,
              suffix_cache_max_requests=512,  # with 8 token ids, every occurrence list is long
              enable_metrics=False)  # Prometheus recording is a fifth of these 4-token requests' time
    counts = torch.zeros(512, dtype=torch.float64)
    for _ in range(4):  # 8,000 samples over 512 outcomes (the first batch drafts from its own text only)
        for out in llm.generate([prompt] * 2000, params):
            a, b, c = out.token_ids[:3]
            counts[a * 64 + b * 8 + c] += 1
    spec = llm.engine.spec_stats
    assert spec.num_draft_tokens > 1000 and 0 < spec.acceptance_rate < 1
    assert chi2_pvalue(counts, exact.reshape(-1)) > 1e-3
