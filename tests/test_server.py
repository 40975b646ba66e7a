"""The HTTP server, run for real in a subprocess on 127.0.0.1 and spoken to by real clients."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import time

import httpx
import pytest

from tailserve import SamplingParams
from tailserve.bench.local_server import LocalServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(server: LocalServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def offline(llama_checkpoint, engine_cache):
    path, _ = llama_checkpoint
    return engine_cache(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "for i in range(10):"]


def test_completions_equal_offline_generate(client, offline):
    ref = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    for prompt, r in zip(PROMPTS, ref):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == r.text
        assert out.usage.completion_tokens == r.num_output_tokens
        assert out.choices[0].finish_reason == r.finish_reason


def test_streamed_completion_equals_non_streamed(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == full.choices[0].finish_reason
    assert last.model_extra["timing"]["output_tokens"] == full.usage.completion_tokens


def test_n_samples_through_the_openai_client(client, offline):
    ref = offline.generate(PROMPTS[:2], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8))
    out = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, temperature=1.0, seed=3, max_tokens=8)
    # OpenAI's order: prompt by prompt, n choices each.
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [c.text for r in ref for c in r.outputs]
    assert out.usage.completion_tokens == sum(r.num_output_tokens for r in ref)
    assert out.usage.prompt_tokens == sum(r.num_prompt_tokens for r in ref)  # each prompt counted once
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, temperature=1.0, seed=3,
                                            max_tokens=8, stream=True, stream_options={"include_usage": True}))
    texts = [""] * 6
    finishes = [None] * 6
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                assert finishes[c.index] is None  # each choice ends once
                finishes[c.index] = c.finish_reason
    assert texts == [c.text for c in out.choices] and finishes == [c.finish_reason for c in out.choices]
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_chat_n_samples_streamed_and_not(client):
    messages = [{"role": "user", "content": "add two numbers"}]
    full = client.chat.completions.create(model="tiny", messages=messages, n=2, temperature=1.0, seed=8, max_tokens=8,
                                          logprobs=True, top_logprobs=1)
    assert [c.index for c in full.choices] == [0, 1]
    assert sum(len(c.logprobs.content) for c in full.choices) == full.usage.completion_tokens
    texts = ["", ""]
    for ch in client.chat.completions.create(model="tiny", messages=messages, n=2, temperature=1.0, seed=8,
                                             max_tokens=8, stream=True):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in full.choices]


def test_best_of_returns_n_of_the_samples(client):
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], n=2, best_of=4, temperature=1.0, seed=2,
                                    max_tokens=6, logprobs=0)
    assert [c.index for c in out.choices] == [0, 1]
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in out.choices]
    assert means[0] >= means[1]  # best first


def test_chat_streamed_and_not(client, offline):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "add two numbers"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    # Same prompt through the offline engine: the server's chat template + greedy decode.
    from tailserve.server.chat import ChatTemplate

    ids = ChatTemplate(offline.tokenizer).render(messages)
    assert offline.generate([ids], SamplingParams(temperature=0, max_tokens=10))[0].text == text


def test_concurrent_requests_all_complete_correctly(client, offline):
    prompts = [f"def f{i}(x):" for i in range(8)]
    ref = {p: o.text for p, o in zip(prompts, offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10)))}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: (p, client.completions.create(model="tiny", prompt=p, max_tokens=10,
                                                                     temperature=0).choices[0].text), prompts))
    assert {p: t for p, t in outs} == ref


def test_timing_headers_and_request_id(server):
    r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": "my-id-42"},
                   json={"prompt": "x = 1", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-42"
    st = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    assert set(st) == {"queue", "prefill", "ttft", "decode", "e2e"}
    t = r.json()["timing"]
    assert t["output_tokens"] == 5 and t["ttft_ms"] == pytest.approx(t["queue_ms"] + t["prefill_ms"])
    assert float(st["e2e"]) == pytest.approx(t["e2e_ms"], abs=1e-3)


def test_h2c_connection_outlives_a_thousand_requests(server):
    """One h2 connection carries 1100 requests (Hypercorn's default would send GOAWAY
    after 1000): a gateway's long-lived connection is never torn down by request count."""
    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    headers = [(":method", "GET"), (":path", "/health"), (":scheme", "http"),
               (":authority", f"127.0.0.1:{server.h2_port}")]
    statuses = []
    with socket.create_connection(("127.0.0.1", server.h2_port), timeout=30) as sock:
        sock.sendall(conn.data_to_send())
        for _ in range(1100):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, headers, end_stream=True)
            sock.sendall(conn.data_to_send())
            ended = False
            while not ended:
                data = sock.recv(65536)
                assert data, "the server closed the connection"
                for ev in conn.receive_data(data):
                    assert not isinstance(ev, h2.events.ConnectionTerminated), f"GOAWAY after {len(statuses)}"
                    if isinstance(ev, h2.events.ResponseReceived):
                        statuses.append(dict(ev.headers)[b":status"])
                    elif isinstance(ev, h2.events.DataReceived):  # give the flow-control window back
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                        ended = True
                out = conn.data_to_send()
                if out:
                    sock.sendall(out)
    assert statuses == [b"200"] * 1100


def test_http2_prior_knowledge(server):
    body = {"prompt": "y = 2", "max_tokens": 3, "temperature": 0}
    with httpx.Client(http1=False, http2=True) as c:
        r = c.post(server.url_h2 + "/v1/completions", json=body)
        assert r.status_code == 200 and r.http_version == "HTTP/2"
        # Streaming over h2 too, and the same greedy text as over HTTP/1.1.
        with c.stream("POST", server.url_h2 + "/v1/completions", json={**body, "stream": True}) as rs:
            assert rs.http_version == "HTTP/2"
            lines = [ln for ln in rs.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(c["text"] for ln in lines[:-1] for c in json.loads(ln[6:])["choices"])
    with httpx.Client() as c:
        r1 = c.post(server.url + "/v1/completions", json=body)
    assert r1.http_version == "HTTP/1.1"
    assert r1.json()["choices"][0]["text"] == r.json()["choices"][0]["text"] == streamed


BAD = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b"\xff\xfe\x00garbage", 400, "invalid_encoding"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("/v1/completions", os.urandom(1_000_000), 413, "request_too_large"),
    ("/v1/completions", json.dumps({"max_tokens": 5}).encode(), 400, "missing_field"),
    ("/v1/chat/completions", json.dumps({"model": "tiny"}).encode(), 400, "missing_field"),
    ("/v1/completions", json.dumps({"prompt": "a", "max_tokens": "ten"}).encode(), 422, "invalid_type"),
    ("/v1/completions", json.dumps({"prompt": {"a": 1}}).encode(), 422, "invalid_type"),
    ("/v1/completions", json.dumps({"prompt": "a", "stop": 5}).encode(), 422, "invalid_type"),
    ("/v1/completions", json.dumps({"prompt": "a", "max_tokens": -5}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "temperature": 10}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "top_p": 0}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "n": 200}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "n": 3, "best_of": 2}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "n": 1, "best_of": 2, "stream": True}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": [5] * 600, "max_tokens": 4}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "max_tokens": 100_000}).encode(), 400, "context_length_exceeded"),
    ("/v1/completions", json.dumps({"prompt": "", "max_tokens": 4}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "model": "gpt-4"}).encode(), 404, "model_not_found"),
    ("/v1/chat/completions", json.dumps({"messages": [{"content": "no role"}]}).encode(), 422, "invalid_type"),
    ("/v1/nope", b"{}", 404, "not_found"),
    ("/debug/memory/snapshot", b"", 403, "auth_required"),  # this server has no --api-key
    # Fields this server does not implement: 400 naming the field, never a 200 that ignores it.
    ("/v1/completions", json.dumps({"prompt": "a", "suffix": "b"}).encode(), 400, "unsupported_field"),
    ("/v1/completions", json.dumps({"prompt": "a", "frequency_penalty": 5}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "logit_bias": {"99999999": 1}}).encode(), 400, None),
    ("/v1/completions", json.dumps({"prompt": "a", "no_such_field": 1}).encode(), 400, "unsupported_field"),
    ("/v1/completions", json.dumps({"prompt": "a", "stream": True, "stream_options": {
        "continuous_usage_stats": True}}).encode(), 400, "unsupported_field"),
    # tools with tool_choice auto (the default) on a server without --enable-auto-tool-choice
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{
        "type": "function", "function": {"name": "f"}}]}).encode(), 400, None),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "grammar"}}).encode(), 400, "unsupported_field"),
]


@pytest.mark.parametrize("path, body, status, code", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_documented_error_and_server_survives(server, path, body, status, code):
    r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200
    assert health.json()["cuda_allocator"] == {"conf": "default", "source": "default", "memory_fraction": None,
                                               "warnings": []}


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]), ("prediction", {"type": "content"}),
                                          ("best_of", 2), ("min_tokens", 3)])
def test_unsupported_fields_through_the_openai_client_name_the_field(client, field, value):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={field: value})
    assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_field"


def test_neutral_values_of_unimplemented_fields_are_accepted(client):
    # vllm bench serve sends repetition_penalty=1.0 with every request: it asks for nothing.
    out = client.completions.create(model="tiny", prompt="def f(", max_tokens=3, n=1, presence_penalty=0,
                                    frequency_penalty=0.0, extra_body={"repetition_penalty": 1.0, "best_of": 1})
    assert out.choices[0].finish_reason in ("length", "stop")


def test_models_version_metrics(server):
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(server.url + "/version").json()["version"]
    assert "tailserve:time_to_first_token_seconds_bucket" in httpx.get(server.url + "/metrics").text


def test_gateway_metrics_mirror_the_load_gauges_under_vllm_names(server):
    import threading

    def scrape() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(("vllm:", "tailserve:num_requests", "tailserve:kv_cache_usage_perc"))}

    # Under load the gateway sees the requests run (an engine step can land between the two
    # names' reads within one scrape, so exact equality is checked when the server is idle).
    # 300 tokens each: with 60, under the full suite's parallel load on 2 cores, the requests
    # once finished before the first scrape was answered.
    def load() -> None:
        httpx.post(server.url + "/v1/completions", json={"prompt": "def h(", "max_tokens": 300, "ignore_eos": True},
                   timeout=60)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    seen_running = 0.0
    while any(t.is_alive() for t in threads):
        v = scrape()
        assert 0.0 <= v["vllm:kv_cache_usage_perc"] <= 1.0 and v["vllm:num_requests_waiting"] >= 0
        seen_running = max(seen_running, v["vllm:num_requests_running"])
    for t in threads:
        t.join()
    assert seen_running >= 1
    v = scrape()
    assert v["vllm:num_requests_running"] == v["tailserve:num_requests_running"]
    assert v["vllm:num_requests_waiting"] == v["tailserve:num_requests_waiting"]
    assert v["vllm:kv_cache_usage_perc"] == v["tailserve:kv_cache_usage_perc"] == v["vllm:gpu_cache_usage_perc"]
    text = httpx.get(server.url + "/metrics").text
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and 'num_gpu_blocks="' in info[0]
    assert 'cache_dtype="bfloat16"' in info[0] or 'cache_dtype="float32"' in info[0]
    # The request-phase histograms under vLLM's names: the same counts and sums as tailserve's,
    # bucket by bucket, and buckets fine enough for a sub-100 ms SLO.
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    from tailserve.metrics.prometheus import GATEWAY_HISTOGRAMS

    for name in GATEWAY_HISTOGRAMS:
        mirrored = {k.replace(name, "", 1): v for k, v in samples.items() if k.startswith(name + "_")}
        own = {k.replace("tailserve:" + name[5:], "", 1): v for k, v in samples.items()
               if k.startswith("tailserve:" + name[5:] + "_") and "_created{" not in k}
        assert mirrored and mirrored == own, name
    assert samples['vllm:e2e_request_latency_seconds_count{model_name="tiny"}'] >= 3
    assert sum(1 for k in samples if k.startswith("vllm:time_to_first_token_seconds_bucket")
               and float(k.split('le="')[1].split('"')[0]) < 0.1) >= 10


def test_per_request_metrics_in_vllms_shape_beside_timing(server):
    """--enable-per-request-metrics: vLLM's metrics object in the body, and in the final usage
    chunk when streaming, with vLLM's meanings (TTFT from scheduling = tailserve's prefill)."""
    body = {"model": "tiny", "prompt": "def f(", "max_tokens": 6, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    m, t = r["metrics"], r["timing"]
    assert set(m) == {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms",
                      "tokens_per_second"}
    assert m["queue_time_ms"] == pytest.approx(t["queue_ms"]) and m["time_to_first_token_ms"] == \
        pytest.approx(t["prefill_ms"]) and m["generation_time_ms"] == pytest.approx(t["decode_ms"])
    assert m["mean_itl_ms"] == pytest.approx(t["decode_ms"] / 5)
    assert m["tokens_per_second"] == pytest.approx(6 / ((t["prefill_ms"] + t["decode_ms"]) / 1e3))
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    with_metrics = [e for e in events if "metrics" in e]
    assert len(with_metrics) == 1 and with_metrics[0] is events[-1] and "usage" in events[-1]
    assert with_metrics[0]["metrics"]["generation_time_ms"] >= 0
    # As vLLM: one prompt and one choice only.
    assert httpx.post(server.url + "/v1/completions", json={**body, "n": 2}, timeout=60).json()["metrics"] is None


def test_gateway_gauges_follow_the_engine(offline, llama_checkpoint):
    from tailserve.config import EngineConfig
    from tailserve.engine.llm_engine import LLMEngine

    path, _ = llama_checkpoint
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory_bytes=4 << 20,
                                 gateway_metrics=True))
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=8))
    eng.add_request([8, 9], SamplingParams(max_tokens=8))
    eng.step()
    reg, labels = eng.prometheus.registry, {"model_name": eng.model_name}
    eng.metrics_exposition(num_waiting=4)
    assert reg.get_sample_value("vllm:num_requests_running", labels) == 2
    assert reg.get_sample_value("vllm:num_requests_waiting", labels) == 4
    assert reg.get_sample_value("vllm:kv_cache_usage_perc", labels) == eng.kv_figures().block_utilization > 0


def test_gateway_metrics_are_off_by_default(offline):
    assert b"vllm:" not in offline.engine.metrics_exposition()


@pytest.mark.parametrize("protocol", ["HTTP/1.1", "h2c"])
def test_dropped_streams_free_every_kv_block(server, protocol):
    import threading

    h2 = protocol == "h2c"
    url = server.url_h2 if h2 else server.url

    # As long as the tiny model's 512-token context allows: a request must not run to its end
    # before its client closes the stream. With 200 tokens, on a fast CPU under the full suite
    # (four workers on two cores), 2 of 50 client threads were kept from running long enough
    # for theirs to finish first (counted as length, not abort); alone it never failed.
    # The clients are made before the threads start (each takes ~10 ms of the GIL): made in
    # the threads, the last streams began after the first had already run to their end.
    clients = [httpx.Client(timeout=30, http1=not h2, http2=h2) for _ in range(50)]

    def open_and_drop(i: int) -> None:
        with clients[i] as c, c.stream("POST", url + "/v1/completions", json={
                "prompt": f"def g{i}(x):", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 4:
                    break  # leave mid-stream: closing the connection

    def aborted() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tailserve:request_success_total{") and 'finished_reason="abort"' in line)

    aborted_before = aborted()
    threads = [threading.Thread(target=open_and_drop, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 30
    while time.time() < deadline:
        if metric(server, "tailserve:kv_cache_usage_perc") == 0 \
                and metric(server, "tailserve:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric(server, "tailserve:kv_cache_usage_perc") == 0
    assert metric(server, "tailserve:num_requests_running") == 0
    # Freed because the disconnects aborted them, not because they ran to max_tokens.
    assert aborted() - aborted_before == 50
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_flood_gets_429_then_accepted_requests_complete(llama_checkpoint):
    path, _ = llama_checkpoint
    with LocalServer(["--model", str(path), "--dtype", "float32", "--no-warmup", "--kv-cache-memory", "8MiB",
                      "--max-num-seqs", "1", "--max-waiting-requests", "2", "--api-key", "sekret"]) as s:
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "a"}).status_code == 401
        body = {"prompt": "def flood(x):", "max_tokens": 40, "temperature": 0, "ignore_eos": True}

        def send(_):
            r = httpx.post(s.url + "/v1/completions", json=body, headers=auth, timeout=120)
            return r.status_code, r.headers.get("retry-after"), r.json()

        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            results = list(pool.map(send, range(24)))
        codes = [c for c, _, _ in results]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        assert all(ra == "1" for c, ra, _ in results if c == 429)
        assert all(b["usage"]["completion_tokens"] == 40 for c, _, b in results if c == 200)
        assert metric(s, "tailserve:request_success_total") == codes.count(200)
        assert metric(s, "tailserve:request_accepted_total") == codes.count(200)
        assert metric(s, "tailserve:request_rejected_total") == codes.count(429)


def test_several_prompts_in_one_request(client, offline):
    prompts = ["def a(x):", "def b(y):"]
    ref = [o.text for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == ref
    texts = ["", ""]
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == ref


def test_port_in_use_is_a_one_line_error(server, capsys):
    """Checked before the model loads, so through ``cli.main`` in this process (no engine is built)."""
    from tailserve.cli import main

    capsys.readouterr()
    assert main(["serve", "--port", str(server.port)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"tailserve: error: cannot listen on 127.0.0.1:{server.port}: Address already in use"
    assert main(["serve", "--port", str(_free_port()), "--http2-port", str(server.h2_port)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"tailserve: error: cannot listen on 127.0.0.1:{server.h2_port}: Address already in use"


def test_speculative_server_reports_acceptance(llama_checkpoint, offline):
    """Speculation on (the target as its own draft, k fixed at 3: with a draft as dear as the
    target, the adaptive controller may rightly measure a loss and turn it off): greedy text
    is the offline engine's, and each response's timing carries the spec figures
    (non-streaming body and the streamed final chunk), as do the Prometheus counters."""
    path, _ = llama_checkpoint
    with LocalServer(["--model", str(path), "--dtype", "float32", "--no-warmup", "--kv-cache-memory", "8MiB",
                      "--speculative-model", str(path), "--num-speculative-tokens", "3"]) as s:
        body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        ref = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
        spec = r.json()["timing"]["spec"]
        assert spec["draft_tokens"] > 0 and spec["acceptance_rate"] == 1.0
        assert spec["mean_acceptance_length"] > 1.0
        with httpx.stream("POST", s.url_h2 + "/v1/completions",
                          json={**body, "stream": True}, timeout=60) as st:
            events = [json.loads(line[6:]) for line in st.iter_lines() if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == ref.text
        assert events[-1]["timing"]["spec"]["accepted_tokens"] == events[-1]["timing"]["spec"]["draft_tokens"] > 0
        assert metric(s, "tailserve:spec_decode_num_accepted_tokens_total") > 0


def test_served_model_name_defaults_to_model_as_given_and_sigterm_stops_cleanly(llama_checkpoint):
    # vllm bench serve --model /path/to/ckpt sends the path itself as "model".
    path, _ = llama_checkpoint
    with LocalServer(["--model", str(path), "--dtype", "float32", "--no-warmup", "--kv-cache-memory", "2MiB"]) as s:
        ids = [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]]
        assert ids == [str(path), path.name]
        for name in ids:
            r = httpx.post(s.url + "/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == str(path)
        r = httpx.post(s.url + "/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        s.proc.terminate()
        assert s.proc.wait(timeout=30) == 0
        log = s.output()
        assert "Traceback" not in log
        frozen = re.search(r"garbage collector: (\d+) start-up objects frozen", log)
        assert frozen and int(frozen.group(1)) > 10_000  # torch and the model, out of every full collection


def test_several_served_model_names(server, llama_checkpoint):
    path, _ = llama_checkpoint
    ids = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert ids == ["tiny", "fuzz", path.name]
    r = httpx.post(server.url + "/v1/completions", json={"model": "fuzz", "prompt": "a", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_tokenize_and_detokenize_as_vllm_serves_them(server, llama_checkpoint, client):
    from tailserve.model.tokenizer import Tokenizer

    path, _ = llama_checkpoint
    tok = Tokenizer(path)
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "def add(a, b):"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("def add(a, b):") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    plain = httpx.post(server.url + "/tokenize", json={"prompt": "def", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("def", add_special_tokens=False)
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok.encode("x = 1", add_special_tokens=False)})
    assert back.json() == {"prompt": "x = 1"}
    messages = [{"role": "user", "content": "hello"}]
    chat_ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert chat_ids["count"] == out.usage.prompt_tokens
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={"prompt": "a", "foo": 1}).status_code == 400


def test_chat_top_logprobs_are_the_n_most_likely_and_streaming_carries_them(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(full) == 6
    for item in full:
        assert len(item.top_logprobs) == 3  # N, not N - 1: the sampled token counts when it is among them
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob  # greedy
        assert item.bytes == list(item.token.encode("utf-8"))
    none = client.chat.completions.create(**{**kw, "top_logprobs": 0}).choices[0].logprobs.content
    assert all(item.top_logprobs == [] for item in none)
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    # The same tokens; logprobs to float32 rounding (the session server may batch the two
    # requests with others differently, and a bf16 GEMM's sums then differ in the last bits).
    assert [t.token for t in streamed] == [t.token for t in full]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in full], rel=1e-5, abs=1e-5)


def test_streamed_completion_logprobs_equal_the_non_streamed(client):
    kw = dict(model="tiny", prompt="class Point:", max_tokens=6, temperature=0, logprobs=2)
    full = client.completions.create(**kw).choices[0].logprobs
    assert all(1 <= len(d) <= 3 for d in full.top_logprobs)  # the 2 most likely + the sampled when not among them
    toks, lps = [], []
    for chunk in client.completions.create(**kw, stream=True):
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            toks += lp.tokens
            lps += lp.token_logprobs
    assert toks == full.tokens and lps == full.token_logprobs


def test_echo_with_logprobs_scores_the_prompt_and_max_tokens_0_generates_nothing(client, offline):
    prompt = "def add(a, b):\n    return a + b\n"
    ref = offline.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    ch = out.choices[0]
    assert ch.text.startswith(prompt) and len(ch.text) > len(prompt) - 1
    n_prompt = len(ref.prompt_token_ids)
    assert len(ch.logprobs.tokens) == n_prompt + out.usage.completion_tokens
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
    for j in range(1, n_prompt):
        assert abs(ch.logprobs.token_logprobs[j] - ref.prompt_logprobs[j][ref.prompt_token_ids[j]]) < 1e-4
    scored = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    sc = scored.choices[0]
    assert sc.text == prompt and scored.usage.completion_tokens == 0 and sc.finish_reason == "length"
    assert len(sc.logprobs.tokens) == n_prompt
    assert sc.logprobs.token_logprobs[1:] == pytest.approx(ch.logprobs.token_logprobs[1:n_prompt], abs=1e-5)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, stream=True) if c.choices)
    assert streamed == prompt
    full = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert full == ch.text


def test_echo_of_a_token_id_prompt_and_max_tokens_0_without_echo(client, server):
    out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=1, temperature=0, echo=True)
    assert len(out.choices[0].text) > 0 and out.usage.prompt_tokens == 3
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_include_stop_str_in_output_is_honoured(client):
    kw = dict(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    stop = free[2:4]
    cut = client.completions.create(**kw, stop=[stop]).choices[0].text
    kept = client.completions.create(**kw, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == cut + stop


def test_penalties_and_logit_bias_through_the_openai_client(client, offline):
    kw = dict(model="tiny", prompt="def add(a, b):", max_tokens=5, temperature=0)
    forced = client.completions.create(**kw, logit_bias={"42": 100})
    assert forced.choices[0].text == offline.engine.tokenizer.decode([42] * 5)
    ref = offline.generate(["def add(a, b):"], SamplingParams(max_tokens=5, temperature=0, frequency_penalty=1.5,
                                                              presence_penalty=0.5, repetition_penalty=1.3))[0]
    got = client.completions.create(**kw, frequency_penalty=1.5, presence_penalty=0.5,
                                    extra_body={"repetition_penalty": 1.3})
    assert got.choices[0].text == ref.text
