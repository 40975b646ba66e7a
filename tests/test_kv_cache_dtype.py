"""--kv-cache-dtype: what the plan picks, what it buys in capacity, and that a 16-bit cache is
read the same way by every path (decode kernel, reference prefill, prefix-cache hits)."""

from __future__ import annotations

import random

import pytest
import torch

from tailserve import SamplingParams
from tailserve.kernels import cpu as cpu_kernels

needs_kernels = pytest.mark.skipif(cpu_kernels.kernels() is None, reason="compiled CPU kernels unavailable")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@needs_kernels
def test_auto_stores_the_builtin_bf16_checkpoints_kv_in_bf16_twice_the_tokens_per_byte(engine_cache):
    half = engine_cache(kv_cache_memory_bytes=8 << 20)
    full = engine_cache(kv_cache_memory_bytes=8 << 20, kv_cache_dtype="float32")
    wh, wf = half.engine.core.worker, full.engine.core.worker
    assert wh.model.embed_tokens.dtype == wf.model.embed_tokens.dtype == torch.float32  # float32 arithmetic
    assert {c.dtype for c in wh.kv_caches} == {torch.bfloat16} and {c.dtype for c in wf.kv_caches} == {torch.float32}
    assert half.engine.info.kv_bytes_per_block * 2 == full.engine.info.kv_bytes_per_block
    assert wh.num_blocks == 2 * wf.num_blocks
    assert "bfloat16 (the checkpoint's bfloat16" in wh.plan.describe()["kv_cache_dtype"]


@needs_kernels
def test_a_bf16_cache_gives_prefix_hits_the_tokens_an_uncached_engine_gives(engine_cache):
    """The reference prefill rounds its own fresh K/V as the cache stores them, so a request
    reading its prefix from the cache continues as one that computed it."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 4000) for _ in range(48)]
    prompts = [prefix + [rng.randrange(3, 4000) for _ in range(n)] for n in (3, 20, 9)]
    cached = engine_cache(kv_cache_memory_bytes=8 << 20)
    cached.generate([[*prefix, 7]], GREEDY)  # the prefix's blocks now cached
    hits = cached.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens >= 48 for o in hits)
    uncached = engine_cache(kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False)
    assert [o.token_ids for o in hits] == [o.token_ids for o in uncached.generate(prompts, GREEDY)]
