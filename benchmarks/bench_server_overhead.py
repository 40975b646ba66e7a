"""The server's own latency: TTFT and TPOT over HTTP/1.1 and HTTP/2 vs the in-process engine.

Low load (one request at a time), same prompts, same run. The in-process figure is the
engine driven directly (add_request, then step() until the first token / every token); the
HTTP figures are what a streaming client sees (request sent -> first non-empty SSE chunk,
then the gaps between chunks). The difference is what the server adds: HTTP and JSON,
the hand-off to the engine thread, SSE framing. Medians over all counted requests (--rounds x --block per path).

Two HTTP/1.1 clients: httpx (what most Python callers use; its own per-request cost is
part of its figure, see the bare round trip printed first) and a minimal client on a raw
socket (one prebuilt request, chunked SSE read off the socket), whose own cost is a few
microseconds, so its figure is close to the server's own; the same pair for HTTP/2 on the
h2c port (--http2-port): httpx with h2, and a minimal client on the `h2` state machine
over a blocking socket. Paths are interleaved in blocks (each round sends --block requests
through every path, in an order that rotates with the round), so drift over the run lands
on all of them alike.

    python benchmarks/bench_server_overhead.py [--model builtin] [--rounds 6] [--block 6] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events
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

    def token(self, now: float | None = None) -> None:
        """A token arrived (at ``now``: when the socket read that carried it returned)."""
        now = time.perf_counter() if now is None else now
        if self._last is None:
            self.ttft.append(now - self._t0)
        else:
            self.gaps.append(now - self._last)
        self._last = now


class InProcess:
    """The engine driven directly: add_request, then step() until the request finishes."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine

    def one(self, prompt: str, max_tokens: int, st: Stamps) -> None:
        st.start()
        self.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.delta_token_ids:
                    st.token()

    def close(self) -> None:
        pass


def _body(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()


class Httpx:
    """httpx on one keep-alive connection (HTTP/1.1, or HTTP/2 with prior knowledge)."""

    def __init__(self, url: str, http2: bool) -> None:
        self.url = url
        self.client = httpx.Client(http1=not http2, http2=http2, timeout=60)

    def one(self, prompt: str, max_tokens: int, st: Stamps) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        st.start()
        with self.client.stream("POST", self.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    st.token()

    def rtt(self) -> float:
        t0 = time.perf_counter()
        self.client.get(self.url + "/health")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()


class RawHttp11:
    """A minimal HTTP/1.1 client on a raw keep-alive socket: the request is built before the
    clock starts, and each SSE event that carries a token is stamped with the time the
    socket read that brought its bytes returned, so the figure is the server's (and the
    loopback's), not the client's."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def one(self, prompt: str, max_tokens: int, st: Stamps) -> None:
        body = _body(prompt, max_tokens)
        req = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        buf = b""
        st.start()
        self.sock.sendall(req)
        done = False
        while not done:
            data = self.sock.recv(65536)
            arrived = time.perf_counter()
            if not data:
                raise RuntimeError("server closed the connection")
            buf += data
            while b"\n\n" in buf:  # one SSE event (chunk framing lines are skipped below)
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\r\n"):
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                        st.token(arrived)
                    elif line.startswith(b"data: [DONE]"):
                        done = True
        # Read the chunked terminator so the next request starts on a clean connection.
        while not buf.endswith(b"0\r\n\r\n"):
            buf += self.sock.recv(65536)

    def rtt(self) -> float:
        req = f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()
        t0 = time.perf_counter()
        self.sock.sendall(req)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += self.sock.recv(65536)
        head, rest = buf.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(rest) < length:
            rest += self.sock.recv(65536)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()


class RawH2c:
    """The h2c counterpart of RawHttp11: the `h2` state machine on a blocking socket, one
    connection, one stream per request; no event loop, pool or locks in the client. As
    there, the request's frames are encoded before the clock starts (the pure-Python `h2`
    encoder takes ~0.1 ms) and tokens are stamped when the read that brought them returned."""

    def __init__(self, host: str, port: int) -> None:
        self.authority = f"{host}:{port}"
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(1 << 30)  # never stall the server on the connection window
        self.sock.sendall(self.conn.data_to_send())

    def _exchange(self, headers: list[tuple[str, str]], body: bytes | None, on_data: Callable[[bytes, float], None],
                  on_send: Callable[[], None] | None = None) -> None:
        """Send one request on a new stream (``on_send`` runs right before its bytes go out)
        and feed its DATA, with the time it arrived, to on_data until the stream ends."""
        conn, sid = self.conn, self.conn.get_next_available_stream_id()
        conn.send_headers(sid, headers, end_stream=body is None)
        if body is not None:
            conn.send_data(sid, body, end_stream=True)
        out = conn.data_to_send()
        if on_send is not None:
            on_send()
        self.sock.sendall(out)
        ended = False
        while not ended:
            data = self.sock.recv(65536)
            arrived = time.perf_counter()
            if not data:
                raise RuntimeError("server closed the connection")
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                    on_data(ev.data, arrived)
                elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                    ended = True
                elif isinstance(ev, h2.events.StreamReset) and ev.stream_id == sid:
                    raise RuntimeError(f"server reset stream {sid}")
            out = conn.data_to_send()
            if out:
                self.sock.sendall(out)

    def one(self, prompt: str, max_tokens: int, st: Stamps) -> None:
        body = _body(prompt, max_tokens)
        headers = [(":method", "POST"), (":path", "/v1/completions"), (":scheme", "http"),
                   (":authority", self.authority), ("content-type", "application/json"),
                   ("content-length", str(len(body)))]
        buf = [b""]

        def on_data(data: bytes, arrived: float) -> None:
            buf[0] += data
            while b"\n\n" in buf[0]:
                event, buf[0] = buf[0].split(b"\n\n", 1)
                if event.startswith(b"data: {") and json.loads(event[6:])["choices"]:
                    st.token(arrived)

        self._exchange(headers, body, on_data, on_send=st.start)

    def rtt(self) -> float:
        headers = [(":method", "GET"), (":path", "/health"), (":scheme", "http"), (":authority", self.authority)]
        t0 = [0.0]

        def start() -> None:
            t0[0] = time.perf_counter()

        self._exchange(headers, None, lambda _d, _t: None, on_send=start)
        return time.perf_counter() - t0[0]

    def close(self) -> None:
        self.sock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--dtype", default="auto", help="as tailserve serve takes it (its default: auto)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=6, help="requests per path per round")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    n_requests = args.rounds * args.block
    prompts = [f"def function_{i}(value):\n    " for i in range(n_requests)]
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
        paths = {
            "in-process engine": InProcess(llm),
            "HTTP/1.1 raw socket": RawHttp11("127.0.0.1", port),
            "HTTP/1.1 httpx": Httpx(url, http2=False),
            "HTTP/2 h2c raw h2": RawH2c("127.0.0.1", port_h2),
            "HTTP/2 h2c httpx": Httpx(url_h2, http2=True),
        }
        stamps = {name: Stamps() for name in paths}
        for p in prompts[:3]:  # warm-up
            for path in paths.values():
                path.one(p, args.max_tokens, Stamps())
        # Interleaved in blocks: each round sends a block of requests through every path, in
        # an order that rotates with the round, so that the machine's drift over the run lands
        # on all paths alike. The first request of a block is not counted: switching between
        # this process's engine and the server's leaves the other side's idle threads to wake.
        names = list(paths)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                paths[name].one(prompts[0], args.max_tokens, Stamps())
                for p in prompts[r * args.block:(r + 1) * args.block]:
                    paths[name].one(p, args.max_tokens, stamps[name])
        rtts: dict[str, list[float]] = {name: [] for name, path in paths.items() if hasattr(path, "rtt")}
        for _ in range(n_requests * 3):
            for name in rtts:
                rtts[name].append(paths[name].rtt())  # type: ignore[attr-defined]
        for path in paths.values():
            path.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print("bare round trip, GET /health, client included: "
          + ", ".join(f"{name} {statistics.median(ts) * 1e3:.3f} ms" for name, ts in rtts.items()))
    base_ttft = statistics.median(stamps["in-process engine"].ttft)
    base_tpot = statistics.median(stamps["in-process engine"].gaps)
    print(f"{'path':<22}{'TTFT p50 ms':>12}{'added ms':>10}{'TPOT p50 ms':>13}{'added ms':>10}")
    for name, st in stamps.items():
        t, g = statistics.median(st.ttft), statistics.median(st.gaps)
        print(f"{name:<22}{t * 1e3:>12.3f}{(t - base_ttft) * 1e3:>10.3f}{g * 1e3:>13.3f}{(g - base_tpot) * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
