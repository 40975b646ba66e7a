"""The OpenAI-compatible HTTP application (ASGI, Starlette).

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, POST /tokenize and /detokenize (as vLLM), GET /metrics (Prometheus text),
GET /health, GET /version.

Every generation response reports where its server-side time went: a ``Server-Timing``
header and a ``timing`` object in the body (non-streaming), or ``timing`` in the final
chunk (streaming). ``X-Request-Id`` is echoed back (taken from the client when it sends
one). Bad input gets an OpenAI-style error body with status 400 (bad value, malformed
JSON, non-UTF-8), 422 (wrong type), 413 (body over the limit), 404 (unknown model or path),
401 (wrong API key) or 429 (waiting queue full, with Retry-After); an engine failure fails
only the requests it touched (500) and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import tailserve
from tailserve.engine.async_engine import AsyncEngine, EngineOverloadedError, EngineRequestError
from tailserve.engine.llm_engine import LLMEngine
from tailserve.errors import ConfigError, InvalidRequestError
from tailserve.memory.allocator.snapshot import snapshot_bytes
from tailserve.metrics.prefix_break import PromptSegment
from tailserve.metrics.timeline import RequestMetrics
from tailserve.metrics.wire import WireTiming
from tailserve.outputs import CompletionOutput, RequestOutput
from tailserve.server.chat import ChatTemplate
from tailserve.server.protocol import (
    APIError,
    GenerationRequest,
    chat_request,
    check_fields,
    completion_request,
    field,
    parse_json_body,
    with_structured_outputs,
)
from tailserve.server.tool_pruning import ToolRanker, parse_tool_pruning
from tailserve.server.tools import ChoiceStream, ToolCallingConfig, ToolMode
from tailserve.server.tracing import RequestTracer, TraceContext

log = logging.getLogger("tailserve.server")
DEFAULT_MAX_BODY_BYTES = 1 << 20


# The log-probability a response shows for a token of probability zero (one a grammar's mask
# removed: logprobs are of the masked distribution): JSON has no -inf, and vLLM's OpenAI server
# clamps to the same value.
MIN_WIRE_LOGPROB = -9999.0


def _wire_logprob(v: float | None) -> float | None:
    """A log-probability as a response carries it: at least ``MIN_WIRE_LOGPROB`` (NaN too)."""
    return v if v is None or v >= MIN_WIRE_LOGPROB else MIN_WIRE_LOGPROB


def timing_dict(m: RequestMetrics | None) -> dict[str, Any] | None:
    """The body's ``timing`` object (metrics/wire.py)."""
    return None if m is None else WireTiming.from_metrics(m).to_wire()


def vllm_metrics(outs: Sequence[RequestOutput]) -> dict[str, Any] | None:
    """vLLM's ``metrics`` object (metrics/wire.py) for a response of one prompt and one
    choice; None otherwise, as vLLM leaves it."""
    if len(outs) != 1 or len(outs[0].outputs) != 1 or outs[0].metrics is None:
        return None
    return WireTiming.from_metrics(outs[0].metrics).to_vllm_metrics()


def server_timing_header(m: RequestMetrics | None) -> str:
    return "" if m is None else WireTiming.from_metrics(m).to_header()


class EventStreamResponse(StreamingResponse):
    """A streamed (SSE) answer that stops, and so aborts its engine requests, as soon as the
    client hangs up.

    Starlette's own stops the stream through an anyio cancel scope, which cancels a task only
    while the future it waits on is still pending, and retries at the next turn of the loop.
    With the engine loop inline (``--engine-loop inline``), every step hands the stream its
    next output before that retry comes, so a stream whose client had left ran to its last
    token (34 of 50 dropped streams in tests/test_server.py). Here a plain task watches for
    the disconnect and cancels the writer (asyncio's ``cancel`` holds even when the task is
    about to resume)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.current_task()
        assert writer is not None

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            writer.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from outside (server shutdown), not by a disconnect
            writer.uncancel()
        except OSError:  # the transport failed under a write: the client is gone too
            pass
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # aborts what is unfinished


class Server:
    def __init__(self, engine: LLMEngine, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 max_waiting_requests: int = 256, start_engine_thread: bool = True,
                 model_aliases: Sequence[str] = (), chat_template: str | None = None,
                 tool_calling: ToolCallingConfig | None = None, per_request_metrics: bool = False,
                 tracer: RequestTracer | None = None) -> None:
        self.engine = engine
        # --otlp-traces-endpoint: one span per request, built from its timeline when it finishes.
        self.tracer = tracer
        # --enable-per-request-metrics: vLLM's per-request ``metrics`` object beside ``timing``.
        self.per_request_metrics = per_request_metrics
        self.async_engine = AsyncEngine(engine, max_waiting_requests, start_thread=start_engine_thread)
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.model_name = engine.model_name
        # Every name a request may use: the served name first, then its aliases (the
        # checkpoint folder's own name, further --served-model-name values).
        self.model_names = [self.model_name, *[a for a in dict.fromkeys(model_aliases) if a != self.model_name]]
        self.chat = ChatTemplate(engine.tokenizer, chat_template) if engine.tokenizer is not None else None
        self.tool_calling = tool_calling or ToolCallingConfig()
        self.tool_ranker = ToolRanker()
        self.created = int(time.time())

    # -- plumbing ----------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    async def _read_json(self, request: Request) -> dict[str, Any]:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        return parse_json_body(b"".join(chunks))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"model '{model}' does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}", "model",
                           code="model_not_found")

    async def _submit(self, rid: str, prompts: list, greq: GenerationRequest, arrival_ns: int,
                      segments: tuple[PromptSegment, ...] = (), kv_pin_s: float = 0.0):
        def prepare() -> list:
            preps = [self.engine.prepare_request(p, greq.params, segments) for p in prompts]
            return [dataclasses.replace(p, kv_pin_s=kv_pin_s) for p in preps] if kv_pin_s else preps

        try:
            # A grammar's compilation can take a large schema hundreds of milliseconds: off the
            # event loop (llguidance drops the GIL), so other requests keep streaming meanwhile.
            prepared = await asyncio.to_thread(prepare) if greq.params.structured_outputs is not None else prepare()
        except InvalidRequestError as e:  # the context limit included: the Processor's one rule
            raise APIError(400, str(e), e.param, code=e.code) from None
        subs = []
        try:
            for i, prep in enumerate(prepared):
                sub_id = rid if len(prepared) == 1 else f"{rid}-{i}"
                # A response that is not streamed reads only the finished output.
                subs.append((sub_id, self.async_engine.submit(prep, sub_id, arrival_ns, final_only=not greq.stream),
                             prep))
        except EngineOverloadedError as e:
            for sub_id, _, _ in subs:
                self.async_engine.abort(sub_id)
            if self.engine.prometheus is not None:
                self.engine.prometheus.observe_rejected("overloaded")
            raise APIError(429, str(e), code="overloaded", headers={"Retry-After": "1"}) from None
        return subs

    async def _collect(self, request: Request, subs) -> list[RequestOutput]:
        async def one(sub_id, stream):
            last = None
            async for out in self.async_engine.outputs(sub_id, stream):
                last = out
            return last

        tasks = [asyncio.ensure_future(one(sid, st)) for sid, st, _ in subs]
        watcher = asyncio.ensure_future(self._watch_disconnect(request, tasks))
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            watcher.cancel()

    @staticmethod
    async def _watch_disconnect(request: Request, tasks) -> None:
        # A client that hangs up on a non-streaming request cancels its work (which aborts
        # the engine requests and frees their blocks).
        while not all(t.done() for t in tasks):
            if await request.is_disconnected():
                for t in tasks:
                    t.cancel()
                return
            await asyncio.sleep(0.25)

    def _headers(self, rid: str, m: RequestMetrics | None = None) -> dict[str, str]:
        h = {"X-Request-Id": rid}
        st = server_timing_header(m)
        if st:
            h["Server-Timing"] = st
        return h

    def _trace_context(self, request: Request, rid: str, arrival_ns: int) -> TraceContext | None:
        if self.tracer is None:
            return None
        return self.tracer.context(rid, arrival_ns, request.headers.get("traceparent"), request.url.path)

    def _record_trace(self, trace: TraceContext, outs: Sequence[RequestOutput]) -> None:
        assert self.tracer is not None
        try:
            self.tracer.record(trace, outs, self.model_name)
        except Exception as e:  # a tracing fault must never fail an answered request
            log.warning("request %s: span not recorded: %s", trace.request_id, e)

    # -- endpoints ------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        with self.async_engine.admitting():  # the engine loop waits for its submit
            arrival = time.perf_counter_ns()
            rid = request.headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
            self._check_auth(request)
            greq = completion_request(await self._read_json(request))
            self._check_model(greq.model)
            subs = await self._submit(rid, greq.prompts, greq, arrival)
        trace = self._trace_context(request, rid, arrival)
        if greq.stream:
            return EventStreamResponse(self._stream(rid, subs, greq, chat=False, trace=trace),
                                       media_type="text/event-stream", headers=self._headers(rid))
        outs = await self._collect(request, subs)
        choices = []
        n = greq.params.n
        for i, ((_, _, prep), out) in enumerate(zip(subs, outs)):
            for c in out.outputs:  # OpenAI's order: prompt by prompt, n choices each
                text = "" if greq.score_only else c.text
                lps = None
                if greq.logprobs is not None:
                    lps = self._echo_logprobs(out) if greq.echo else self._completion_logprobs(c, 0)
                    if greq.echo and not greq.score_only:
                        gen = self._completion_logprobs(c, 0)
                        lps = {k: lps[k] + gen[k] for k in lps} if gen else lps
                if greq.echo:
                    text = self._prompt_text(prep) + text
                choices.append({"index": i * n + c.index, "text": text,
                                "finish_reason": "length" if greq.score_only else c.finish_reason,
                                "stop_reason": None if greq.score_only else c.stop_reason, "logprobs": lps})
        return self._final_json(rid, "text_completion", choices, outs, score_only=greq.score_only, trace=trace)

    def _prompt_text(self, prep) -> str:
        if prep.prompt is not None:
            return prep.prompt
        return self.engine.tokenizer.decode(prep.prompt_token_ids, skip_special_tokens=False) \
            if self.engine.tokenizer else ""

    def _echo_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        """The prompt's tokens in the legacy logprobs format (None for the first token)."""
        ids = out.prompt_token_ids
        plp = out.prompt_logprobs or [None] * len(ids)
        return {"tokens": [self._token_text(t) for t in ids],
                "token_logprobs": [_wire_logprob(lp.get(t)) if lp else None for t, lp in zip(ids, plp)],
                "top_logprobs": [{self._token_text(k): _wire_logprob(v) for k, v in lp.items()} if lp else None
                                 for lp in plp]}

    async def chat_completions(self, request: Request) -> Response:
        with self.async_engine.admitting():  # the engine loop waits for its submit
            arrival = time.perf_counter_ns()
            rid = request.headers.get("x-request-id") or f"chatcmpl-{uuid.uuid4().hex}"
            self._check_auth(request)
            creq = chat_request(await self._read_json(request))
            greq = creq.greq
            self._check_model(greq.model)
            if self.chat is None:
                raise APIError(400, "this model has no tokenizer, so chat is not available; use /v1/completions "
                                    "with token ids", "messages")
            pruning = parse_tool_pruning(creq.tool_pruning, self.tool_calling.tool_pruning)
            pruned = None
            render_tools = creq.tools
            if creq.tools and pruning.mode != "off":
                pruned = self.tool_ranker.select(creq.tools, creq.messages, pruning, creq.forced_function)
                kept = [creq.tools[i] for i in pruned.kept]
                render_tools = kept if pruning.mode == "prune" else creq.tools
                compiler = self.engine.grammar_compiler
                masked = pruning.mode == "mask" and pruned.dropped > 0 and compiler is not None
                tools = ToolMode(creq, self.tool_calling, kept, constrain_auto=compiler.token_ref if masked else None)
            else:
                tools = ToolMode(creq, self.tool_calling)
            with_structured_outputs(greq, tools.structured, tools.skip_special_tokens)
            segments: tuple[PromptSegment, ...] = ()
            if self.engine.config.enable_prefix_caching:  # where a prompt left the cache is named by its parts
                prompt_ids, segments = self.chat.render_segments(creq.messages, render_tools)
            else:
                prompt_ids = self.chat.render(creq.messages, render_tools)
            extra: dict[str, Any] = {}
            if pruned is not None:
                saved = len(self.chat.render(creq.messages, creq.tools)) - len(prompt_ids) if pruned.dropped and \
                    render_tools is not creq.tools else 0
                extra["tool_pruning"] = pruned.to_wire(saved)
            subs = await self._submit(rid, [prompt_ids], greq, arrival, segments, tools.kv_pin_s)
        trace = self._trace_context(request, rid, arrival)
        if greq.stream:
            return EventStreamResponse(self._stream(rid, subs, greq, chat=True, tools=tools, extra=extra,
                                                    trace=trace),
                                       media_type="text/event-stream", headers=self._headers(rid))
        outs = await self._collect(request, subs)
        choices = []
        for c in outs[0].outputs:
            content, calls = tools.extract(c.text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            finish = c.finish_reason
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": c.index, "message": message, "finish_reason": finish,
                            "stop_reason": c.stop_reason,
                            "logprobs": self._chat_logprobs(c, 0, greq.logprobs) if greq.logprobs is not None
                            else None})
        if tools.kv_pin_s and not any(ch["finish_reason"] == "tool_calls" for ch in choices):
            self.async_engine.unpin(subs[0][0], greq.params.num_samples)  # a final answer: no pin
        return self._final_json(rid, "chat.completion", choices, outs, extra=extra, trace=trace)

    def _final_json(self, rid: str, obj: str, choices: list, outs: list[RequestOutput],
                    score_only: bool = False, extra: dict[str, Any] | None = None,
                    trace: TraceContext | None = None) -> JSONResponse:
        prompt_tokens = sum(o.num_prompt_tokens for o in outs)
        completion_tokens = 0 if score_only else sum(o.num_output_tokens for o in outs)
        slowest = max((o.metrics for o in outs if o.metrics is not None), key=lambda m: m.e2el_s, default=None)
        body = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens,
                          "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}},
                "timing": timing_dict(slowest), **(extra or {})}
        if self.per_request_metrics:
            body["metrics"] = vllm_metrics(outs)
        if self.engine.config.speculative_synthetic_acceptance is not None:  # LOSSY benchmark mode: labelled
            body["synthetic_acceptance"] = self.engine.config.speculative_synthetic_acceptance
        if trace is not None:
            self._record_trace(trace, outs)
        return JSONResponse(body, headers=self._headers(rid, slowest))

    async def _stream(self, rid: str, subs, greq: GenerationRequest, chat: bool,
                      tools: ToolMode | None = None, extra: dict[str, Any] | None = None,
                      trace: TraceContext | None = None) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        finals: list[RequestOutput] = []
        n = greq.params.n
        lp_sent: dict[int, int] = {}  # per choice: how many tokens' logprobs have been streamed
        echoed: set[int] = set()  # choices whose prompt (echo) has been sent
        ended: set[int] = set()  # choices whose finish_reason has been sent
        called = False  # whether a choice ended in a tool call (else a KV pin ends with the stream)
        # Tool calling: each choice's text through its parser (markup never reaches content).
        tool_streams: dict[int, ChoiceStream] = {}
        reads_tools = tools is not None and (tools.forced is not None or tools.parser is not None)
        events = self._events(subs)
        try:
            if chat:
                yield self._sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None} for i in range(n)]})
            async for sub, item in events:
                if isinstance(item, Exception):
                    err = APIError(500, f"internal error while generating: {item}")
                    log.error("request %s failed: %s", rid, item)
                    yield self._sse(err.body())
                    continue
                out = item
                choices = []
                for c in out.outputs:
                    index = sub * n + c.index  # OpenAI's order: prompt by prompt, n choices each
                    finish = c.finish_reason
                    if not c.delta_text and (finish is None or index in ended):
                        continue
                    delta: dict[str, Any] = {"content": c.delta_text}
                    if chat and reads_tools:
                        assert tools is not None
                        cs = tool_streams.get(index) or tool_streams.setdefault(index, tools.stream())
                        content, tool_deltas = cs.feed(c.delta_text)
                        if finish is not None:
                            more, more_deltas = cs.finish()
                            content, tool_deltas = content + more, tool_deltas + more_deltas
                            if cs.num_calls and finish == "stop":
                                finish = "tool_calls"
                        delta = {"content": content} if content else {}
                        if tool_deltas:
                            delta["tool_calls"] = [d.to_openai() for d in tool_deltas]
                        if not delta and finish is None:
                            continue  # held back: it may begin a call
                    if finish == "tool_calls":
                        called = True
                    if finish is not None:
                        ended.add(index)
                    # Logprobs of every token since the last chunk (tokens whose text is held
                    # back for a possible stop string travel with the chunk that carries it).
                    start = lp_sent.get(index, 0)
                    lps = None
                    if greq.logprobs is not None and c.logprobs is not None:
                        lp_sent[index] = len(c.logprobs)
                        lps = (self._chat_logprobs(c, start, greq.logprobs) if chat
                               else self._completion_logprobs(c, start))
                    if chat:
                        choices.append({"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish})
                        continue
                    text = c.delta_text
                    if greq.score_only:  # nothing generated is shown: the prompt (below) and the end
                        if finish is None:
                            continue
                        text, lps, finish = "", None, "length"
                    if greq.echo and index not in echoed:  # the prompt leads the choice's first chunk
                        echoed.add(index)
                        text = self._prompt_text(subs[sub][2]) + text
                        if greq.logprobs is not None:
                            plp = self._echo_logprobs(out)
                            lps = {k: plp[k] + (lps[k] if lps else []) for k in plp}
                    choices.append({"index": index, "text": text, "finish_reason": finish, "logprobs": lps})
                if not choices and not out.finished:
                    continue
                chunk: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                                         "choices": choices}
                if out.finished:
                    finals.append(out)
                    chunk["timing"] = timing_dict(out.metrics)
                    chunk.update(extra or {})
                    if self.engine.config.speculative_synthetic_acceptance is not None:
                        chunk["synthetic_acceptance"] = self.engine.config.speculative_synthetic_acceptance
                yield self._sse(chunk)
            if greq.include_usage:
                p = sum(o.num_prompt_tokens for o in finals)
                c = 0 if greq.score_only else sum(o.num_output_tokens for o in finals)
                cached = sum(o.num_cached_tokens for o in finals)
                usage_chunk = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                               "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c,
                                                        "total_tokens": p + c,
                                                        "prompt_tokens_details": {"cached_tokens": cached}}}
                if self.per_request_metrics and (m := vllm_metrics(finals)) is not None:
                    usage_chunk["metrics"] = m  # vLLM: only on the final usage chunk
                yield self._sse(usage_chunk)
            yield b"data: [DONE]\n\n"
            if tools is not None and tools.kv_pin_s and not called:
                for sub_id, _, _ in subs:
                    self.async_engine.unpin(sub_id, greq.params.num_samples)
        finally:
            await events.aclose()  # client gone or stream done: aborts whatever is unfinished
            if trace is not None and finals:
                self._record_trace(trace, finals)

    async def _events(self, subs) -> AsyncIterator[tuple[int, RequestOutput | Exception]]:
        """(choice index, output or error) from every sub-request, in arrival order."""
        if len(subs) == 1:  # the common case: no merging task, one hop less per token
            sub_id, stream, _ = subs[0]
            gen = self.async_engine.outputs(sub_id, stream)
            try:
                async for out in gen:
                    yield 0, out
            except Exception as e:  # delivered to the client as an error event
                yield 0, e
            finally:
                await gen.aclose()
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, sub_id: str, stream) -> None:
            try:
                async for out in self.async_engine.outputs(sub_id, stream):
                    await merged.put((index, out))
            except Exception as e:
                await merged.put((index, e))
            finally:
                await merged.put((index, None))

        tasks = [asyncio.ensure_future(pump(i, sid, st)) for i, (sid, st, _) in enumerate(subs)]
        open_streams = len(tasks)
        try:
            while open_streams:
                index, item = await merged.get()
                if item is None:
                    open_streams -= 1
                    continue
                yield index, item
        finally:
            for t in tasks:  # stopping the pumps aborts unfinished requests
                t.cancel()

    @staticmethod
    def _sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _token_text(self, tok: int) -> str:
        return self.engine.tokenizer.decode([tok], skip_special_tokens=False) if self.engine.tokenizer else str(tok)

    def _completion_logprobs(self, c: CompletionOutput, start: int) -> dict[str, Any] | None:
        """Legacy completions format, tokens ``start:``: each position's ``top_logprobs`` holds
        the ``logprobs`` most likely tokens plus the sampled one when it is not among them
        (so up to logprobs + 1 entries, as OpenAI documents)."""
        lps = c.logprobs
        if lps is None:
            return None
        toks = c.token_ids[start:len(lps)]
        lps = lps[start:]
        return {"tokens": [self._token_text(t) for t in toks],
                "token_logprobs": [_wire_logprob(lp.get(t)) for t, lp in zip(toks, lps)],
                "top_logprobs": [{self._token_text(k): _wire_logprob(v) for k, v in lp.items()} for lp in lps]}

    def _chat_logprobs(self, c: CompletionOutput, start: int, top_n: int) -> dict[str, Any] | None:
        """Chat format, tokens ``start:``: the sampled token's logprob, and ``top_logprobs``
        = the ``top_n`` most likely tokens (the sampled one included when it is among them)."""
        lps = c.logprobs
        if lps is None:
            return None

        def entry(tok: int, logprob: float | None) -> dict[str, Any]:
            text = self._token_text(tok)
            return {"token": text, "logprob": _wire_logprob(logprob), "bytes": list(text.encode("utf-8"))}

        content = []
        for t, lp in zip(c.token_ids[start:len(lps)], lps[start:]):
            # The dict holds the sampled token and the top_n most likely; the top_n are the
            # top_n largest values whether or not the sampled token is one of them.
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({**entry(t, lp.get(t)), "top_logprobs": [entry(k, v) for k, v in top]})
        return {"content": content}

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``POST /tokenize``: ``prompt`` (text) or chat ``messages`` -> token ids."""
        self._check_auth(request)
        body = await self._read_json(request)
        check_fields(body, frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}))
        self._check_model(field(body, "model", "str", None))
        tok = self._need_tokenizer()
        if "messages" in body and body["messages"] is not None:
            messages = chat_request({"messages": body["messages"]}).messages
            if not field(body, "add_generation_prompt", "bool", True):
                raise APIError(400, "add_generation_prompt=false is not supported", "add_generation_prompt",
                               code="unsupported_field")
            ids = self.chat.render(messages)  # type: ignore[union-attr]
        else:
            prompt = field(body, "prompt", "str", required=True)
            ids = tok.encode(prompt, add_special_tokens=field(body, "add_special_tokens", "bool", True))
        return JSONResponse({"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``POST /detokenize``: token ids -> text."""
        self._check_auth(request)
        body = await self._read_json(request)
        check_fields(body, frozenset({"model", "tokens"}))
        self._check_model(field(body, "model", "str", None))
        tok = self._need_tokenizer()
        ids = field(body, "tokens", "list", required=True)
        vocab = self.engine.arch.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise APIError(422, f"tokens[{i}] must be an integer", "tokens", code="invalid_type")
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}] = {t} is outside the vocabulary (0-{vocab - 1})", "tokens")
        return JSONResponse({"prompt": tok.decode(ids, skip_special_tokens=False)})

    def _need_tokenizer(self):
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer (tokenizer.json)", code="no_tokenizer")
        return self.engine.tokenizer

    async def models(self, request: Request) -> Response:
        self._check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "tailserve", "root": self.model_name,
            "max_model_len": self.engine.max_model_len} for name in self.model_names]})

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        prom = self.engine.prometheus
        if prom is None:
            raise APIError(404, "metrics are disabled (--disable-metrics)")
        # Live gauges: a scrape between steps must still see what is in use right now.
        return Response(self.engine.metrics_exposition(self.async_engine.num_waiting), media_type=CONTENT_TYPE_LATEST)

    async def health(self, request: Request) -> Response:
        if self.async_engine.dead is not None:  # for the moments before the process exits
            return JSONResponse({"status": "dead", "reason": self.async_engine.dead}, status_code=503)
        return JSONResponse(self.engine.health())

    async def memory_snapshot(self, request: Request) -> Response:
        """The CUDA caching allocator's snapshot, pickled as ``_dump_snapshot`` writes it.
        It exposes allocation sites (source paths), so it goes to authenticated requests only."""
        if self.api_key is None:
            raise APIError(403, "memory snapshots are served to authenticated requests only: start the server "
                                "with --api-key", code="auth_required")
        self._check_auth(request)
        try:
            snap = await asyncio.to_thread(self.engine.memory_snapshot)
        except ConfigError as e:
            raise APIError(400, str(e), code="no_cuda_device") from None
        return Response(snapshot_bytes(snap), media_type="application/octet-stream",
                        headers={"Content-Disposition": 'attachment; filename="memory_snapshot.pickle"'})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": tailserve.__version__})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err = APIError(exc.status_code, exc.detail or "error", code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code)


async def _engine_error(request: Request, exc: Exception) -> Response:
    rid = request.headers.get("x-request-id", "")
    log.error("request %s failed in the engine: %s", rid, exc)
    err = APIError(500, str(exc))
    return JSONResponse(err.body(), status_code=500)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error serving %s %s", request.method, request.url.path)
    err = APIError(500, f"internal server error: {type(exc).__name__}")
    return JSONResponse(err.body(), status_code=500)


def build_app(server: Server) -> Starlette:
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/version", server.version, methods=["GET"]),
        Route("/debug/memory/snapshot", server.memory_snapshot, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, EngineRequestError: _engine_error, Exception: _unexpected,
    })
    app.state.server = server
    return app
