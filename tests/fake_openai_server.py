"""A small OpenAI-compatible test server (real HTTP via Uvicorn, real SSE) that injects
known delays, so the load generator's measurements can be checked against them.

    python tests/fake_openai_server.py --port P [--queue-ms 5] [--prefill-ms 20] [--itl-ms 10]
        [--wire-delay-ms 200 --wire-every 20]   # every 20th request waits before the server "sees" it
        [--queue-extra-ms 300 --queue-every 20]  # ... or waits (and reports it) in the queue
        [--itl-extra-ms 40 --itl-every 20]       # ... or generates each token that much slower
        [--timing-format tailserve|vllm|none]    # the per-request figures it reports (--no-timing: none)
        [--fail-every N] [--malformed-every N] [--disconnect-every N]
        [--capacity N]   # at most N requests generate at once; the rest wait, reported as queue

Request k (counted from 0 in arrival order) gets the periodic faults when k % N == N - 1.
The wire delay is slept before the server stamps the request's arrival and is not in its
reported timing: to the client it looks exactly like time on the network. ``vllm`` reports
as vLLM >= 0.25 does under ``--enable-per-request-metrics``: a ``metrics`` object in the final
usage chunk (queue, TTFT from scheduling, generation time, mean ITL, tokens/s), no ``timing``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def build(args: argparse.Namespace) -> Starlette:
    counter = itertools.count()
    slots = asyncio.Semaphore(args.capacity) if args.capacity else None

    def hit(k: int, every: int) -> bool:
        return every > 0 and k % every == every - 1

    async def generate(request: Request) -> Response:
        k = next(counter)
        body = await request.json()
        rid = request.headers.get("x-request-id", f"fake-{k}")
        chat = request.url.path.endswith("/chat/completions")
        if hit(k, args.wire_every):
            await asyncio.sleep(args.wire_delay_ms / 1e3)
        arrival = time.perf_counter()
        if hit(k, args.fail_every):
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error", "code": 500}},
                                status_code=500)
        n = int(body.get("max_tokens") or 16)

        async def stream():
            if slots is not None:
                await slots.acquire()
            try:
                async for chunk in generate_tokens():
                    yield chunk
            finally:
                if slots is not None:
                    slots.release()

        async def generate_tokens():
            queue_s = args.queue_ms / 1e3 + (args.queue_extra_ms / 1e3 if hit(k, args.queue_every) else 0.0)
            await asyncio.sleep(queue_s)
            scheduled = time.perf_counter()
            await asyncio.sleep(args.prefill_ms / 1e3)
            first = last = None
            itl_s = (args.itl_ms + (args.itl_extra_ms if hit(k, args.itl_every) else 0.0)) / 1e3
            for i in range(n):
                if i:
                    await asyncio.sleep(itl_s)
                last = time.perf_counter()
                first = first or last
                if hit(k, args.malformed_every) and i == 1:
                    yield b"data: {not json\n\n"
                    return
                if hit(k, args.disconnect_every) and i == 1:
                    raise ConnectionResetError("injected disconnect")
                piece = f"t{i} "
                choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None} if chat
                          else {"index": 0, "text": piece, "finish_reason": None})
                yield b"data: " + json.dumps({"id": rid, "choices": [choice]}).encode() + b"\n\n"
            final = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                     else {"index": 0, "text": "", "finish_reason": "length"})
            chunk = {"id": rid, "choices": [final]}
            if args.timing_format == "tailserve":
                chunk["timing"] = {"queue_ms": (scheduled - arrival) * 1e3, "prefill_ms": (first - scheduled) * 1e3,
                                   "ttft_ms": (first - arrival) * 1e3, "decode_ms": (last - first) * 1e3,
                                   "e2e_ms": (last - arrival) * 1e3, "preemptions": 0, "cached_tokens": 0}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            usage = {"id": rid, "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n,
                                                          "total_tokens": 8 + n}}
            if args.timing_format == "vllm":
                usage["metrics"] = {
                    "time_to_first_token_ms": (first - scheduled) * 1e3, "generation_time_ms": (last - first) * 1e3,
                    "queue_time_ms": (scheduled - arrival) * 1e3,
                    "mean_itl_ms": (last - first) * 1e3 / (n - 1) if n > 1 else None,
                    "tokens_per_second": n / (last - scheduled)}
            yield b"data: " + json.dumps(usage).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"X-Request-Id": rid})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", generate, methods=["POST"]),
                             Route("/v1/chat/completions", generate, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health)])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    for name, default in (("queue-ms", 0.0), ("prefill-ms", 0.0), ("itl-ms", 0.0), ("wire-delay-ms", 0.0),
                          ("queue-extra-ms", 0.0), ("itl-extra-ms", 0.0)):
        p.add_argument(f"--{name}", type=float, default=default)
    for name in ("wire-every", "queue-every", "itl-every", "fail-every", "malformed-every", "disconnect-every"):
        p.add_argument(f"--{name}", type=int, default=0)
    p.add_argument("--capacity", type=int, default=0)
    p.add_argument("--timing-format", choices=("tailserve", "vllm", "none"), default="tailserve")
    p.add_argument("--no-timing", dest="timing_format", action="store_const", const="none")
    args = p.parse_args()
    uvicorn.run(build(args), host="127.0.0.1", port=args.port, log_level="warning", http="h11")


if __name__ == "__main__":
    main()
