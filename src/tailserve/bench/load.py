"""Drive one load level against a server: arrivals, the concurrency cap, warm-up, multi-turn
chains, and the server's counters around it. Returns every request's record."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from tailserve.bench.arrivals import arrival_offsets
from tailserve.bench.client import BenchClient, RequestRecord, RequestSpec, new_request_id, send_request
from tailserve.bench.datasets import BenchRequest
from tailserve.bench.saturation import SaturationVerdict, check_oversaturation, in_flight
from tailserve.bench.server_metrics import MetricsWatcher, ServerCounters
from tailserve.errors import ConfigError
from tailserve.model.tokenizer import Tokenizer

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class LoadConfig:
    base_url: str  # http://host:port (no /v1)
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model the server lists
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ramp: tuple[float, float] | None = None  # ramp-up: (start, end) requests/s
    ramp_strategy: str = "linear"  # or "exponential" (vLLM's --ramp-up-strategy)
    duration_s: float | None = None  # stop sending after this long (requests prepared in advance)
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    http2: bool = False
    keep_alive: bool = True
    timeout_s: float = 600.0
    seed: int = 0
    metrics_interval_s: float = 1.0  # gauge sampling (KV use, running, waiting)
    tool_choice: str = "none"  # sent with a dataset's tools (agentic)
    probe_rate: float | None = None  # --probe-request-rate: 1-token probes/s beside the load
    stop_on_oversaturation: bool = False
    oversaturation_min_window_s: float = 5.0  # the test's shortest window (bench/saturation.py)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"--url must start with http:// or https:// (got {self.base_url!r})")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError("--max-concurrency must be at least 1")
        if self.num_warmups < 0:
            raise ConfigError("--num-warmups must not be negative")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ConfigError("--duration must be positive")
        if self.timeout_s <= 0:
            raise ConfigError("--timeout must be positive")
        if self.probe_rate is not None and not (0 < self.probe_rate < math.inf):
            raise ConfigError("--probe-request-rate must be positive and finite")

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"


@dataclass
class LoadRun:
    config: LoadConfig
    model: str
    records: list[RequestRecord]  # measured requests only (warm-ups excluded)
    duration_s: float
    counters: ServerCounters
    num_warmups: int
    probes: list[RequestRecord] = field(default_factory=list)  # --probe-request-rate's, apart
    stopped: SaturationVerdict | None = None  # the live over-saturation test that stopped the level


def make_client(cfg: LoadConfig, max_connections: int | None = None) -> BenchClient:
    return BenchClient(http2=cfg.http2, keep_alive=cfg.keep_alive, timeout_s=cfg.timeout_s,
                       max_connections=max_connections)


async def first_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    try:
        r = await client.get(base_url + "/v1/models", headers=headers, timeout=30.0)
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {base_url}/v1/models: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise ConfigError(f"{base_url}/v1/models answered HTTP {r.status_code}; pass --model")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(f"{base_url}/v1/models listed no model; pass --model") from None


def _spec(cfg: LoadConfig, model: str, req: BenchRequest, messages: list[dict[str, Any]] | None,
          prompt: str) -> RequestSpec:
    return RequestSpec(url=cfg.base_url + cfg.endpoint, chat=cfg.chat, model=model, prompt=prompt,
                       messages=messages, max_tokens=req.output_len, ignore_eos=cfg.ignore_eos,
                       temperature=cfg.temperature, top_p=cfg.top_p, extra_body=cfg.extra_body,
                       headers=cfg.headers, keep_alive=cfg.keep_alive,
                       tools=list(req.tools) if req.tools is not None and cfg.chat else None,
                       tool_choice=cfg.tool_choice)


def _history_prompt(messages: list[dict[str, str]]) -> str:
    """Multi-turn history as plain text, for the completions endpoint."""
    return "".join(f"### {m['role'].capitalize()}\n{m['content']}\n\n" for m in messages) + "### Assistant\n"


def _tool_turn(r: RequestRecord, result: str, tool_name: str, turn: int) -> list[dict[str, Any]]:
    """The messages an agent appends after an answer: the answer itself and the tool's result,
    as a ``tool`` message answering each call the model made (the same result for each), or
    as a ``user`` message naming the tool when it made none (a tool message must answer a call)."""
    complete = [c for c in r.tool_calls if c["name"] and _is_json(c["arguments"])]  # max_tokens may cut one
    if not complete:
        return [{"role": "assistant", "content": r.text},
                {"role": "user", "content": f"Result of {tool_name}:\n{result}"}]
    answer: dict[str, Any] = {"role": "assistant", "content": r.text or None}
    calls = [{"id": c["id"] or f"call_{turn}_{i}", "type": "function",
              "function": {"name": c["name"], "arguments": c["arguments"]}} for i, c in enumerate(complete)]
    answer["tool_calls"] = calls
    return [answer, *({"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def run_load(cfg: LoadConfig, requests: list[BenchRequest], tokenizer: Tokenizer | None = None,
                   on_done: Callable[[RequestRecord], None] | None = None,
                   warmups: list[BenchRequest] | None = None) -> LoadRun:
    """Run one load level. ``requests``' own ``arrival_s`` (trace replay) wins over the rate.
    Warm-ups are ``warmups`` when given (prompts of their own, so they do not put the
    measured prompts into the server's prefix cache), else the first requests again."""
    if not requests:
        raise ConfigError("no requests to send")
    client = make_client(cfg)
    try:
        model = cfg.model or await first_model(client.control, cfg.base_url, cfg.headers)
        if cfg.num_warmups:
            pool = warmups or requests
            warm = [pool[i % len(pool)] for i in range(cfg.num_warmups)]
            t_w = time.perf_counter()
            await asyncio.gather(*[_one(client, cfg, model, r, RequestRecord(
                i, new_request_id(), r.prompt_len, r.output_len, 0.0, warmup=True), t_w, tokenizer, None)
                for i, r in enumerate(warm)])
        traced = all(r.arrival_s is not None for r in requests)
        if traced:
            offsets = [float(r.arrival_s) for r in requests]  # type: ignore[arg-type]
        else:
            offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed, cfg.ramp,
                                      cfg.ramp_strategy)
        watcher = MetricsWatcher(client.control, cfg.base_url, cfg.metrics_interval_s)
        await watcher.start()
        # A full garbage collection walks every object the process holds (in a process that
        # imported torch: hundreds of milliseconds) and stalls the event loop, and a stall
        # while a response is in flight reads as network time. Objects that exist before the
        # run are frozen out of the collector's walks for its duration.
        gc.collect()
        gc.freeze()
        try:
            sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
            records: list[RequestRecord] = []
            t0 = time.perf_counter()
            live = _Live(t0)
            probes: list[RequestRecord] = []
            side = []
            if cfg.probe_rate:
                side.append(asyncio.ensure_future(_probes(client, cfg, model, t0, probes, live)))
            if cfg.stop_on_oversaturation:
                side.append(asyncio.ensure_future(_watch_saturation(live, cfg.oversaturation_min_window_s)))
            tasks = []
            for i, (req, off) in enumerate(zip(requests, offsets)):
                if cfg.duration_s is not None and off > cfg.duration_s:
                    break
                delay = off - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if live.stopped is not None:
                    break  # over-saturated: the rest are not sent
                rec = RequestRecord(i, new_request_id(), req.prompt_len, req.output_len, off,
                                    conversation=req.conversation, turn=0, dispatch_s=time.perf_counter() - t0)
                live.records.append(rec)
                tasks.append(asyncio.ensure_future(
                    _conversation(client, cfg, model, req, rec, t0, tokenizer, sem, records, on_done)))
            await asyncio.gather(*tasks)
            live.done = True
            await asyncio.gather(*side)
        finally:
            gc.unfreeze()
        duration = time.perf_counter() - t0
        counters = await watcher.stop()
    finally:
        await client.aclose()
    records.sort(key=lambda r: (r.intended_s, r.index, r.turn))
    return LoadRun(cfg, model, records, duration, counters, cfg.num_warmups, probes, live.stopped)


@dataclass
class _Live:
    """What the side tasks of a level see while it runs."""

    t0: float
    records: list[RequestRecord] = field(default_factory=list)  # first turns, as they are sent
    done: bool = False  # every load request has finished
    stopped: SaturationVerdict | None = None


async def _watch_saturation(live: _Live, min_window_s: float) -> None:
    """The over-saturation test (bench/saturation.py) every second; on a positive one the
    level stops sending."""
    while not live.done and live.stopped is None:
        await asyncio.sleep(min(1.0, min_window_s / 4))
        now = time.perf_counter() - live.t0
        recs = list(live.records)
        points = [(r.start_s + r.ttft_s, r.ttft_s) for r in recs if r.ttft_s is not None]
        starts = [r.start_s for r in recs]
        t, conc = in_flight(starts, [r.end_s for r in recs], now)
        verdict = check_oversaturation(points, t, conc, now, min_window_s)
        if verdict.oversaturated:
            live.stopped = dataclasses.replace(verdict, at_s=now)


PROBE_PROMPT = "Reply with one word: ping {i}"


async def _probes(client: BenchClient, cfg: LoadConfig, model: str, t0: float, out: list[RequestRecord],
                  live: _Live) -> None:
    """1-token requests at ``cfg.probe_rate`` (Poisson, seeded) until the load's requests are
    done: they skip the concurrency cap, so they see the server as a new user's short request
    would, behind whatever the load keeps queued."""
    import numpy as np

    rng = np.random.default_rng(cfg.seed + 7919)
    pending = []
    i = 0
    while not live.done:
        await asyncio.sleep(float(rng.exponential(1.0 / cfg.probe_rate)))  # type: ignore[operator]
        if live.done:
            break
        req = BenchRequest(PROBE_PROMPT.format(i=i), 8, 1)
        rec = RequestRecord(-1 - i, new_request_id(), req.prompt_len, 1, time.perf_counter() - t0,
                            dispatch_s=time.perf_counter() - t0)
        spec = replace(_spec(cfg, model, req, [{"role": "user", "content": req.prompt}] if cfg.chat else None,
                             req.prompt), ignore_eos=False, tools=None)
        pending.append(asyncio.ensure_future(send_request(client, spec, rec, t0, None)))
        i += 1
    out.extend(await asyncio.gather(*pending))


async def _one(client: BenchClient, cfg: LoadConfig, model: str, req: BenchRequest, rec: RequestRecord,
               t0: float, tokenizer: Tokenizer | None, sem: asyncio.Semaphore | None,
               messages: list[dict[str, str]] | None = None, prompt: str | None = None) -> RequestRecord:
    if messages is None and req.messages is not None:
        messages = list(req.messages)
    spec = _spec(cfg, model, req, messages if cfg.chat else None, prompt if prompt is not None else req.prompt)
    if spec.messages:
        rec.roles = tuple(str(m.get("role")) for m in spec.messages)
    if rec.dispatch_s is None:
        rec.dispatch_s = time.perf_counter() - t0
    if sem is None:
        return await send_request(client, spec, rec, t0, tokenizer)
    async with sem:
        rec.slot_s = time.perf_counter() - t0
        return await send_request(client, spec, rec, t0, tokenizer)


async def _conversation(client: BenchClient, cfg: LoadConfig, model: str, req: BenchRequest,
                        rec: RequestRecord, t0: float, tokenizer: Tokenizer | None, sem: asyncio.Semaphore | None,
                        records: list[RequestRecord], on_done: Callable[[RequestRecord], None] | None) -> None:
    """A single request, or a multi-turn chain: each follow-up is sent when the previous
    answer is in, with the history (including that answer) in front of it."""
    messages = list(req.messages) if req.messages is not None else None
    prompt = _history_prompt(messages) if (messages is not None and not cfg.chat) else req.prompt
    r = await _one(client, cfg, model, req, rec, t0, tokenizer, sem, messages, prompt)
    records.append(r)
    if on_done:
        on_done(r)
    later = [("user", f) for f in req.follow_ups] + [("tool", t) for t in range(len(req.tool_results))]
    # The catalogue counts in every turn's prompt length (as the dataset counts it in the first).
    n_tools = len(tokenizer.encode(json.dumps(list(req.tools)))) if later and req.tools and tokenizer else 0
    for turn, (kind, item) in enumerate(later, start=1):
        if not r.success or messages is None:
            return  # a failed turn ends its conversation (its record says why)
        if kind == "user":
            messages = [*messages, {"role": "assistant", "content": r.text}, {"role": "user", "content": item}]
        else:  # agentic: the answer, the tool's result, and the tool's run time
            messages = [*messages, *_tool_turn(r, req.tool_results[item], req.tool_names[item], turn)]
            if req.think_time_s:
                await asyncio.sleep(req.think_time_s)
        prompt = _history_prompt(messages)
        n_in = len(tokenizer.encode(prompt)) + n_tools if tokenizer is not None else 0
        now = time.perf_counter() - t0
        nxt = RequestRecord(r.index, new_request_id(), n_in, req.output_len, now, conversation=req.conversation,
                            turn=turn)
        r = await _one(client, cfg, model, req, nxt, t0, tokenizer, sem, messages, prompt)
        records.append(r)
        if on_done:
            on_done(r)
