"""Where a prompt left the prefix cache: the block pool's divergence point, the chat prompt's
segments, the break located in them; then through real HTTP (the official ``openai`` client
against the shared tool server, prefix caching on): cached tokens on every response and
``timing.prefix_cache`` naming the part of the prompt that broke the cache."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tailserve.memory.block_pool import BlockPool
from tailserve.metrics.prefix_break import PromptSegment, locate_break

BS = 16


# -- stages alone -------------------------------------------------------------------------------
def _cache_sequence(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Compute and cache every full block of ``tokens`` as the scheduler would; returns them."""
    n = len(tokens) // BS
    hashes = pool.hash_blocks(tokens, n)
    blocks = pool.allocate(n)
    for b in range(n):
        pool.cache_block(blocks[b], hashes[b], tuple(tokens[b * BS : (b + 1) * BS]), hashes[b - 1] if b else None)
    pool.free(blocks)
    return blocks


def test_the_divergence_is_the_first_token_no_cached_block_continues_with():
    pool = BlockPool(num_blocks=16, block_size=BS)
    cached = list(range(100, 164))  # 4 blocks
    _cache_sequence(pool, cached)
    edited = [*cached[:37], 7, *cached[38:]]  # differs at token 37, inside block 2
    hashes = pool.hash_blocks(edited, 4)
    hits = pool.lookup(edited, hashes)
    assert len(hits) == 2
    assert pool.first_divergence(edited, len(hits), hashes[1]) == 37
    # A first block that nothing cached starts like: the divergence is token 0.
    other = [5, *cached[1:]]
    assert pool.first_divergence(other, 0, None) == 0
    # Evicted blocks no longer count.
    pool.allocate(16)
    pool.check_consistency()
    assert pool.first_divergence(edited, 0, None) == 0


def test_locate_break_names_the_segment_holding_the_break():
    segs = (PromptSegment(0, "tools", "tools"), PromptSegment(40, "messages[0]", "system"),
            PromptSegment(70, "messages[1]", "user"))
    b = locate_break(100, 32, 45, segs)
    assert (b.cached_tokens, b.break_at_token, b.break_segment, b.kind, b.recomputed_tokens) == \
        (32, 45, "messages[0]", "system", 68)
    assert locate_break(100, 32, 39, segs).break_segment == "tools"
    assert locate_break(100, 64, 70, segs).break_segment == "messages[1]"
    full = locate_break(100, 96, 100, segs)
    assert full.break_at_token is None and full.break_segment is None and full.recomputed_tokens == 4
    completions = locate_break(100, 16, 20)
    assert completions.break_at_token == 20 and completions.break_segment is None and completions.kind == "other"


def test_chat_segments_cover_the_tools_and_each_message(chat_checkpoint):
    from tailserve.model.tokenizer import Tokenizer
    from tailserve.server.chat import ChatTemplate

    tok = Tokenizer(chat_checkpoint)
    ct = ChatTemplate(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Checking."}, {"role": "tool", "content": "sunny"}]
    ids, segs = ct.render_segments(messages, TOOLS)
    assert ids == ct.render(messages, TOOLS)
    labels = [s.label for s in segs]
    # The Qwen-style template writes the system prompt, then the tools, in one system turn.
    assert labels == ["messages[0]", "tools", "messages[0]", "messages[1]", "messages[2]", "messages[3]"]
    assert [s.kind for s in segs] == ["system", "tools", "system", "user", "assistant", "tool"]
    ends = [s.start for s in segs[1:]] + [len(ids)]
    text_of = {s.label: tok.decode(ids[s.start : end], skip_special_tokens=False)
               for s, end in zip(segs, ends) if s.label != "messages[0]"}
    assert "get_weather" in text_of["tools"] and "Be brief" not in text_of["tools"]
    assert "Weather in Paris?" in text_of["messages[1]"] and "Checking." in text_of["messages[2]"]
    assert "sunny" in text_of["messages[3]"]
    _, bare = ct.render_segments(messages[:2])
    assert [s.label for s in bare] == ["messages[0]", "messages[1]"]


# -- through HTTP -------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, today and for the next three days",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search_docs", "description": "Full-text search over the product documentation",
    "parameters": {"type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]


@pytest.fixture(scope="module")
def client(tool_server):
    from openai import OpenAI

    return OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0)


def _system() -> dict:
    # A fresh system prompt per test: nothing another test cached shares its prefix.
    return {"role": "system", "content": f"You are a careful assistant for session {uuid.uuid4().hex}."}


def _chat(client, messages, tools=TOOLS):
    r = client.chat.completions.create(model="qwen-tiny", messages=messages, tools=tools, tool_choice="none",
                                       max_tokens=2, temperature=0)
    return r, r.timing["prefix_cache"]


def test_a_repeated_chat_request_is_a_full_hit(client):
    messages = [_system(), {"role": "user", "content": "What is the weather in Paris?"}]
    _, pc = _chat(client, messages)
    assert pc["cached_tokens"] == 0 and pc["break_segment"] == "messages[0]"  # a new system prompt
    again, pc = _chat(client, messages)
    prompt = again.usage.prompt_tokens
    assert pc == {"cached_tokens": (prompt - 1) // BS * BS, "break_at_token": None, "break_segment": None}
    assert again.usage.prompt_tokens_details.cached_tokens == pc["cached_tokens"]
    assert again.timing["cached_tokens"] == pc["cached_tokens"]


def test_an_edited_tool_description_breaks_at_the_tools(client):
    messages = [_system(), {"role": "user", "content": "What is the weather in Paris?"}]
    _chat(client, messages)
    edited = [WEATHER, {**SEARCH, "function": {**SEARCH["function"], "description": "Search the docs"}}]
    r, pc = _chat(client, messages, edited)
    assert pc["break_segment"] == "tools"
    assert 0 < pc["cached_tokens"] <= pc["break_at_token"] < r.usage.prompt_tokens


def test_a_new_user_message_breaks_at_it_with_the_shared_part_cached(client):
    system = _system()
    _chat(client, [system, {"role": "user", "content": "What is the weather in Paris?"}])
    _, pc = _chat(client, [system, {"role": "user", "content": "Find the install guide in the docs."}])
    assert pc["break_segment"] == "messages[1]"
    assert pc["cached_tokens"] >= BS * 4  # the system prompt and the tool catalogue


def test_an_edited_system_prompt_breaks_at_it(client):
    system = _system()
    user = {"role": "user", "content": "What is the weather in Paris?"}
    _chat(client, [system, user])
    edited = {"role": "system", "content": system["content"].replace("careful", "cheerful")}
    _, pc = _chat(client, [edited, user])
    assert pc["break_segment"] == "messages[0]"


def test_streamed_usage_carries_cached_tokens_and_the_counter_adds_up_by_segment(client, tool_server):
    def recomputed() -> dict[str, float]:
        text = httpx.get(tool_server.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line.startswith("tailserve:prefix_cache_recomputed_tokens_total{"):
                seg = line.split('segment="')[1].split('"')[0]
                out[seg] = float(line.rsplit(" ", 1)[1])
        return out

    system = _system()
    messages = [system, {"role": "user", "content": "What is the weather in Paris?"}]
    _chat(client, messages)
    before = recomputed()
    edited = [WEATHER, {**SEARCH, "function": {**SEARCH["function"], "description": "Search the docs"}}]
    stream = client.chat.completions.create(model="qwen-tiny", messages=messages, tools=edited, tool_choice="none",
                                            max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    timing = next(c.timing for c in chunks if getattr(c, "timing", None))
    assert usage.prompt_tokens_details.cached_tokens == timing["prefix_cache"]["cached_tokens"] > 0
    after = recomputed()
    assert after["tools"] - before.get("tools", 0.0) == usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens


def test_a_completions_prompt_gets_a_token_index_only(tool_server):
    prompt = f"def handler_{uuid.uuid4().hex}(event):\n    return event\n" * 3
    body = {"model": "qwen-tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    httpx.post(tool_server.url + "/v1/completions", json=body)
    body["prompt"] = prompt + "# edited\n" + prompt
    r = httpx.post(tool_server.url + "/v1/completions", json=body).json()
    pc = r["timing"]["prefix_cache"]
    assert pc["break_segment"] is None and pc["break_at_token"] >= pc["cached_tokens"] > 0
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == pc["cached_tokens"]


# -- KV kept across tool calls --------------------------------------------------------------------
def test_pinned_blocks_are_handed_out_last_and_only_until_their_pin_ends():
    now = [0.0]
    pool = BlockPool(num_blocks=8, block_size=BS, clock=lambda: now[0])
    agent = _cache_sequence(pool, list(range(64)))  # 4 cached blocks, free
    assert pool.pin(agent, 5.0) == agent and pool.num_pinned_free_blocks == 4
    got = pool.allocate(4)  # the other 4 free blocks go first
    assert not set(got) & set(agent) and pool.stats.pinned_taken == 0
    pool.check_consistency()
    # The agent's next turn finds its prefix: the pinned blocks are hits.
    hashes = pool.hash_blocks(list(range(64)), 4)
    hits = pool.lookup(list(range(64)), hashes)
    pool.touch(hits)
    assert hits == agent and pool.stats.pinned_hits == 4
    pool.free(hits)  # still within the pin: pinned again when freed
    assert pool.num_pinned_free_blocks == 4
    pool.free(got)
    now[0] = 6.0  # the pin is over: they are ordinary cached blocks again
    pool.allocate(4)
    assert pool.num_pinned_free_blocks == 0
    pool.check_consistency()


def test_pinned_blocks_still_give_way_when_nothing_else_is_free_and_unpin_ends_a_pin():
    now = [0.0]
    pool = BlockPool(num_blocks=4, block_size=BS, clock=lambda: now[0])
    agent = _cache_sequence(pool, list(range(64)))
    pool.pin(agent[:2], 5.0)
    pool.pin(agent[2:], 2.0)
    got = pool.allocate(3)  # nothing unpinned is free: the soonest-expiring pins go first
    assert got[:2] == agent[2:] and pool.stats.pinned_taken == 3
    pool.unpin(agent[:2])
    assert pool.num_pinned_free_blocks == 0 and pool.num_free_blocks == 1
    pool.check_consistency()


def test_a_forced_tool_call_pins_its_kv_and_a_final_answer_does_not(client, tool_server):
    def pinned() -> float:
        for line in httpx.get(tool_server.url + "/metrics").text.splitlines():
            if line.startswith("tailserve:kv_cache_pinned_blocks{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no tailserve:kv_cache_pinned_blocks gauge")

    # Other tests' pins end meanwhile (5 s), so the gauge can only be read as a bound.
    messages = [_system(), {"role": "user", "content": "What is the weather in Paris?"}]
    bounded = [{"type": "function", "function": {  # arguments a random model finishes within max_tokens
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}]
    r = client.chat.completions.create(model="qwen-tiny", messages=messages, tools=bounded, tool_choice="required",
                                       max_tokens=128, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    after_call = pinned()
    assert after_call >= (r.usage.prompt_tokens // BS) - 1  # the prompt's cached blocks, at least
    r = client.chat.completions.create(model="qwen-tiny", messages=[_system(), messages[1]], tools=bounded,
                                       tool_choice="auto", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason != "tool_calls"
    assert r.usage.prompt_tokens // BS > 8
    assert pinned() <= after_call  # its provisional pin ended with its answer (else ~30 more blocks)
