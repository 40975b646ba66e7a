"""Greedy outputs are token-identical to transformers' generate in every scheduling mode."""

from __future__ import annotations

import pytest
import torch

from tailserve import LLM, SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(2, vocab, (40,), generator=g).tolist()
    out = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (3, 17, 50, 33)]
    # Prompts sharing a 40-token prefix (2 full blocks at block size 16) for the prefix cache.
    out += [shared + torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 12, 30)]
    return out


@pytest.fixture(scope="module")
def reference(llama_checkpoint):
    path, hf = llama_checkpoint
    prompts = _prompts(hf.config.vocab_size)
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
            refs.append(out[0, len(p):].tolist())
    return path, prompts, refs


MODES = {
    "plain": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=8, enable_prefix_caching=False),
    "prefix_caching": dict(enable_prefix_caching=True),
    "prefix_caching_chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=20),
    "small_blocks": dict(block_size=4),
    "few_seqs": dict(max_num_seqs=2),
    # 16 blocks of 16 tokens: the 7 prompts cannot all run at once, so requests get preempted.
    "preemption": dict(kv_cache_memory_bytes=16 * 2 * 2 * 16 * 2 * 16 * 4, enable_prefix_caching=True,
                       admission_reserve_tokens=0),
    "preemption_no_prefix_cache": dict(kv_cache_memory_bytes=16 * 2 * 2 * 16 * 2 * 16 * 4,
                                       enable_prefix_caching=False, admission_reserve_tokens=0),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_transformers(reference, mode):
    path, prompts, refs = reference
    kw = dict(dtype="float32", kv_cache_memory_bytes=4 << 20)
    kw.update(MODES[mode])
    llm = LLM(str(path), **kw)
    if mode.startswith("prefix_caching"):
        # Warm the cache with one shared-prefix prompt; blocks are cached once computed.
        assert llm.generate([prompts[4]], GREEDY)[0].token_ids == refs[4]
    outs = llm.generate(prompts, GREEDY)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref
        assert out.finish_reason == "length"
    if mode.startswith("preemption"):
        assert llm.engine.scheduler.num_preemptions > 0
        assert any(o.num_preemptions > 0 for o in outs)
    if mode.startswith("prefix_caching"):
        assert llm.engine.block_pool.stats.hits_tokens > 0
    assert llm.engine.block_pool.num_used_blocks == 0


def test_same_prompts_twice_in_one_batch(reference):
    """Identical prompts admitted in the same step share nothing they should not."""
    path, prompts, refs = reference
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    outs = llm.generate([prompts[2], prompts[2], prompts[5]], GREEDY)
    assert [o.token_ids for o in outs] == [refs[2], refs[2], refs[5]]
