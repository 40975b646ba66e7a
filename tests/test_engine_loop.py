"""The engine loop inline on the server's event loop (``--engine-loop inline``, the CPU's
default): outputs stream as the engine makes them, a request arriving at an idle engine is
taken at once, a client that leaves frees its request, and everything matches offline."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tailserve import LLM, SamplingParams

KV = 4 << 20


@pytest.fixture(scope="module")
def inline_server(llama_checkpoint):
    from conftest import serve_in_thread
    from tailserve.server.app import Server

    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=KV)
    server = Server(llm.engine, start_engine_thread=False)
    with serve_in_thread(server) as url:
        yield llm, server, url


def _offline(path, prompts, max_tokens):
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=KV)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_concurrent_streams_match_offline(inline_server, llama_checkpoint):
    llm, _, url = inline_server
    prompts = [[5, 6, 7], [9, 10, 11, 12], list(range(20, 40)), [3] * 7]

    async def one(client, prompt):
        toks = []
        async with client.stream("POST", url + "/v1/completions",
                                 json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                       "stream": True, "logprobs": 0}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    for c in chunk["choices"]:
                        toks += c["logprobs"]["tokens"] if c.get("logprobs") else []
        return toks

    async def all_of():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(all_of())
    want = _offline(llama_checkpoint[0], prompts, 12)
    tok = llm.engine.tokenizer
    for g, w in zip(got, want):
        assert len(g) == 12
        if tok is not None:
            assert g == [tok.decode([t], skip_special_tokens=False) for t in w]


def test_idle_engine_takes_a_request_at_once(inline_server):
    """The idle engine loop waits on an event the handler sets: a request does not wait out
    the idle poll (0.5 s)."""
    _, _, url = inline_server
    time.sleep(0.6)  # idle for longer than one poll
    for _ in range(3):
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        assert r.json()["timing"]["queue_ms"] < 250
        time.sleep(0.3)


def test_client_that_leaves_frees_its_request(inline_server):
    llm, _, url = inline_server
    with httpx.stream("POST", url + "/v1/completions",
                      json={"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True},
                      timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 3:
                break
    deadline = time.monotonic() + 20
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()
    pool = llm.engine.core.block_pool
    assert pool.num_free_blocks == pool.num_blocks  # every block free or cached-and-evictable
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_shutdown_ends_the_inline_loop(llama_checkpoint):
    from tailserve.server.app import Server

    llm = LLM(str(llama_checkpoint[0]), dtype="float32", kv_cache_memory_bytes=KV)
    server = Server(llm.engine, start_engine_thread=False)

    async def run():
        task = asyncio.ensure_future(server.async_engine.run_in_loop())
        await asyncio.sleep(0.05)
        server.async_engine.shutdown()
        await asyncio.wait_for(task, 2)

    asyncio.run(run())


@pytest.mark.parametrize("handler_turns", [0, 3])
def test_a_request_that_comes_in_during_a_step_joins_the_next_one(llama_checkpoint, handler_turns):
    """Bytes read after a step create the handler's task; the loop runs that handler (and, while
    it is inside ``admitting()``, waits for its submit, e.g. a body read over several turns)
    before the next step, so the request is never a step late."""
    from tailserve.engine.async_engine import AsyncEngine

    llm = LLM(str(llama_checkpoint[0]), dtype="float32", kv_cache_memory_bytes=KV)
    ae = AsyncEngine(llm.engine, start_thread=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    steps: list[set[str]] = []  # the request ids each step scheduled
    sched = llm.engine.core.scheduler
    orig_schedule = sched.schedule

    def schedule(now_ns=None):
        out = orig_schedule(now_ns)
        steps.append({s.request_id for s in out.scheduled})
        return out

    sched.schedule = schedule
    came_in: list[int] = []

    async def handler():
        with ae.admitting():
            for _ in range(handler_turns):  # e.g. the rest of a body, read in later turns
                await asyncio.sleep(0)
            stream = ae.submit(llm.engine.prepare_request([5, 6, 7], params), "late", time.perf_counter_ns())
        async for _ in ae.outputs("late", stream):
            pass

    async def run():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(ae.run_in_loop())
        first = ae.submit(llm.engine.prepare_request([9, 10, 11], params), "busy", time.perf_counter_ns())
        orig_step = llm.engine.step
        done: list[asyncio.Future] = []

        def step():
            if len(steps) == 3 and not came_in:  # the request "comes in" during the third step
                came_in.append(len(steps))
                loop.call_soon(lambda: done.append(asyncio.ensure_future(handler())))  # as an I/O callback does
            return orig_step()

        llm.engine.step = step
        async for _ in ae.outputs("busy", first):
            pass
        await asyncio.wait_for(done[0], 30)
        ae.shutdown()
        await asyncio.wait_for(task, 5)

    asyncio.run(run())
    joined = next(i for i, ids in enumerate(steps) if "late" in ids)
    assert came_in == [3] and joined == 4  # it came in during step 3 and joins step 4
