"""Request traces: one OpenTelemetry span per request with its phase events, a child of the
caller's W3C traceparent; the bench sends and records one per request; the CLI flag exports
over real OTLP/HTTP to a collector on 127.0.0.1."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tailserve import LLM
from tailserve.bench.client import new_traceparent
from tailserve.bench.datasets import BenchRequest
from tailserve.bench.load import LoadConfig, run_load
from tailserve.errors import ConfigError
from tailserve.metrics.timeline import RequestMetrics, RequestTimeline
from tailserve.server.tracing import RequestTracer, TraceContext

MS = 1_000_000


def _events(span) -> dict[str, int]:
    return {e.name: e.timestamp for e in span.events}


# -- the span from a hand-made timeline (stage test) -----------------------------------------
def test_span_carries_phase_events_at_their_offsets_and_each_preemption():
    tl = RequestTimeline(arrival_ns=1_000 * MS, first_scheduled_ns=1_010 * MS, first_token_ns=1_040 * MS,
                         token_ns=[1_040 * MS, 1_050 * MS, 1_090 * MS], finished_ns=1_090 * MS,
                         preempted_ns=[1_055 * MS, 1_070 * MS], readmitted_ns=[1_060 * MS, 1_080 * MS])
    m = RequestMetrics.from_timeline("r1", tl, num_prompt_tokens=7, num_cached_tokens=0, finish_reason="length")
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter=exporter)
    ctx = TraceContext("r1", 1_000 * MS, 5_000 * MS, None, "/v1/completions")
    tracer._span(ctx, m, "tiny", None, None)
    (span,) = exporter.get_finished_spans()
    names = [e.name for e in span.events]
    assert names == ["queued", "scheduled", "preempted", "preempted", "first_token", "finished"]
    t = [e.timestamp - 5_000 * MS for e in span.events]
    assert t == [0, 10 * MS, 55 * MS, 70 * MS, 40 * MS, 90 * MS]  # wall = context's wall + offset
    assert span.start_time == 5_000 * MS and span.end_time == 5_090 * MS
    assert span.attributes["tailserve.preemptions"] == 2
    assert span.attributes["gen_ai.usage.completion_tokens"] == 3
    assert span.attributes["gen_ai.latency.time_in_queue"] == pytest.approx(0.010)


def test_tracer_refuses_an_endpoint_that_is_not_an_http_url():
    with pytest.raises(ConfigError, match="OTLP/HTTP URL"):
        RequestTracer("127.0.0.1:4317")


# -- through the server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced_server(llama_checkpoint):
    from conftest import serve_in_thread
    from tailserve.server.app import Server

    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20)
    exporter = InMemorySpanExporter()
    server = Server(llm.engine, start_engine_thread=True, tracer=RequestTracer(exporter=exporter))
    with serve_in_thread(server) as url:
        yield url, exporter


def _only_span(exporter, request_id: str):
    spans = [s for s in exporter.get_finished_spans() if s.attributes["gen_ai.request.id"] == request_id]
    assert len(spans) == 1, spans
    return spans[0]


def test_server_span_continues_the_callers_trace(traced_server):
    url, exporter = traced_server
    tp = new_traceparent()
    trace_id, parent_id = tp.split("-")[1], tp.split("-")[2]
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0,
                                                  "ignore_eos": True},
                   headers={"traceparent": tp, "X-Request-Id": "traced-1"}, timeout=60)
    assert r.status_code == 200
    span = _only_span(exporter, "traced-1")
    assert span.kind == SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == trace_id
    assert f"{span.parent.span_id:016x}" == parent_id
    usage = r.json()["usage"]
    assert span.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"] == 4
    assert span.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 5
    ev = _events(span)
    assert list(ev) == ["queued", "scheduled", "first_token", "finished"]
    assert ev["queued"] <= ev["scheduled"] <= ev["first_token"] <= ev["finished"] == span.end_time
    timing = r.json()["timing"]
    assert (ev["first_token"] - ev["queued"]) / 1e6 == pytest.approx(timing["ttft_ms"], abs=0.01)


def test_streamed_request_without_traceparent_is_a_root_span(traced_server):
    url, exporter = traced_server
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": [9, 10], "max_tokens": 3, "stream": True,
                                                             "ignore_eos": True},
                      headers={"X-Request-Id": "traced-2"}, timeout=60) as r:
        assert r.status_code == 200
        body = r.read().decode()
    assert body.rstrip().endswith("data: [DONE]")
    span = _only_span(exporter, "traced-2")
    assert span.parent is None
    assert span.attributes["gen_ai.usage.completion_tokens"] == 3
    assert span.attributes["http.route"] == "/v1/completions"


def test_bench_sends_a_traceparent_per_request_that_the_server_span_continues(traced_server):
    url, exporter = traced_server
    before = len(exporter.get_finished_spans())
    reqs = [BenchRequest(f"prompt {i}", 3, 4) for i in range(3)]
    run = asyncio.run(run_load(LoadConfig(url, ignore_eos=True), reqs))
    records = [r for r in run.records if not r.warmup]
    assert len(records) == 3 and all(r.success for r in records)
    sent = {r.traceparent.split("-")[1] for r in records}
    assert len(sent) == 3 and all(len(t) == 32 for t in sent)
    spans = exporter.get_finished_spans()[before:]
    assert {f"{s.context.trace_id:032x}" for s in spans} == sent
    assert records[0].as_dict()["traceparent"] == records[0].traceparent


def test_bench_records_the_users_own_traceparent(traced_server):
    url, exporter = traced_server
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    run = asyncio.run(run_load(LoadConfig(url, ignore_eos=True, headers={"TraceParent": tp}),
                               [BenchRequest("hello", 2, 2)]))
    (rec,) = run.records
    assert rec.traceparent == tp
    span = _only_span(exporter, rec.request_id)
    assert f"{span.context.trace_id:032x}" == "ab" * 16


# -- the CLI flag, exported over OTLP/HTTP to a collector on 127.0.0.1 ------------------------
@pytest.mark.slow
def test_serve_exports_spans_over_otlp_http(llama_checkpoint):
    from conftest import OTLPCollector
    from tailserve.bench.local_server import LocalServer

    collector = OTLPCollector()
    path, _ = llama_checkpoint
    tp = new_traceparent()
    try:
        with LocalServer(["--model", str(path), "--dtype", "float32", "--no-warmup", "--kv-cache-memory", "4MiB",
                          "--otlp-traces-endpoint", collector.url]) as srv:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2},
                           headers={"traceparent": tp, "X-Request-Id": "otlp-1"}, timeout=60)
            assert r.status_code == 200
        # the server's shutdown flushes the batch
        (span,) = collector.spans()
    finally:
        collector.close()
    assert span.trace_id.hex() == tp.split("-")[1]
    assert {a.key: a.value.string_value for a in span.attributes}["gen_ai.request.id"] == "otlp-1"
    assert [e.name for e in span.events][-1] == "finished"


def test_serve_rejects_a_bad_traces_endpoint_before_loading(capsys):
    from tailserve.bench.local_server import free_port
    from tailserve.cli import main

    assert main(["serve", "--model", "/nonexistent", "--port", str(free_port()), "--otlp-traces-endpoint",
                 "collector"]) == 2
    err = capsys.readouterr().err
    assert "--otlp-traces-endpoint 'collector'" in err and "/nonexistent" not in err
