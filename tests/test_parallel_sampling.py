"""Parallel sampling (n > 1, best_of): the prompt is computed once, its blocks are shared by
the samples, the first block each sample writes is copied on write, and every sample is
exactly what the same request with its own seed gives alone."""

from __future__ import annotations

import dataclasses

import pytest

from tailserve import LLM, SamplingParams
from tailserve.config import SchedulerConfig
from tailserve.engine.parallel_sampling import mean_logprob
from tailserve.engine.request import Request, RequestStatus
from tailserve.engine.scheduler import Scheduler
from tailserve.engine.scheduler_output import ModelRunnerOutput
from tailserve.memory.block_pool import BlockPool

PROMPT = list(range(3, 73))  # 70 tokens: blocks of 16 -> 4 full blocks, the 5th holds the last 6


# -- the scheduler alone, with hand-written runner outputs ----------------------------------------
def _sched(num_blocks=64, block_size=4, max_seqs=8, prefix=True):
    return Scheduler(SchedulerConfig(max_seqs, 256, True, 0), BlockPool(num_blocks, block_size, prefix))


def _group(s, n_prompt, n, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    reqs = [Request(f"{i}_r", list(range(10, 10 + n_prompt)), params, frozenset({1}), 1024) for i in range(n)]
    s.add_fork_group(reqs[0], reqs[1:])
    return reqs


def _step(s, token=5):
    out = s.schedule()
    s.update(out, ModelRunnerOutput({q.request_id: [token] for q in out.scheduled if q.sample}))
    return out


@pytest.mark.parametrize("prefix", [True, False])
def test_forked_samples_share_prompt_blocks_and_copy_the_block_they_write(prefix):
    s = _sched(prefix=prefix)
    first, *others = _group(s, 10, 3)  # block size 4: blocks [0-3] [4-7] [8-9 + last prompt token]
    out = _step(s)
    assert [q.request_id for q in out.scheduled] == ["0_r"]  # only the first computes the prompt
    # Forked: blocks 0 and 1 (positions 0-7) shared; block 2 (positions 8-9) copied for each.
    for r in others:
        assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 9
        assert r.block_ids[:2] == first.block_ids[:2] and r.block_ids[2] != first.block_ids[2]
    assert [s.pool.blocks[b].ref_count for b in first.block_ids[:2]] == [3, 3]
    s.check_consistency()
    out = _step(s)
    assert sorted(out.block_copies) == sorted((first.block_ids[2], r.block_ids[2]) for r in others)
    # Each sample recomputes only the last prompt token, writing into its own copy.
    assert [(q.request_id, q.start_pos, q.num_tokens, q.sample) for q in out.scheduled] == [
        ("0_r", 10, 1, True), ("1_r", 9, 1, True), ("2_r", 9, 1, True)]
    assert (s.num_forks, s.num_fork_shared_blocks, s.num_fork_copied_blocks) == (2, 4, 2)
    s.check_consistency()
    while s.has_unfinished_requests():
        _step(s)
    assert s.pool.num_used_blocks == 0
    s.check_consistency()


def test_no_copy_when_the_last_prompt_token_opens_a_block():
    s = _sched()
    first, second = _group(s, 9, 2)  # the last prompt token (position 8) is the first of block 2
    _step(s)
    assert second.block_ids[:2] == first.block_ids[:2] and second.block_ids[2] != first.block_ids[2]
    assert s.schedule().block_copies == []


def test_a_sample_without_a_free_block_at_fork_time_is_queued_on_its_own():
    s = _sched(num_blocks=4)  # the first takes 3 blocks (10 tokens); one left for one fork
    first, second, third = _group(s, 10, 3, max_tokens=1)
    out = _step(s)
    assert first.is_finished  # max_tokens=1: done in the step that computed the prompt
    assert second.status == RequestStatus.RUNNING and third.status == RequestStatus.WAITING
    assert list(s.waiting) == [third]
    while s.has_unfinished_requests():
        out = _step(s)
    assert third.is_finished and third.num_output_tokens == 1
    assert out.scheduled and s.pool.num_used_blocks == 0
    s.check_consistency()


def test_aborting_the_first_before_its_prompt_is_computed_releases_the_others():
    s = _sched()
    _, second = _group(s, 10, 2)
    s.finish_request("0_r", RequestStatus.FINISHED_ABORTED)
    assert list(s.waiting) == [second] and second.fork_parent is None
    s.finish_request("1_r", RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    s.check_consistency()


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(llama_checkpoint):
    path, _ = llama_checkpoint
    return LLM(str(path), dtype="float32", block_size=16, enable_prefix_caching=False, kv_cache_memory_bytes=4 << 20)


def test_four_samples_hold_8_blocks_where_four_requests_hold_20(llm):
    eng = llm.engine
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8)
    eng.add_request(PROMPT, params, request_id="shared")
    eng.step()  # the prompt, once; then the fork
    fig = eng.kv_figures()
    # The first sample: 5 blocks for 70 tokens; the other three: 4 shared + 1 own copy each.
    assert fig.num_used_blocks == 5 + 3
    assert fig.num_shared_blocks == 4
    assert fig.blocks_saved_by_sharing == 12
    assert fig.bytes_saved_by_sharing == 12 * eng.core.worker.kv_bytes_per_block
    first = eng.scheduler.requests["0_shared"]
    # Until the next step sends the copies, their source (the 5th block) is held for them too.
    assert [eng.block_pool.blocks[b].ref_count for b in first.block_ids] == [4, 4, 4, 4, 4]
    eng.step()
    assert [eng.block_pool.blocks[b].ref_count for b in first.block_ids] == [4, 4, 4, 4, 1]
    assert eng.kv_figures().num_used_blocks == 8
    while eng.has_unfinished_requests():
        eng.step()
    # The same four samples as independent requests, each with its own seed.
    for i in range(4):
        eng.add_request(PROMPT, dataclasses.replace(params, n=1, seed=5 + i), request_id=f"alone-{i}")
    eng.step()
    assert eng.kv_figures().num_used_blocks == 20 and eng.kv_figures().blocks_saved_by_sharing == 0
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_pool.num_used_blocks == 0
    eng.scheduler.check_consistency()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_each_sample_equals_the_request_alone_with_its_seed(llm, temperature):
    params = SamplingParams(n=3, temperature=temperature, seed=21, max_tokens=12, logprobs=2)
    out = llm.generate(PROMPT, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    for i, c in enumerate(out.outputs):
        alone = llm.generate(PROMPT, dataclasses.replace(params, n=1, seed=21 + i))[0].outputs[0]
        assert c.token_ids == alone.token_ids
        for got, want in zip(c.logprobs, alone.logprobs, strict=True):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    if temperature:
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.num_output_tokens == sum(len(c.token_ids) for c in out.outputs)


def test_forked_samples_with_speculative_decoding_equal_plain_sampling(llama_checkpoint, noisy_draft):
    path, _ = llama_checkpoint
    spec = LLM(str(path), dtype="float32", speculative_model=str(noisy_draft), num_speculative_tokens=3,
               kv_cache_memory_bytes=4 << 20)
    plain = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    # Greedy: exactly plain decoding. Sampled: speculation draws its randomness differently
    # (the output distribution is the same, not the draws), so the reference is each seed
    # alone through the same speculative engine.
    for temperature, ref in ((0.0, plain), (0.8, spec)):
        params = SamplingParams(n=3, temperature=temperature, seed=4, max_tokens=16)
        got = spec.generate(PROMPT, params)[0]
        for i, c in enumerate(got.outputs):
            alone = ref.generate(PROMPT, dataclasses.replace(params, n=1, seed=4 + i))[0]
            assert c.token_ids == alone.token_ids
    assert spec.engine.scheduler.num_forks == 4 and spec.engine.spec_stats.num_drafts > 0


def test_best_of_returns_the_n_samples_with_the_highest_mean_logprob(llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=9, max_tokens=10)
    out = llm.generate(PROMPT, params)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None for c in out.outputs)  # not asked for: stripped
    alone = [llm.generate(PROMPT, dataclasses.replace(params, n=1, best_of=None, seed=9 + i, logprobs=0))[0]
             .outputs[0] for i in range(5)]
    best = sorted(alone, key=mean_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]


def test_aborting_a_parallel_request_frees_every_sample(llm):
    eng = llm.engine
    eng.add_request(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=50), request_id="gone")
    eng.step()
    eng.step()
    assert eng.num_unfinished_requests == 1 and len(eng.scheduler.requests) == 3
    eng.abort_request("gone")
    assert not eng.has_unfinished_requests() and eng.block_pool.num_used_blocks == 0
    eng.scheduler.check_consistency()


def test_streamed_outputs_carry_each_sample_s_delta(llm):
    eng = llm.engine
    eng.add_request(PROMPT, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6), request_id="s")
    got: dict[int, list[int]] = {0: [], 1: []}
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            for c in out.outputs:
                got[c.index].extend(c.delta_token_ids)
            final = out
    assert final is not None and final.finished
    assert [got[c.index] for c in final.outputs] == [c.token_ids for c in final.outputs]
