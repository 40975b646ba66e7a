"""Run the server with Hypercorn: HTTP/1.1 and cleartext HTTP/2 (h2c, prior knowledge or
Upgrade) on the same port."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from hypercorn.asyncio import serve
from hypercorn.config import Config

from tailserve.engine.llm_engine import LLMEngine
from tailserve.server.app import Server, build_app


def run_server(engine: LLMEngine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               max_body_bytes: int = 1 << 20, max_waiting_requests: int = 256, access_log: bool = False) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The engine thread and the event loop hand work to each other on every token. With
    # the default 5 ms GIL switch interval a hand-off can wait that long for the other
    # thread to yield; 0.5 ms keeps the added latency well under a millisecond.
    sys.setswitchinterval(0.0005)
    server = Server(engine, api_key=api_key, max_body_bytes=max_body_bytes, max_waiting_requests=max_waiting_requests)
    app = build_app(server)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = "-" if access_log else None
    config.errorlog = "-"
    config.keep_alive_timeout = 75
    config.h2_max_concurrent_streams = 256

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        logging.getLogger("tailserve.server").info(
            "serving %s on http://%s:%d (HTTP/1.1 and h2c)", server.model_name, host, port)
        try:
            await serve(app, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
        finally:
            server.async_engine.shutdown()

    asyncio.run(main())
