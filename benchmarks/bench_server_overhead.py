"""The server's own latency: TTFT and TPOT over HTTP/1.1 and HTTP/2 vs the in-process engine.

Low load (one request at a time), same prompts, same run. The in-process figure is the
engine driven directly (add_request, then step() until the first token / every token); the
HTTP figures are what a streaming client sees (request sent -> first non-empty SSE chunk,
then the gaps between chunks). The difference is what the server adds: HTTP and JSON,
the hand-off to the engine thread, SSE framing. Medians over --requests requests.

Two HTTP/1.1 clients: httpx (what most Python callers use; its own per-request cost is
part of its figure, see the bare round trip printed first) and a minimal client on a raw
socket (one prebuilt request, chunked SSE read off the socket), whose own cost is a few
microseconds, so its figure is close to the server's own. HTTP/2 uses httpx on the h2c
port (--http2-port).

    python benchmarks/bench_server_overhead.py [--model builtin] [--requests 30] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx

from tailserve import LLM, SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stamps:
    """Time to the first token of a request, then the gaps between later ones."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.gaps: list[float] = []

    def start(self) -> None:
        self._t0, self._last = time.perf_counter(), None

    def token(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self.ttft.append(now - self._t0)
        else:
            self.gaps.append(now - self._last)
        self._last = now


def in_process(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list[float], list[float]]:
    eng = llm.engine
    st = Stamps()
    for p in prompts:
        st.start()
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.delta_token_ids:
                    st.token()
    return st.ttft, st.gaps


def over_http(url: str, prompts: list[str], max_tokens: int, http2: bool) -> tuple[list[float], list[float]]:
    st = Stamps()
    with httpx.Client(http1=not http2, http2=http2, timeout=60) as c:
        for p in prompts:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            st.start()
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        st.token()
    return st.ttft, st.gaps


def raw_http11(host: str, port: int, prompts: list[str], max_tokens: int) -> tuple[list[float], list[float]]:
    """One keep-alive connection; the request is built before the clock starts; each SSE
    event that carries a token is stamped as soon as its bytes arrive."""
    st = Stamps()
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for p in prompts:
            body = json.dumps({"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                               "stream": True}).encode()
            req = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
            buf = b""
            st.start()
            sock.sendall(req)
            done = False
            while not done:
                data = sock.recv(65536)
                if not data:
                    raise RuntimeError("server closed the connection")
                buf += data
                while b"\n\n" in buf:  # one SSE event (chunk framing lines are skipped below)
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\r\n"):
                        if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                            st.token()
                        elif line.startswith(b"data: [DONE]"):
                            done = True
            # Read the chunked terminator so the next request starts on a clean connection.
            while not buf.endswith(b"0\r\n\r\n"):
                buf += sock.recv(65536)
    return st.ttft, st.gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    prompts = [f"def function_{i}(value):\n    " for i in range(args.requests)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    port_h2 = free_port()
    url_h2 = f"http://127.0.0.1:{port_h2}"
    proc = subprocess.Popen([sys.executable, "-m", "tailserve", "serve", "--model", args.model, "--port", str(port),
                             "--http2-port", str(port_h2),
                             "--dtype", args.dtype, "--no-enable-prefix-caching"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
        in_process(llm, prompts[:3], args.max_tokens)  # warm-up
        over_http(url, prompts[:3], args.max_tokens, http2=False)
        over_http(url_h2, prompts[:3], args.max_tokens, http2=True)
        raw_http11("127.0.0.1", port, prompts[:3], args.max_tokens)
        rtt: dict[str, list[float]] = {"HTTP/1.1": [], "h2c": []}
        for name, base, h2 in (("HTTP/1.1", url, False), ("h2c", url_h2, True)):
            with httpx.Client(http1=not h2, http2=h2) as c:
                for _ in range(args.requests * 3):
                    t0 = time.perf_counter()
                    c.get(base + "/health")
                    rtt[name].append(time.perf_counter() - t0)
        rows = {
            "in-process engine": in_process(llm, prompts, args.max_tokens),
            "HTTP/1.1 raw socket": raw_http11("127.0.0.1", port, prompts, args.max_tokens),
            "HTTP/1.1 httpx": over_http(url, prompts, args.max_tokens, http2=False),
            "HTTP/2 h2c httpx": over_http(url_h2, prompts, args.max_tokens, http2=True),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for name, ts in rtt.items():
        print(f"bare {name} round trip with httpx (GET /health, client included): {statistics.median(ts) * 1e3:.3f} ms")
    base_ttft = statistics.median(rows["in-process engine"][0])
    base_tpot = statistics.median(rows["in-process engine"][1])
    print(f"{'path':<22}{'TTFT p50 ms':>12}{'added ms':>10}{'TPOT p50 ms':>13}{'added ms':>10}")
    for name, (ttft, gaps) in rows.items():
        t, g = statistics.median(ttft), statistics.median(gaps)
        print(f"{name:<22}{t * 1e3:>12.3f}{(t - base_ttft) * 1e3:>10.3f}{g * 1e3:>13.3f}{(g - base_tpot) * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
