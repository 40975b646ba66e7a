"""Request traces over OpenTelemetry: ``tailserve serve --otlp-traces-endpoint URL`` (vLLM's flag).

Each finished request becomes one server span, a child of the caller's W3C ``traceparent``
when the request carries one (so a gateway's or a load generator's trace continues through
the server), with the request's phases as span events: ``queued`` (arrival), ``scheduled``
(first scheduled), ``preempted`` (each preemption), ``first_token`` and ``finished``. The
attributes use vLLM's names where it has them (``gen_ai.request.id``,
``gen_ai.usage.prompt_tokens``, ``gen_ai.latency.time_in_queue``, ...), plus tailserve's own
(prefill and decode time, cached tokens, preemptions). The span is built from the request's
timeline when it finishes (its last token already stamped, so the span's figures are the ones
the response reports); the SDK queues it and exports batches on its own thread, so a request pays
for building one span, not for the export. Timestamps are wall-clock, converted from the
monotonic timeline once per request.

OpenTelemetry's SDK and its OTLP/HTTP exporter are an optional extra
(``pip install 'tailserve[otel]'``); spans go out in batches on the SDK's own thread. The
exporter speaks OTLP over HTTP/protobuf (``URL`` is the collector's traces endpoint, e.g.
``http://127.0.0.1:4318/v1/traces``), not gRPC: it needs no grpcio.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tailserve.errors import ConfigError
from tailserve.metrics.timeline import RequestMetrics
from tailserve.outputs import RequestOutput


@dataclass(frozen=True)
class TraceContext:
    """What the HTTP handler knows of a request for its span: when it arrived (the
    monotonic clock the timeline uses, and the wall clock at the same instant) and the
    caller's ``traceparent``."""

    request_id: str
    arrival_perf_ns: int
    arrival_wall_ns: int
    traceparent: str | None
    endpoint: str


class RequestTracer:
    def __init__(self, endpoint: str | None = None, exporter: Any = None, service_name: str = "tailserve") -> None:
        """``endpoint``: an OTLP/HTTP traces URL (batched export); ``exporter``: any span exporter
        instead (exported at once; the tests pass the SDK's in-memory one)."""
        if exporter is None and not (endpoint or "").startswith(("http://", "https://")):
            raise ConfigError(f"--otlp-traces-endpoint {endpoint!r}: an OTLP/HTTP URL, e.g. "
                              "http://127.0.0.1:4318/v1/traces")
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise ConfigError("--otlp-traces-endpoint needs OpenTelemetry's SDK: pip install 'tailserve[otel]'") \
                from None
        self.endpoint = endpoint if exporter is None else type(exporter).__name__
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise ConfigError("--otlp-traces-endpoint needs OpenTelemetry's OTLP exporter: pip install "
                                  "'tailserve[otel]'") from None
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tailserve")

    def context(self, request_id: str, arrival_perf_ns: int, traceparent: str | None, endpoint: str) -> TraceContext:
        wall = time.time_ns() - (time.perf_counter_ns() - arrival_perf_ns)
        return TraceContext(request_id, arrival_perf_ns, wall, traceparent, endpoint)

    def record(self, ctx: TraceContext, outs: Sequence[RequestOutput], model: str) -> None:
        """One span per prompt's output (a request of several prompts: several spans, one trace)."""
        parent = self._propagator.extract({"traceparent": ctx.traceparent}) if ctx.traceparent else None
        for i, out in enumerate(outs):
            if out.metrics is not None:
                self._span(ctx, out.metrics, model, parent, i if len(outs) > 1 else None)

    def _span(self, ctx: TraceContext, m: RequestMetrics, model: str, parent: Any, index: int | None) -> None:
        t0 = ctx.arrival_wall_ns

        def at(s: float) -> int:
            return t0 + int(s * 1e9)

        attrs: dict[str, Any] = {
            "gen_ai.request.id": ctx.request_id, "gen_ai.response.model": model,
            "gen_ai.usage.prompt_tokens": m.num_prompt_tokens, "gen_ai.usage.completion_tokens": m.num_output_tokens,
            "gen_ai.latency.time_in_queue": m.queue_s, "gen_ai.latency.time_to_first_token": m.ttft_s,
            "gen_ai.latency.e2e": m.e2el_s, "gen_ai.latency.time_in_model_prefill": m.prefill_s,
            "gen_ai.latency.time_in_model_decode": m.decode_s,
            "tailserve.cached_tokens": m.num_cached_tokens, "tailserve.preemptions": m.num_preemptions,
            "tailserve.finish_reason": m.finish_reason or "", "http.route": ctx.endpoint,
        }
        if index is not None:
            attrs["tailserve.prompt_index"] = index
        span = self.tracer.start_span("llm_request", context=parent, kind=self._kind, start_time=t0,
                                      attributes=attrs)
        span.add_event("queued", timestamp=t0)
        span.add_event("scheduled", timestamp=at(m.queue_s))
        for k, s in enumerate(m.preempted_at_s):
            span.add_event("preempted", {"tailserve.preemption": k}, timestamp=at(s))
        if m.num_output_tokens:
            span.add_event("first_token", timestamp=at(m.ttft_s))
        span.add_event("finished", {"tailserve.finish_reason": m.finish_reason or ""}, timestamp=at(m.e2el_s))
        span.end(end_time=at(m.e2el_s))

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes the batch
