"""Two built-in-model replicas on Ray Serve behind one endpoint, spoken to with the official
openai client: both replicas serve, and requests that share a prompt prefix land on one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed here (pip install 'tailserve[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed here (pip install 'tailserve[ray]')")

from tailserve.integrations.ray_serve import (  # noqa: E402 - after the skip
    REPLICA_HEADER,
    build_openai_app,
    prefix_hashes,
    routing_text,
)

pytestmark = pytest.mark.slow


def test_routing_text_and_prefix_hashes():
    assert routing_text(b'{"prompt": "abc"}') == "abc"
    assert routing_text(b'{"prompt": [1, 2]}') == "1 2"
    assert routing_text(b'{"prompt": ["first", "second"]}') == "first"
    assert routing_text(b'{"messages": [{"role": "user", "content": "hi"}]}') == "user\x1fhi\x1e"
    assert routing_text(b"not json") == "" and routing_text(b"[1]") == ""
    a, b = prefix_hashes("x" * 200 + "a", 64, 32), prefix_hashes("x" * 200 + "b", 64, 32)
    assert len(a) == 3 and a == b  # the differing tail is past the last full chunk
    assert prefix_hashes("y" + "x" * 199, 64, 32)[0] != a[0]


@pytest.fixture(scope="module")
def collector():
    from conftest import OTLPCollector

    c = OTLPCollector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def endpoint(collector):
    from tailserve.bench.local_server import free_port

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(num_replicas=2, engine_kwargs={"kv_cache_memory_bytes": 64 << 20},
                                   server_kwargs={"otlp_traces_endpoint": collector.url}),
                  route_prefix="/", name="tailserve")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(client, prompt: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(model="builtin", prompt=prompt, max_tokens=8, temperature=0)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def test_both_replicas_serve_and_a_shared_prefix_lands_on_one(endpoint):
    from openai import OpenAI

    client = OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    # Distinct short prompts (no prefix to route by): power of two choices spreads them.
    distinct = [f"def f{i}(x):" for i in range(12)]
    with ThreadPoolExecutor(6) as pool:
        served = list(pool.map(lambda p: _complete(client, p), distinct))
    assert len({rid for rid, _ in served}) == 2, served
    # One request makes a long prefix known; the others that share it follow it, concurrently.
    shared = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 4
    first, _ = _complete(client, shared + "    # 0\n")
    with ThreadPoolExecutor(6) as pool:
        followers = list(pool.map(lambda i: _complete(client, shared + f"    # {i}\n"), range(1, 9)))
    assert {rid for rid, _ in followers} == {first}
    # The answers are the engine's own: the same prompt gives the same greedy text anywhere.
    assert _complete(client, distinct[0])[1] == served[0][1]


def test_errors_and_streams_pass_through_unchanged(endpoint):
    import httpx
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model="builtin", prompt="x", max_tokens=4, extra_body={"best_of": 2, "n": 3})
    assert e.value.body["param"] == "best_of"
    chunks = list(client.completions.create(model="builtin", prompt="def add(a, b):", max_tokens=8, temperature=0,
                                            stream=True))
    full = client.completions.create(model="builtin", prompt="def add(a, b):", max_tokens=8, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert httpx.get(endpoint + "/v1/models").json()["data"][0]["id"] == "builtin"
    # A replica is a server: its OpenMP workers spin as briefly as under `tailserve serve`.
    from tailserve.engine.worker_spin import SERVE_SPIN_COUNT

    plan = httpx.get(endpoint + "/health", timeout=30).json()["plan"]
    assert plan["cpu_worker_spin"].startswith(f"{SERVE_SPIN_COUNT} "), plan["cpu_worker_spin"]


def test_each_replica_exports_spans_that_continue_the_callers_trace(endpoint, collector):
    import time

    import httpx

    from tailserve.bench.client import new_traceparent

    def one(i: int) -> tuple[str, str]:
        tp = new_traceparent()
        r = httpx.post(endpoint + "/v1/completions", json={"prompt": f"def g{i}(y):", "max_tokens": 2},
                       headers={"traceparent": tp}, timeout=120)
        assert r.status_code == 200
        return tp.split("-")[1], r.headers[REPLICA_HEADER]

    with ThreadPoolExecutor(6) as pool:  # distinct prompts, concurrently: both replicas serve some
        sent = dict(pool.map(one, range(12)))
    deadline = time.monotonic() + 20  # the SDK exports its batch every 5 s
    while time.monotonic() < deadline:
        got = {s.trace_id.hex() for s in collector.spans()}
        if set(sent) <= got:
            break
        time.sleep(0.5)
    assert set(sent) <= got, (sent, got)
    assert len(set(sent.values())) == 2  # spans came from both replicas
