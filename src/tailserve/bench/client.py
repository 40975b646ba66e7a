"""One streamed request to an OpenAI-compatible server, timed on the client's side.

Stamps (``time.perf_counter``, seconds since the run's start):

- ``intended_s``: when the arrival process meant the request to leave;
- ``dispatch_s``: when the sender woke up to send it;
- ``slot_s``: when it got a concurrency slot (``--max-concurrency`` only);
- ``send_s``: when the request headers went out on a connection (aiohttp's trace, or
  httpcore's), so connection set-up and pool waits show as the client's own lag;
- TTFT and E2EL start at ``start_s``: the slot (or the wake-up, without a cap), where
  ``vllm bench serve`` starts its clock; ``wire_ttft_s`` starts at ``send_s``;
- one stamp per content event, taken when the socket read that completed the event
  returned (``aiter_raw``), before any JSON parsing;
- ``end_s``: when the stream's ``[DONE]`` (or its end) was read.

Waking late plus ``send_s - slot_s`` is the client's own lag: when it grows, the client is saturated and
would otherwise inflate the server's latency silently, so it is reported.

The server's own account of the request is taken from the final chunks, in whichever form
the server speaks (``ServerTiming.source`` says which): tailserve's ``timing`` (queue,
prefill, decode, end-to-end), vLLM's ``metrics`` (``--enable-per-request-metrics``: queue,
TTFT from scheduling, generation; metrics/wire.py), llama.cpp's ``timings`` (prompt and
predicted milliseconds), or a W3C ``Server-Timing`` header. Servers that send none leave the
request unattributable.

A request that fails on a kept-alive connection before any response came back is sent again
on a new connection (``resends``, at most ``MAX_RESENDS``): the server had closed that
connection while it sat in the pool, and the client had not yet read the close. Go's and
urllib3's clients do the same, and httpcore checks an idle connection for a close before it
reuses one; aiohttp does neither. llama-server (llama.cpp b1-0c1e570) closes the connection
after every streamed response without a ``Connection: close``, so without this every other
request failed on one connection (docs/bench.md). A failure on a new connection, or after
the response status, is never resent.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from tailserve.metrics.wire import WireTiming
from tailserve.model.tokenizer import Tokenizer

MAX_RESENDS = 3  # tries past the first on a new connection, each after a reused one was found closed
ERROR_KINDS = ("http_4xx", "http_5xx", "timeout", "connect", "disconnect", "malformed_stream", "server_error")


@dataclass
class ServerTiming:
    """The server's phases for one request, in seconds (what it could see of the request)."""

    queue_s: float
    prefill_s: float
    decode_s: float
    e2e_s: float
    ttft_s: float
    source: str  # "tailserve" | "vllm" | "llama.cpp" | "server-timing"
    preemptions: int = 0
    cached_tokens: int | None = None
    prefix_cache: dict[str, Any] | None = None  # tailserve's: where the prompt left the prefix cache

    @classmethod
    def from_body(cls, obj: dict[str, Any]) -> ServerTiming | None:
        w = WireTiming.from_wire(obj.get("timing"))  # tailserve's (metrics/wire.py)
        if w is not None:
            return cls(w.queue_s, w.prefill_s, w.decode_s, w.e2e_s, w.ttft_s, "tailserve", w.preemptions,
                       w.cached_tokens, w.prefix_cache)
        w = WireTiming.from_vllm_metrics(obj.get("metrics"))  # vLLM's, with --enable-per-request-metrics
        if w is not None:
            return cls(w.queue_s, w.prefill_s, w.decode_s, w.e2e_s, w.ttft_s, "vllm")
        t = obj.get("timings")  # llama.cpp's server
        if isinstance(t, dict) and isinstance(t.get("prompt_ms"), (int, float)) and isinstance(
                t.get("predicted_ms"), (int, float)):
            p, d = t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3
            return cls(0.0, p, d, p + d, p, "llama.cpp", 0, t.get("cache_n"))
        return None

    @classmethod
    def from_header(cls, value: str | None) -> ServerTiming | None:
        """``Server-Timing: queue;dur=1.2, prefill;dur=3.4, ...`` (milliseconds, W3C format)."""
        w = WireTiming.from_header(value)
        return None if w is None else cls(w.queue_s, w.prefill_s, w.decode_s, w.e2e_s, w.ttft_s, "server-timing")

    def as_dict(self) -> dict[str, Any]:
        return {"queue_ms": self.queue_s * 1e3, "prefill_ms": self.prefill_s * 1e3, "decode_ms": self.decode_s * 1e3,
                "e2e_ms": self.e2e_s * 1e3, "ttft_ms": self.ttft_s * 1e3, "source": self.source,
                "preemptions": self.preemptions, "cached_tokens": self.cached_tokens,
                "prefix_cache": self.prefix_cache}


@dataclass
class RequestRecord:
    index: int
    request_id: str
    prompt_len: int
    max_tokens: int
    intended_s: float
    warmup: bool = False
    conversation: int | None = None
    turn: int = 0
    dispatch_s: float | None = None  # when the sender woke to send it
    slot_s: float | None = None  # when it got a concurrency slot (None: no cap)
    send_s: float | None = None
    headers_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    status: int | None = None
    text: str = ""
    output_tokens: int = 0
    output_tokens_source: str = "none"  # usage | tokenizer | chunks
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (OpenAI's field)
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # streamed calls: id, name, arguments
    roles: tuple[str, ...] = ()  # chat: the roles of the messages sent (to name a prefix break's segment)
    server: ServerTiming | None = None
    error_kind: str | None = None
    error: str = ""
    resends: int = 0  # sent again after a kept-alive connection was found closed (MAX_RESENDS)
    resend_s: float = 0.0  # time in those failed tries: the server's closing, not the client's lag
    # The W3C trace context sent with it (a server that traces continues this trace).
    traceparent: str = field(default_factory=lambda: new_traceparent())

    @property
    def success(self) -> bool:
        return self.error_kind is None and self.end_s is not None

    @property
    def start_s(self) -> float:
        """Where TTFT and E2EL start: when the client began this request, after any
        ``--max-concurrency`` slot wait and before it encoded the body and got a connection
        (``vllm bench serve`` starts its clock there too, so both tools report one figure).
        The wire-only figure, from the headers going out, is ``wire_ttft_s``."""
        if self.slot_s is not None:
            return self.slot_s
        if self.dispatch_s is not None:
            return self.dispatch_s
        return self.send_s if self.send_s is not None else self.intended_s

    @property
    def wire_ttft_s(self) -> float | None:
        """TTFT from the request's headers going out (without the client's own body encoding
        and connection set-up)."""
        return self.chunk_s[0] - self.send_s if self.chunk_s and self.send_s is not None else None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.start_s if self.chunk_s else None

    @property
    def ttst_s(self) -> float | None:
        """Time to the second content event (the second token, or later tokens with it)."""
        return self.chunk_s[1] - self.start_s if len(self.chunk_s) > 1 else None

    @property
    def e2el_s(self) -> float | None:
        return self.end_s - self.start_s if self.end_s is not None else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        if not self.chunk_s or self.output_tokens < 2 or self.end_s is None:
            return None
        # As vllm bench serve: (E2EL - TTFT) / (N - 1).
        return (self.end_s - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def send_lag_s(self) -> float | None:
        """The client's own delay: waking late for the send, plus the time from getting a slot
        to the headers going out (connection set-up included). Slot waits are not lag."""
        if self.send_s is None:
            return None
        woke = self.dispatch_s if self.dispatch_s is not None else self.intended_s
        ready = self.slot_s if self.slot_s is not None else woke
        return max(0.0, woke - self.intended_s) + max(0.0, self.send_s - ready - self.resend_s)

    @property
    def client_queue_s(self) -> float:
        """Time waiting for a concurrency slot (``--max-concurrency``: by design, not lag)."""
        if self.slot_s is None:
            return 0.0
        woke = self.dispatch_s if self.dispatch_s is not None else self.intended_s
        return max(0.0, self.slot_s - woke)

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "request_id": self.request_id, "warmup": self.warmup,
            "conversation": self.conversation, "turn": self.turn, "prompt_len": self.prompt_len,
            "server_prompt_tokens": self.server_prompt_tokens, "cached_tokens": self.cached_tokens,
            "tool_calls": [c["name"] for c in self.tool_calls], "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens, "output_tokens_source": self.output_tokens_source,
            "intended_s": self.intended_s, "dispatch_s": self.dispatch_s, "slot_s": self.slot_s,
            "start_s": self.start_s, "send_s": self.send_s, "headers_s": self.headers_s,
            "end_s": self.end_s, "ttft_ms": _ms(self.ttft_s), "wire_ttft_ms": _ms(self.wire_ttft_s),
            "ttst_ms": _ms(self.ttst_s), "tpot_ms": _ms(self.tpot_s),
            "e2el_ms": _ms(self.e2el_s), "send_lag_ms": _ms(self.send_lag_s),
            "client_queue_ms": self.client_queue_s * 1e3, "num_chunks": len(self.chunk_s),
            "itl_ms": [x * 1e3 for x in self.itl_s], "status": self.status, "error_kind": self.error_kind,
            "error": self.error, "resends": self.resends,
            "resend_ms": self.resend_s * 1e3, "traceparent": self.traceparent,
            "server_timing": self.server.as_dict() if self.server else None,
        }


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


@dataclass(frozen=True)
class RequestSpec:
    """What to send: built by the load runner from a dataset entry."""

    url: str  # full endpoint URL
    chat: bool
    model: str
    prompt: str
    messages: list[dict[str, str]] | None
    max_tokens: int
    ignore_eos: bool
    temperature: float
    top_p: float
    extra_body: dict[str, Any]
    headers: dict[str, str]
    keep_alive: bool = True
    tools: list[dict[str, Any]] | None = None  # chat: sent with tool_choice
    tool_choice: str = "none"

    def body(self) -> dict[str, Any]:
        b: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "stream": True,
                             "stream_options": {"include_usage": True}, "temperature": self.temperature,
                             "top_p": self.top_p}
        if self.ignore_eos:
            b["ignore_eos"] = True
        if self.chat:
            b["messages"] = self.messages or [{"role": "user", "content": self.prompt}]
            if self.tools:
                b["tools"] = self.tools
                b["tool_choice"] = self.tool_choice
        else:
            b["prompt"] = self.prompt
        b.update(self.extra_body)
        return b


def _now(t0: float) -> float:
    return time.perf_counter() - t0


class BenchClient:
    """The load generator's connections. HTTP/1.1 requests stream through aiohttp, HTTP/2
    (h2c, ``--http2``) through httpx, which has it (aiohttp has none); the control calls (the
    model list, ``/metrics`` scrapes) go through httpx either way. Why two: on the same load
    httpx's stack (httpcore, h11, anyio) cost ~170 ms of CPU per 1,000 streamed tokens here,
    aiohttp's ~35-45 (docs/bench.md), and a load generator that shares the machine with the
    server must not be what it measures. Create it inside the running event loop."""

    def __init__(self, http2: bool = False, keep_alive: bool = True, timeout_s: float = 600.0,
                 max_connections: int | None = None) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None if keep_alive else 0,
                              keepalive_expiry=60.0 if keep_alive else 0.0)
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))
        # http2 with http1 off = h2c with prior knowledge on http:// URLs (TLS+ALPN on https://).
        self.control = httpx.AsyncClient(http1=not http2, http2=http2, limits=limits, timeout=timeout)
        self.session: aiohttp.ClientSession | None = None
        if not http2:
            trace = aiohttp.TraceConfig()
            trace.on_request_headers_sent.append(_headers_sent)
            trace.on_connection_reuseconn.append(_connection_reused)
            # --timeout is per request, whole: a per-read timeout would re-arm a timer on every
            # chunk (a tenth of the client's CPU, measured).
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=max_connections or 0, force_close=not keep_alive,
                                               keepalive_timeout=60.0 if keep_alive else None),
                timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 30.0)),
                trace_configs=[trace], auto_decompress=False)

    async def aclose(self) -> None:
        await self.control.aclose()
        if self.session is not None:
            await self.session.close()


@dataclass
class _Sent:
    """What aiohttp's traces fill in for one try: the record's headers-sent stamp (against the
    run's clock), and whether the try went out on a kept-alive connection from the pool."""

    rec: RequestRecord
    t0: float
    reused: bool = False


async def _headers_sent(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    sent = ctx.trace_request_ctx
    if isinstance(sent, _Sent) and sent.rec.send_s is None:
        sent.rec.send_s = _now(sent.t0)


async def _connection_reused(session: aiohttp.ClientSession, ctx: Any, params: Any) -> None:
    sent = ctx.trace_request_ctx
    if isinstance(sent, _Sent):
        sent.reused = True


class _EventReader:
    """The SSE events of one streamed response -> its record. Stamps are taken by the caller
    when the socket read returned, before any parsing."""

    def __init__(self, spec: RequestSpec, rec: RequestRecord) -> None:
        self.spec, self.rec = spec, rec
        self.buf = b""
        self.pieces: list[str] = []
        self.done = False
        self.usage_tokens: int | None = None

    def _next_event(self) -> bytes | None:
        """The next complete event's bytes, taken off the buffer (None: none complete yet).
        Events end at a blank line: ``\\n\\n``, or ``\\r\\n\\r\\n`` from servers that write CRLF."""
        buf = self.buf
        i = buf.find(b"\n\n")
        if b"\r" in buf:
            j = buf.find(b"\r\n\r\n")
            if j != -1 and (i == -1 or j < i):
                self.buf = buf[j + 4:]
                return buf[:j]
        if i == -1:
            return None
        self.buf = buf[i + 2:]
        return buf[:i]

    def feed(self, raw: bytes, stamp: float) -> bool:
        """Take one read's bytes; False when the stream is malformed (the record says why)."""
        rec, spec = self.rec, self.spec
        self.buf += raw
        while True:
            event = self._next_event()
            if event is None:
                break
            data = _event_data(event)
            if data is None:
                continue
            if data == b"[DONE]":
                self.done = True
                continue
            try:
                obj = json.loads(data)
            except ValueError:  # not JSON, or not text
                rec.error_kind = "malformed_stream"
                rec.error = f"event is not JSON: {data[:80].decode(errors='replace')!r}"
                return False
            if not isinstance(obj, dict):
                rec.error_kind, rec.error = "malformed_stream", \
                    f"event is not an object: {data[:80].decode(errors='replace')!r}"
                return False
            if "error" in obj:
                err = obj["error"]
                rec.error_kind = "server_error"
                rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
                continue
            piece = _content(obj, spec.chat)
            # A call's arguments are output too (for TTFT and ITL), though not content.
            calls = spec.chat and _tool_call_deltas(obj, rec.tool_calls)
            if piece or calls:
                rec.chunk_s.append(stamp)
            if piece:
                self.pieces.append(piece)
                if _SERVER_KEYS.isdisjoint(obj):
                    continue  # a plain content chunk (the hot path): nothing of the server's account
            timing = ServerTiming.from_body(obj)
            # tailserve's own form is the richest; a tailserve server under
            # --enable-per-request-metrics also sends vLLM's, after it.
            if timing is not None and (rec.server is None or rec.server.source != "tailserve"):
                rec.server = timing
            usage = obj.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                self.usage_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    rec.server_prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                    rec.cached_tokens = details["cached_tokens"]
        return True


# The keys a chunk carries the server's account of the request in (ServerTiming.from_body, usage).
_SERVER_KEYS = frozenset(("timing", "metrics", "timings", "usage"))


async def _stream_aiohttp(session: aiohttp.ClientSession, spec: RequestSpec, rec: RequestRecord, t0: float,
                          headers: dict[str, str], reader: _EventReader) -> ServerTiming | None:
    for _ in range(MAX_RESENDS):
        sent = _Sent(rec, t0)
        tried = _now(t0)
        try:
            return await _stream_aiohttp_once(session, spec, rec, headers, reader, sent)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError):
            # Only a kept-alive connection that failed before any response: the server closed
            # it in the pool (see the module's docstring). A refused connect is a new one.
            if not sent.reused or rec.status is not None:
                raise
        rec.resends += 1
        rec.resend_s += _now(t0) - tried
        rec.send_s = None  # stamped again by the try that goes out
        await asyncio.sleep(0)  # let the loop read other pooled connections' closes first
    return await _stream_aiohttp_once(session, spec, rec, headers, reader, _Sent(rec, t0))


async def _stream_aiohttp_once(session: aiohttp.ClientSession, spec: RequestSpec, rec: RequestRecord,
                               headers: dict[str, str], reader: _EventReader, sent: _Sent) -> ServerTiming | None:
    t0 = sent.t0
    async with session.post(spec.url, json=spec.body(), headers=headers, trace_request_ctx=sent) as resp:
        rec.headers_s = _now(t0)
        rec.status = resp.status
        if rec.send_s is None:
            rec.send_s = rec.headers_s
        if resp.status >= 400:
            _http_error(rec, (await resp.read()).decode("utf-8", "replace"), t0)
            return None
        header_timing = ServerTiming.from_header(resp.headers.get("server-timing"))
        async for raw in resp.content.iter_any():
            if not reader.feed(raw, _now(t0)):
                return header_timing
        return header_timing


async def _stream_httpx(client: httpx.AsyncClient, spec: RequestSpec, rec: RequestRecord, t0: float,
                        headers: dict[str, str], reader: _EventReader) -> ServerTiming | None:
    async def trace(event: str, info: dict) -> None:
        if event.endswith("send_request_headers.started") and rec.send_s is None:
            rec.send_s = _now(t0)

    async with client.stream("POST", spec.url, json=spec.body(), headers=headers,
                             extensions={"trace": trace}) as resp:
        rec.headers_s = _now(t0)
        rec.status = resp.status_code
        if rec.send_s is None:  # a transport without trace events
            rec.send_s = rec.headers_s
        if resp.status_code >= 400:
            _http_error(rec, (await resp.aread()).decode("utf-8", "replace"), t0)
            return None
        header_timing = ServerTiming.from_header(resp.headers.get("server-timing"))
        async for raw in resp.aiter_raw():
            if not reader.feed(raw, _now(t0)):
                return header_timing
        return header_timing


def _http_error(rec: RequestRecord, body: str, t0: float) -> None:
    assert rec.status is not None
    rec.error_kind = "http_4xx" if rec.status < 500 else "http_5xx"
    rec.error = f"HTTP {rec.status}: {_error_message(body)}"
    rec.end_s = _now(t0)


async def send_request(client: BenchClient, spec: RequestSpec, rec: RequestRecord, t0: float,
                       tokenizer: Tokenizer | None) -> RequestRecord:
    """Send one streaming request and fill ``rec`` in; never raises for a failed request."""
    headers = {"X-Request-Id": rec.request_id, **spec.headers}
    own = next((v for k, v in spec.headers.items() if k.lower() == "traceparent"), None)
    if own is None:
        headers["traceparent"] = rec.traceparent
    else:  # a --header traceparent=... of the user's wins, and is what the record says was sent
        rec.traceparent = own
    if not spec.keep_alive:
        headers["Connection"] = "close"
    reader = _EventReader(spec, rec)
    try:
        if client.session is not None:
            header_timing = await _stream_aiohttp(client.session, spec, rec, t0, headers, reader)
        else:
            header_timing = await _stream_httpx(client.control, spec, rec, t0, headers, reader)
        if rec.error_kind is not None and rec.end_s is not None:
            return rec  # an HTTP error status: nothing was streamed
        if rec.error_kind == "malformed_stream":
            return rec
        rec.end_s = _now(t0)
        rec.text = "".join(reader.pieces)
        if rec.server is None:
            rec.server = header_timing
    except (httpx.TimeoutException, asyncio.TimeoutError) as e:
        rec.error_kind, rec.error = "timeout", f"{type(e).__name__}: {e}"
    except (httpx.ConnectError, aiohttp.ClientConnectorError) as e:
        rec.error_kind, rec.error = "connect", f"{type(e).__name__}: {e}"
    except (httpx.HTTPError, aiohttp.ClientError) as e:  # the peer closed, reset or cut the stream
        rec.error_kind, rec.error = "disconnect", f"{type(e).__name__}: {e}"
    if rec.error_kind is None and not reader.done:
        rec.error_kind, rec.error = "malformed_stream", "the stream ended without 'data: [DONE]'"
    # No content and no usage: nothing says a token was generated. (With usage, an empty text
    # is legitimate: every token was a special one the server does not show.)
    usage_tokens = reader.usage_tokens
    if rec.error_kind is None and not rec.chunk_s and rec.max_tokens > 0 and usage_tokens is None:
        rec.error_kind, rec.error = "malformed_stream", "the stream carried no content"
    if usage_tokens is not None:
        rec.output_tokens, rec.output_tokens_source = usage_tokens, "usage"
    elif tokenizer is not None and rec.text:
        rec.output_tokens, rec.output_tokens_source = len(tokenizer.encode(rec.text, add_special_tokens=False)), \
            "tokenizer"
    else:
        rec.output_tokens, rec.output_tokens_source = len(rec.chunk_s), "chunks"
    return rec


def _event_data(event: bytes) -> bytes | None:
    """An SSE event's data (its ``data:`` lines joined), None when it has none (a comment, a
    bare ``event:``)."""
    if event.startswith(b"data: ") and b"\n" not in event:  # the common case: one data line
        return event[6:]
    lines = [ln[5:].lstrip() for ln in event.splitlines() if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _content(obj: dict[str, Any], chat: bool) -> str:
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    if chat:
        delta = c.get("delta")
        if isinstance(delta, dict):
            return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        return ""
    text = c.get("text")
    return text if isinstance(text, str) else ""


def _tool_call_deltas(obj: dict[str, Any], calls: list[dict[str, str]]) -> bool:
    """Fold a chunk's ``delta.tool_calls`` into ``calls`` (by index: the first delta of a call
    has its id and name, later ones more of its arguments); whether the chunk had any."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    deltas = delta.get("tool_calls") if isinstance(delta, dict) else None
    if not isinstance(deltas, list) or not deltas:
        return False
    for d in deltas:
        if not isinstance(d, dict):
            continue
        i = d.get("index", len(calls))
        i = i if isinstance(i, int) and 0 <= i <= len(calls) else len(calls)
        if i == len(calls):
            calls.append({"id": "", "name": "", "arguments": ""})
        fn = d.get("function") if isinstance(d.get("function"), dict) else {}
        if isinstance(d.get("id"), str):
            calls[i]["id"] = d["id"]
        if isinstance(fn.get("name"), str):
            calls[i]["name"] += fn["name"]
        if isinstance(fn.get("arguments"), str):
            calls[i]["arguments"] += fn["arguments"]
    return True


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        return str(err)[:300]
    except json.JSONDecodeError:
        return body[:300]


def new_request_id() -> str:
    return f"bench-{uuid.uuid4().hex}"


def new_traceparent() -> str:
    """A W3C ``traceparent`` for one request: version 00, a random trace id and parent span
    id, sampled (so a server that traces records it; the trace id finds its span)."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01"
