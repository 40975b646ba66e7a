"""The KV cache's figures (LLM.stats(), /metrics), checked against hand-computed values."""

from __future__ import annotations

from tailserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
# The tiny Llama: 2 layers, 2 KV heads of 16, float32 -> 512 bytes per token, 2 KiB per 4-token block.
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def test_figures_while_running_and_after(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory_bytes=64 * 4 * BYTES_PER_TOKEN)
    eng = llm.engine
    prompt = list(range(20, 30))  # 10 tokens
    eng.add_request(prompt, GREEDY)
    eng.step()  # prefill of 10 tokens: 3 blocks (12 slots) hold 10 computed tokens
    kv = llm.stats()["kv_cache"]
    got = (kv["num_blocks"], kv["num_used_blocks"], kv["num_live_tokens"], kv["num_allocated_slots"])
    assert got == (64, 3, 10, 12)
    assert kv["block_utilization"] == 3 / 64 and kv["token_utilization"] == 10 / 12
    assert abs(kv["internal_fragmentation"] - 2 / 12) < 1e-12 and kv["wasted_bytes"] == 2 * BYTES_PER_TOKEN
    while eng.has_unfinished_requests():
        eng.step()
    # Same first 8 tokens (2 full blocks) again: a hit of 8 of its 10 prompt tokens.
    llm.generate([[*prompt[:8], 90, 91]], GREEDY)
    llm.generate([[5, 6, 7]], GREEDY)  # shorter than a block: looked up, nothing to hit
    kv = llm.stats()["kv_cache"]
    assert (kv["prefix_queries_tokens"], kv["prefix_hits_tokens"]) == (23, 8)
    assert (kv["prefix_queries_requests"], kv["prefix_hits_requests"]) == (3, 1)
    assert kv["num_used_blocks"] == 0 and kv["num_cached_blocks"] >= 2 and kv["internal_fragmentation"] == 0.0


def test_evictions_preemptions_and_the_exposition(llama_checkpoint):
    path, _ = llama_checkpoint
    # 6 blocks of 4 tokens: two 10-token prompts with 5 new tokens each cannot both fit.
    llm = LLM(str(path), dtype="float32", block_size=4, kv_cache_memory_bytes=6 * 4 * BYTES_PER_TOKEN,
              admission_reserve_tokens=0)  # admit into a full pool: preempt
    outs = llm.generate([list(range(20, 30)), list(range(40, 50))], GREEDY)
    assert all(o.num_output_tokens == 5 for o in outs)
    kv = llm.stats()["kv_cache"]
    assert kv["num_preemptions"] == llm.engine.scheduler.num_preemptions > 0
    assert kv["num_evictions"] == llm.engine.block_pool.stats.evictions > 0
    text = llm.engine.metrics_exposition().decode()

    def value(name):
        line = next(x for x in text.splitlines() if x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value("tailserve:prefix_cache_evictions_total") == kv["num_evictions"]
    assert value("tailserve:prefix_cache_request_queries_total") == kv["prefix_queries_requests"]
    assert value("tailserve:kv_cache_blocks_cached") == kv["num_cached_blocks"]
    assert value("tailserve:kv_cache_internal_fragmentation") == 0.0
    # A second scrape adds nothing to the counters.
    assert llm.engine.metrics_exposition().decode().count("prefix_cache_evictions_total{") == 1
    text = llm.engine.metrics_exposition().decode()
    assert value("tailserve:prefix_cache_evictions_total") == kv["num_evictions"]
