"""A bounded soak test of the real server: 12 seconds (TAILSERVE_SOAK_S for longer) of mixed
streaming and non-streaming load with client disconnects, stop strings, seeds and bursts
above the waiting bound (some 200 accepted requests here).

Afterwards: every request the server accepted finished (completed, or aborted because its
client left): the server's finished count equals its accepted count exactly, and that lies
between the requests the client knows were accepted and those plus the ones it dropped
before any answer; no request is running or waiting, no KV block is held, and the server's
resident memory grew by less than 150 MiB over the run (after a warm-up).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import time

import httpx
import pytest

from tailserve.bench.local_server import LocalServer

DURATION_S = float(os.environ.get("TAILSERVE_SOAK_S", "12"))
RSS_GROWTH_BOUND = 150 << 20


def _rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, stats: dict[str, int]) -> None:
    body = {"model": "soak", "prompt": rng.choice(["def f(x):", "class A:", "import os\n", "x = [", "# note"]),
            "max_tokens": rng.randint(1, 40), "temperature": rng.choice([0.0, 0.7, 1.0]),
            "seed": rng.randint(0, 100), "stop": rng.choice([None, ["\n\n"], ["):", "x"]])}
    stream = rng.random() < 0.5
    leave = rng.random() < 0.3
    body["stream"] = stream
    try:
        if stream:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    stats[f"http_{r.status_code}"] += 1
                    await r.aread()
                    return
                stats["accepted"] += 1
                events = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events += 1
                        if line == "data: [DONE]":
                            stats["completed"] += 1
                            return
                        if leave and events >= 2:
                            stats["left"] += 1
                            return  # closing the stream mid-way: the server must abort the request
                stats["truncated"] += 1
        else:
            timeout = 60.0
            if leave:  # a long request, dropped after 0.8 s: long enough that the server surely has it
                body.update(max_tokens=200, ignore_eos=True, stop=None)
                timeout = 0.8
            r = await client.post(url + "/v1/completions", json=body, timeout=timeout)
            if r.status_code == 200:
                stats["accepted"] += 1
                stats["completed"] += 1
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            else:
                stats[f"http_{r.status_code}"] += 1
    except httpx.TimeoutException:
        # Dropped before any answer: the server most likely has it (and must abort it when we
        # hang up), but under a burst its 429, or its reading of the body, can come later than
        # 0.8 s (CI saw 3 of 711). Only the server's own counters can tell.
        stats["unanswered"] += 1


def _wait_idle(url: str, finished_before: float, accepted_before: float, timeout_s: float = 30.0) -> str:
    """/metrics once nothing runs or waits and every accepted request is counted finished
    (aborts of the last disconnects land within a step or two; the gauges can read idle a
    moment before the last finished requests are counted), or at the deadline (the
    assertions then fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics").text
        idle = (_metric(text, "tailserve:num_requests_running") == 0
                and _metric(text, "tailserve:num_requests_waiting") == 0)
        counted = (_metric(text, "tailserve:request_success_total") - finished_before
                   >= _metric(text, "tailserve:request_accepted_total") - accepted_before)
        if (idle and counted) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


@pytest.mark.slow
def test_soak_mixed_load_with_disconnects_leaves_nothing_behind(llama_checkpoint):
    path, _ = llama_checkpoint
    flags = ["--model", str(path), "--dtype", "float32", "--no-warmup", "--kv-cache-memory", "2MiB",
             "--served-model-name", "soak", "--max-num-seqs", "8", "--max-waiting-requests", "8"]
    with LocalServer(flags) as srv:
        stats: dict[str, int] = {k: 0 for k in ("accepted", "completed", "left", "truncated", "http_429",
                                                  "unanswered")}
        rng = random.Random(7)

        async def drive(seconds: float) -> None:
            async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=None)) as client:
                tasks: set[asyncio.Task] = set()
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    burst = 24 if rng.random() < 0.05 else 1  # now and then far above the waiting bound
                    for _ in range(burst):
                        t = asyncio.ensure_future(_one(client, srv.url, rng, stats))
                        tasks.add(t)
                        t.add_done_callback(tasks.discard)
                    await asyncio.sleep(rng.expovariate(12.0))
                await asyncio.gather(*tasks)

        asyncio.run(drive(5.0))  # warm-up: allocator pools, imports, first shapes
        # The baseline once the warm-up's last aborts have landed (a disconnect is aborted
        # within a step or two of the client leaving): else one of them counts as finished
        # in the run without having been accepted in it (seen under load: 296 vs 295).
        m0 = _wait_idle(srv.url, 0.0, 0.0)
        rss_before = _rss(srv.proc.pid)
        base = {k: v for k, v in stats.items()}
        finished_before = _metric(m0, "tailserve:request_success_total")
        accepted_before = _metric(m0, "tailserve:request_accepted_total")
        rejected_before = _metric(m0, "tailserve:request_rejected_total")
        asyncio.run(drive(DURATION_S))
        text = _wait_idle(srv.url, finished_before, accepted_before)
        rss_after = _rss(srv.proc.pid)
        assert srv.proc.poll() is None and httpx.get(srv.url + "/health").status_code == 200

    run = {k: stats[k] - base.get(k, 0) for k in stats}
    # About 14 accepted and 3 disconnected a second here: the load must really have been one.
    assert run["accepted"] > 10 * DURATION_S and run["http_429"] > 0 \
        and run["left"] + run["unanswered"] > DURATION_S, run
    assert run["truncated"] == 0, run  # no accepted stream ended without [DONE] unless we left
    finished = _metric(text, "tailserve:request_success_total") - finished_before
    server_accepted = _metric(text, "tailserve:request_accepted_total") - accepted_before
    server_rejected = _metric(text, "tailserve:request_rejected_total") - rejected_before
    assert finished == server_accepted, (finished, server_accepted, run)  # nothing accepted was lost
    assert run["accepted"] <= server_accepted <= run["accepted"] + run["unanswered"], (server_accepted, run)
    assert run["http_429"] <= server_rejected <= run["http_429"] + run["unanswered"], (server_rejected, run)
    assert server_accepted + server_rejected <= run["accepted"] + run["http_429"] + run["unanswered"]
    assert run["completed"] + run["left"] == run["accepted"]
    assert _metric(text, "tailserve:num_requests_running") == 0 and _metric(text, "tailserve:num_requests_waiting") == 0
    assert _metric(text, "tailserve:kv_cache_usage_perc") == 0.0  # no block held by a live request
    assert rss_after - rss_before < RSS_GROWTH_BOUND, (rss_before >> 20, rss_after >> 20)
