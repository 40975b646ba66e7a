"""tailserve engines as Ray Serve replicas behind one OpenAI-compatible endpoint.

    from tailserve.integrations.ray_serve import build_openai_app
    serve.run(build_openai_app(num_replicas=2, model="/models/qwen"), route_prefix="/")

(or ``tailserve serve --ray-replicas 2``). Two deployments:

- ``TailserveReplica`` (``num_replicas`` of them): one engine each, with tailserve's own
  OpenAI-compatible app (``server/app.py``) called in-process through ASGI, so every field,
  error and streamed chunk is exactly what ``tailserve serve`` answers. Each response
  carries ``X-Tailserve-Replica`` naming the replica that served it.
- ``OpenAIIngress``: takes the HTTP request from Ray Serve's proxy and streams the chosen
  replica's answer back.

Which replica serves a request is the ingress's handle's request router,
``PrefixAwareRequestRouter`` (Ray Serve's pluggable routers): the prompt's leading text is
cut into chunks whose chained hashes map to the replica that last served them; a request
goes to the replica holding its longest known prefix (its prefix cache has those blocks),
unless that replica's queue is longer than the shortest by more than ``imbalance_threshold``.
A request with no known prefix, or from an imbalanced pool, falls back to power of two
choices (two random replicas, the shorter queue wins), Ray Serve's default. Ray is an
optional extra: ``pip install 'tailserve[ray]'``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import StreamingResponse

ROUTER_CLASS = "tailserve.integrations.ray_serve:PrefixAwareRequestRouter"
REPLICA_HEADER = "x-tailserve-replica"


# -- routing --------------------------------------------------------------------------------------
def routing_text(body: bytes) -> str:
    """The text a request's prefix cache hit depends on: the prompt (token ids spelled out),
    or the chat messages in order. Empty for anything else (then no preference)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(obj, dict):
        return ""
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    messages = obj.get("messages")
    if isinstance(messages, list):
        return "".join(f"{m.get('role')}\x1f{m.get('content')}\x1e" for m in messages if isinstance(m, dict))
    return ""


def prefix_hashes(text: str, chunk_chars: int, max_chunks: int) -> list[int]:
    """Chained hashes of the text's leading full chunks: equal hashes, equal prefixes."""
    out, parent = [], 0
    for i in range(min(len(text) // chunk_chars, max_chunks)):
        parent = hash((parent, text[i * chunk_chars : (i + 1) * chunk_chars]))
        out.append(parent)
    return out


class PrefixAwareRequestRouter(FIFOMixin, RequestRouter):
    """Longest known prompt prefix first, power of two choices otherwise (module docstring)."""

    def initialize_state(self, chunk_chars: int = 64, max_chunks: int = 32, imbalance_threshold: int = 8,
                         max_entries: int = 100_000, **_: Any) -> None:
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.imbalance_threshold = imbalance_threshold
        self.max_entries = max_entries
        self.owner: OrderedDict[int, ReplicaID] = OrderedDict()  # prefix hash -> replica, LRU order
        self.num_prefix_routed = 0
        self.num_fallback_routed = 0

    def _hashes(self, pending_request: PendingRequest | None) -> list[int]:
        if pending_request is None:
            return []
        text = pending_request.kwargs.get("routing_text") or ""
        return prefix_hashes(text, self.chunk_chars, self.max_chunks)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        preferred = None
        for h in reversed(self._hashes(pending_request)):  # the longest known prefix first
            rid = self.owner.get(h)
            if rid in by_id:
                preferred = by_id[rid]
                break
        if preferred is not None and not self._imbalanced(preferred, candidate_replicas):
            self.num_prefix_routed += 1
            return [[preferred]]
        self.num_fallback_routed += 1
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def _imbalanced(self, preferred: RunningReplica, candidates: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        lens = [cache.get(r.replica_id) for r in candidates]
        mine = cache.get(preferred.replica_id)
        known = [q for q in lens if q is not None]
        return mine is not None and bool(known) and mine - min(known) > self.imbalance_threshold

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for h in self._hashes(pending_request):
            self.owner[h] = replica_id
            self.owner.move_to_end(h)
        while len(self.owner) > self.max_entries:
            self.owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for h in [h for h, r in self.owner.items() if r == replica_id]:
            del self.owner[h]


# -- the deployments -------------------------------------------------------------------------------
class TailserveReplica:
    """One tailserve engine and its OpenAI app; ``handle_request`` streams one HTTP exchange:
    first ``(status, headers)``, then the body's chunks."""

    def __init__(self, engine_kwargs: dict[str, Any], served_model_names: list[str] | None = None,
                 server_kwargs: dict[str, Any] | None = None) -> None:
        from tailserve.config import EngineConfig
        from tailserve.engine.llm_engine import LLMEngine
        from tailserve.server.app import Server, build_app

        kwargs = dict(engine_kwargs)
        model = kwargs.pop("model", None) or "builtin"
        names = list(served_model_names or [model])
        self.engine = LLMEngine(EngineConfig(model=model, served_model_name=names[0], **kwargs))
        server_kw = dict(server_kwargs or {})
        # Each replica exports its own spans to the one collector (--otlp-traces-endpoint).
        endpoint = server_kw.pop("otlp_traces_endpoint", None)
        tracer = None
        if endpoint is not None:
            from tailserve.server.tracing import RequestTracer

            tracer = RequestTracer(endpoint)
        self.server = Server(self.engine, start_engine_thread=True,
                             model_aliases=[*names[1:], self.engine.model_dir.name], tracer=tracer, **server_kw)
        self.app = build_app(self.server)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def handle_request(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                             body: bytes, routing_text: str = "") -> AsyncIterator[Any]:
        # routing_text is for the router (PrefixAwareRequestRouter reads it from the call).
        del routing_text
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
                 "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            while True:
                get = asyncio.ensure_future(messages.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the app returned (or failed) with nothing more queued
                    get.cancel()
                    task.result()
                    return
                msg = get.result()
                if msg["type"] == "http.response.start":
                    hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                    yield msg["status"], [*hdrs, (REPLICA_HEADER, self.replica_id)]
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body", False):
                        return
        finally:
            gone.set()  # the client left (or the response is complete): the app's stream stops
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def check_health(self) -> None:
        """Ray Serve's health check: an engine whose workers died is unhealthy (restarted)."""
        self.engine.check_health()


class OpenAIIngress:
    """Ray Serve's HTTP proxy hands each request here; the replica handle's router picks the
    engine, whose answer is streamed back unchanged."""

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request: Request) -> StreamingResponse:
        body = await request.body()
        gen = self.replicas.handle_request.remote(
            request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body,
            routing_text=routing_text(body) if request.method == "POST" else "")
        status, headers = await gen.__anext__()

        async def rest() -> AsyncIterator[bytes]:
            async for chunk in gen:
                yield chunk

        media = dict((k.lower(), v) for k, v in headers).get("content-type")
        out = StreamingResponse(rest(), status_code=status, media_type=media)
        for k, v in headers:
            if k.lower() not in ("content-length", "content-type"):
                out.headers.append(k, v)
        return out


def build_openai_app(num_replicas: int = 2, model: str | None = None, served_model_names: list[str] | None = None,
                     engine_kwargs: dict[str, Any] | None = None, num_cpus_per_replica: float = 1.0,
                     max_ongoing_requests: int = 256, prefix_aware: bool = True,
                     router_kwargs: dict[str, Any] | None = None, server_kwargs: dict[str, Any] | None = None):
    """The Ray Serve application: ``num_replicas`` engines behind one OpenAI endpoint.
    ``engine_kwargs``: EngineConfig fields; ``server_kwargs``: ``Server``'s (api_key,
    max_body_bytes, max_waiting_requests). ``prefix_aware=False`` keeps Ray Serve's default
    router (power of two choices)."""
    from tailserve.engine import worker_spin

    kwargs = dict(engine_kwargs or {})
    kwargs["model"] = model
    actor: dict[str, Any] = {"num_cpus": num_cpus_per_replica}
    # A replica is a server: its OpenMP workers should sleep soon after a step, as under
    # `tailserve serve` (engine/worker_spin.py). libgomp reads the variable when it loads, so it
    # goes in the actor's runtime_env, set before the actor's process starts.
    spin = worker_spin.serving_env()
    if spin:
        actor["runtime_env"] = {"env_vars": spin}
    options: dict[str, Any] = dict(num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
                                   ray_actor_options=actor)
    if prefix_aware:
        options["request_router_config"] = RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                                               request_router_kwargs=router_kwargs or {})
    replica = serve.deployment(TailserveReplica, name="TailserveReplica").options(**options)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=1, max_ongoing_requests=max_ongoing_requests * num_replicas, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(kwargs, served_model_names, server_kwargs))
