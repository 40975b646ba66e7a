"""One tailserve replica against two behind Ray Serve, on the same load, measured by
``tailserve bench`` (the same client for every setup), plus plain ``tailserve serve`` as the
reference without Ray in the path.

Load: the prefix_repetition dataset (4 shared prefixes, distinct suffixes: what the
prefix-aware router is for), a fixed request rate and concurrency cap, warm-ups first.
On a 2-core machine two replicas share the two cores (one each), so this measures what
Ray's proxy hop and the routing cost, and what splitting the cores between two engines does,
not a doubling: that needs a core (or a GPU) per replica.

    python benchmarks/bench_ray_replicas.py [--num-prompts 96] [--request-rate 6] [--max-concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from tailserve.assets import DEFAULT_TARGET_DIR
from tailserve.bench.local_server import free_port

KV = ["--kv-cache-memory", "256MiB"]


def start(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tailserve", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): tailserve serve {' '.join(args)}")
        time.sleep(0.5)
    raise RuntimeError("server did not come up")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def bench(port: int, out: pathlib.Path, a: argparse.Namespace) -> dict:
    subprocess.run([sys.executable, "-m", "tailserve", "bench", "--url", f"http://127.0.0.1:{port}",
                    "--tokenizer", str(DEFAULT_TARGET_DIR), "--dataset-name", "prefix_repetition",
                    "--prefix-repetition-prefix-len", "256",
                    "--prefix-repetition-suffix-len", "32", "--prefix-repetition-output-len", "32",
                    "--num-prompts", str(a.num_prompts), "--request-rate", str(a.request_rate),
                    "--max-concurrency", str(a.max_concurrency), "--num-warmups", "8", "--ignore-eos",
                    "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
                    "--result-filename", out.name], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--request-rate", type=float, default=6.0)
    ap.add_argument("--max-concurrency", type=int, default=16)
    a = ap.parse_args()
    setups = [("tailserve serve (no Ray)", [*KV, "--http2-port", "0"]),
              ("Ray Serve, 1 replica", [*KV, "--ray-replicas", "1"]),
              ("Ray Serve, 2 replicas", [*KV, "--ray-replicas", "2"])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, args) in enumerate(setups):
            port = free_port()
            proc = start(args, port)
            try:
                res = bench(port, pathlib.Path(tmp) / f"r{i}.json", a)
            finally:
                stop(proc)
            rows.append((name, res))
    print(f"prefix_repetition (4 prefixes of 256 tokens, 32-token suffixes, 32 output tokens), "
          f"{a.num_prompts} requests at {a.request_rate} req/s, at most {a.max_concurrency} in flight")
    print("| setup | output tok/s | TTFT P50 / P99 (ms) | TPOT P50 / P99 (ms) | E2EL P99 (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in rows:
        print(f"| {name} | {r['output_throughput']:.0f} | {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
              f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | {r['p99_e2el_ms']:.0f} |")


if __name__ == "__main__":
    main()
