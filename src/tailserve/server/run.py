"""Run the server: two listeners on one event loop; the engine loop a task on it (inline, the
default on the CPU) or on the main thread beside it (thread, the default on a GPU); see
engine/async_engine.py for why.

- HTTP/1.1 on ``--port``: Uvicorn with the httptools parser (and uvloop when installed),
  the lowest-overhead maintained ASGI server for HTTP/1.1; this is what most clients and
  gateways speak.
- Cleartext HTTP/2 with prior knowledge (h2c) on ``--http2-port`` (default: port + 1;
  0 turns it off): Hypercorn, whose h2 stack Uvicorn lacks. It answers HTTP/1.1 too.

Both serve the same Starlette app and share one event loop, so a request's outputs come
back the same way whichever listener took it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence

import uvicorn
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from tailserve.engine.llm_engine import LLMEngine
from tailserve.errors import ConfigError
from tailserve.server.app import Server, build_app
from tailserve.server.tools import ToolCallingConfig
from tailserve.server.tracing import RequestTracer

log = logging.getLogger("tailserve.server")

H2_MAX_REQUESTS_PER_CONNECTION = 1 << 40  # effectively unbounded (Hypercorn's default: 1000)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_http2_port(port: int, http2_port: int | None) -> int:
    """The h2c listener's port: None = ``port`` + 1, 0 = no h2c listener."""
    return port + 1 if http2_port is None else http2_port


def run_server(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000, http2_port: int | None = None,
               api_key: str | None = None, max_body_bytes: int = 1 << 20, max_waiting_requests: int = 256,
               access_log: bool = False, model_aliases: Sequence[str] = (), chat_template: str | None = None,
               tool_calling: ToolCallingConfig | None = None, per_request_metrics: bool = False,
               tracer: RequestTracer | None = None) -> None:
    """Serve until SIGINT/SIGTERM. ``http2_port``: None = port + 1, 0 = no h2c listener."""
    http2_port = resolve_http2_port(port, http2_port)
    check_bindable(host, port)
    if http2_port:
        check_bindable(host, http2_port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("dtype %s (%s)%s", str(engine.dtype).removeprefix("torch."), engine.dtype_reason,
             {"int8": ", weight-only int8 projections (--quantization int8)",
              "w8a8_int8": ", int8 projections over int8 activations (--quantization w8a8_int8)"}.get(
                 engine.config.quantization or "", ""))
    info = engine.info
    plan = info.plan.describe()
    log.info("execution plan: %s", "; ".join(f"{k} {v}" for k, v in plan.items() if k != "draft"))
    if "draft" in plan:
        log.info("draft plan: %s", "; ".join(f"{k} {v}" for k, v in plan["draft"].items()))  # type: ignore[union-attr]
    if info.memory_profile is not None:
        log.info("%s", info.memory_profile.describe(info.num_blocks, engine.config.block_size))
    else:
        log.info("KV cache: %d blocks = %d tokens", info.num_blocks, info.num_blocks * engine.config.block_size)
    if info.graph_capture_s is not None:
        log.info("CUDA graphs: decode captured at %d batch sizes up to %d in %.2f s (--enforce-eager turns them off)",
                 len(info.decode_graph_sizes), max(info.decode_graph_sizes), info.graph_capture_s)
    if engine.warmup_s is not None:
        log.info("warm-up: %.2f s (one forward per decode batch size and prefill length bucket)", engine.warmup_s)
    a = engine.allocator_settings
    log.info("CUDA caching allocator: %s (%s)%s", a.text or "PyTorch defaults", a.source,
             f", memory fraction {a.memory_fraction}" if a.memory_fraction is not None else "")
    # Two Python threads hand work to each other on every token; a shorter GIL switch
    # interval than the default 5 ms keeps each hand-off from waiting that long.
    sys.setswitchinterval(0.0005)
    server = Server(engine, api_key=api_key, max_body_bytes=max_body_bytes, max_waiting_requests=max_waiting_requests,
                    start_engine_thread=False, model_aliases=model_aliases, chat_template=chat_template,
                    tool_calling=tool_calling, per_request_metrics=per_request_metrics, tracer=tracer)
    if tracer is not None:
        log.info("traces: one span per request to %s (OTLP/HTTP)", tracer.endpoint)
    if engine.kv_events is not None:
        kc = engine.kv_events.config
        log.info("KV events: published on %s (replay %s, topic %r), block hash %s", kc.endpoint,
                 kc.replay_endpoint or "off", kc.topic, engine.config.prefix_caching_hash_algo)
    if tool_calling is not None and tool_calling.enable_auto_tool_choice:
        log.info("tool calling: tool_choice auto parsed with the %s parser", tool_calling.tool_call_parser)
    app = build_app(server)
    has_uvloop = importlib.util.find_spec("uvloop") is not None
    h1 = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, http="httptools", loop="none", lifespan="off", access_log=access_log,
        log_level="warning", timeout_keep_alive=75, server_header=False))
    h2_config = HypercornConfig()
    h2_config.bind = [_hostport(host, http2_port)]
    h2_config.accesslog = "-" if access_log else None
    h2_config.errorlog = "-"
    h2_config.keep_alive_timeout = 75
    h2_config.include_server_header = False  # as on the HTTP/1.1 listener
    h2_config.h2_max_concurrent_streams = 256
    # Hypercorn sends GOAWAY on a connection's 1001st request by default. A gateway keeps
    # one h2 connection open and multiplexes everything over it; closing it every thousand
    # requests makes it re-connect and retry the streams it had opened past the GOAWAY.
    h2_config.keep_alive_max_requests = H2_MAX_REQUESTS_PER_CONNECTION

    # Everything built so far (torch, the model, the app: ~200k objects) lives as long as the
    # process. Left to the collector, every full collection walks it all: 86 ms on this 2-core
    # machine, a pause in the middle of some request's decode. Frozen, they are never scanned
    # (vLLM does the same after start-up); what requests allocate is still collected.
    gc.collect()
    gc.freeze()
    log.info("garbage collector: %d start-up objects frozen (full collections no longer scan them)",
             gc.get_freeze_count())

    inline = engine.info.plan.engine_loop == "inline"
    ready = threading.Event()
    state: dict[str, object] = {}
    failure: list[BaseException] = []

    async def serve_http(engine_loop: bool) -> None:
        stop = asyncio.Event()
        state["loop"], state["stop"] = asyncio.get_running_loop(), stop
        ready.set()

        async def h1_main() -> None:
            await h1.serve()
            if not h1.started:  # bind failed: uvicorn logs and returns instead of raising
                raise OSError(f"cannot listen on {host}:{port}")

        async def h1_stopper() -> None:
            await stop.wait()
            h1.should_exit = True

        async def engine_main() -> None:
            try:
                await server.async_engine.run_in_loop()
            finally:
                stop.set()  # the engine stopped (shutdown, or down for good): so do the listeners

        tasks = [h1_main(), h1_stopper()]
        if engine_loop:
            tasks.append(engine_main())
        if http2_port:
            tasks.append(hypercorn_serve(app, h2_config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
        log.info("serving %s on http://%s (HTTP/1.1)%s", server.model_name, _hostport(host, port),
                 f" and http://{_hostport(host, http2_port)} (h2c, HTTP/1.1)" if http2_port else "")
        try:
            await asyncio.gather(*tasks)
        finally:
            stop.set()
            server.async_engine.shutdown()

    def run_loop(engine_loop: bool) -> None:
        try:
            if has_uvloop:
                import uvloop

                uvloop.run(serve_http(engine_loop))
            else:
                asyncio.run(serve_http(engine_loop))
        except BaseException as e:  # e.g. the port is taken: report it and stop the engine loop
            failure.append(e)
            ready.set()
        finally:
            server.async_engine.shutdown()

    def stop(*_: object) -> None:
        server.async_engine.shutdown()
        loop, event = state.get("loop"), state.get("stop")
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed: nothing to stop
                loop.call_soon_threadsafe(event.set)  # type: ignore[attr-defined]

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    if inline:
        # The default: the event loop and the engine loop (a task on it) on the main thread.
        # Uvicorn would take over SIGINT/SIGTERM on the main thread; ours stop everything.
        h1.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        try:
            run_loop(engine_loop=True)
        finally:
            engine.shutdown()
            if tracer is not None:
                tracer.shutdown()  # the spans still batched go out
    else:
        # --engine-loop thread: the event loop on a second thread, outputs handed over
        # between threads.
        thread = threading.Thread(target=run_loop, args=(False,), name="tailserve-http", daemon=True)
        thread.start()
        ready.wait()
        try:
            server.async_engine.run_forever()  # the engine loop, on the main thread, until stop()
        finally:
            stop()
            thread.join(timeout=30)
            engine.shutdown()
            if tracer is not None:
                tracer.shutdown()  # the spans still batched go out
    if failure:
        raise SystemExit(f"tailserve: error: HTTP server failed: {failure[0]}")
    if server.async_engine.dead is not None:
        raise SystemExit(f"tailserve: error: engine down: {server.async_engine.dead}")


def check_bindable(host: str, port: int) -> None:
    """Fail with one clear line, before loading anything else, if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
