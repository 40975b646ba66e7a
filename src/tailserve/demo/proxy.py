"""A delaying HTTP proxy: the slow wire of act 1, started by the demo itself.

Every request is forwarded to the upstream server unchanged; every ``every``-th completion
response (``/v1/completions``, ``/v1/chat/completions``) is held ``delay_s`` before its first
byte goes back to the client, and the bytes the upstream streamed meanwhile follow at once.
The hold happens after the server has produced the response, outside every server-side
timing, so it is what a congested link, a TLS-terminating gateway or a proxy's buffer adds:
the client sees it, the server cannot. Runs its own event loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

import aiohttp
from aiohttp import web

from tailserve.bench.local_server import free_port

_HOP_BY_HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length", "host",
                         "proxy-connection", "te", "trailer", "upgrade", "content-encoding"))
HELD_PATHS = ("/v1/completions", "/v1/chat/completions")


class DelayingProxy:
    """``with DelayingProxy(upstream_url, every=5, delay_s=0.25) as p: p.url``"""

    def __init__(self, upstream: str, every: int, delay_s: float) -> None:
        if every < 1 or delay_s < 0:
            raise ValueError(f"every must be >= 1 and delay_s >= 0 (got {every}, {delay_s})")
        self.upstream = upstream.rstrip("/")
        self.every, self.delay_s = every, delay_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_forwarded = self.num_held = 0
        self._counter = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        held = False
        if request.method == "POST" and request.path in HELD_PATHS:
            held = next(self._counter) % self.every == 0
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers=headers, auto_decompress=False) as up:
            out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                if k.lower() not in _HOP_BY_HOP})
            first = await up.content.readany()
            if held:
                # The response exists (its first bytes are here); hold it as the slow link would.
                self.num_held += 1
                await asyncio.sleep(self.delay_s)
            self.num_forwarded += 1
            await out.prepare(request)
            chunk = first
            while chunk:
                await out.write(chunk)
                chunk = await up.content.readany()
            await out.write_eof()
            return out

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                              connector=aiohttp.TCPConnector(limit=0))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await self._session.close()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    def __enter__(self) -> DelayingProxy:
        self._session: aiohttp.ClientSession | None = None
        self._thread = threading.Thread(target=self._run, name="tailserve-demo-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
