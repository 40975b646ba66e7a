"""Run the server: Hypercorn (HTTP/1.1 and cleartext HTTP/2, h2c, on one port) on an
event-loop thread, the engine loop on the main thread (see engine/async_engine.py for why)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading

from hypercorn.asyncio import serve
from hypercorn.config import Config

from tailserve.engine.llm_engine import LLMEngine
from tailserve.errors import ConfigError
from tailserve.server.app import Server, build_app

log = logging.getLogger("tailserve.server")


def run_server(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               max_body_bytes: int = 1 << 20, max_waiting_requests: int = 256, access_log: bool = False) -> None:
    check_bindable(host, port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Two Python threads hand work to each other on every token; a shorter GIL switch
    # interval than the default 5 ms keeps each hand-off from waiting that long.
    sys.setswitchinterval(0.0005)
    server = Server(engine, api_key=api_key, max_body_bytes=max_body_bytes, max_waiting_requests=max_waiting_requests,
                    start_engine_thread=False)
    app = build_app(server)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = "-" if access_log else None
    config.errorlog = "-"
    config.keep_alive_timeout = 75
    config.h2_max_concurrent_streams = 256

    ready = threading.Event()
    state: dict[str, object] = {}
    failure: list[BaseException] = []

    async def serve_http() -> None:
        stop = asyncio.Event()
        state["loop"], state["stop"] = asyncio.get_running_loop(), stop
        ready.set()
        log.info("serving %s on http://%s:%d (HTTP/1.1 and h2c)", server.model_name, host, port)
        await serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]

    def http_thread() -> None:
        try:
            asyncio.run(serve_http())
        except BaseException as e:  # e.g. the port is taken: report it and stop the engine loop
            failure.append(e)
            ready.set()
        finally:
            server.async_engine.shutdown()

    thread = threading.Thread(target=http_thread, name="tailserve-http", daemon=True)
    thread.start()
    ready.wait()

    def stop(*_: object) -> None:
        server.async_engine.shutdown()
        loop, event = state.get("loop"), state.get("stop")
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed: nothing to stop
                loop.call_soon_threadsafe(event.set)  # type: ignore[attr-defined]

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    server.async_engine.run_forever()  # the engine loop, on the main thread, until stop()
    stop()
    thread.join(timeout=30)
    if failure:
        raise SystemExit(f"tailserve: error: HTTP server failed: {failure[0]}")


def check_bindable(host: str, port: int) -> None:
    """Fail with one clear line, before loading anything else, if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
