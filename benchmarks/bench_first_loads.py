"""The first three loads on a fresh `tailserve serve`, with the client's own first-load costs
paid elsewhere first: is the first load as fast as the second, and whose time is the difference?

One client process: it first runs the same load against the test server that injects nothing
(tests/fake_openai_server.py), so its imports, connection pool, tokenizer and event loop are
warm; then it starts `tailserve serve` (with its start-up warm-up, as a user would) and sends
three loads of random 128 in / 128 out, `--ignore-eos`, 64 prompts, 16 concurrent, each with
its own seed (no prefix-cache hits between loads). For each load: output tok/s, the client's
TTFT P50 and TPOT P50, and the server's own TTFT P50 (from each response's `timing`), so a
first-load excess the server also sees is the server's, and one it does not see is the client's
or the wire's.

    python benchmarks/bench_first_loads.py [--model builtin] [--dtype auto] [--loads 3]
        [--num-prompts 64] [--concurrency 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import subprocess
import sys
import time

import httpx

from tailserve.assets import DEFAULT_TARGET_DIR
from tailserve.bench.datasets import DatasetConfig, load_dataset
from tailserve.bench.load import LoadConfig, run_load
from tailserve.bench.local_server import LocalServer, free_port
from tailserve.model.tokenizer import Tokenizer

FAKE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fake_openai_server.py"


def one_load(url: str, tok: Tokenizer, seed: int, n: int, conc: int) -> dict[str, float]:
    reqs = load_dataset(DatasetConfig(name="random", num_prompts=n, seed=seed, input_len=128, output_len=128),
                        tok)
    run = asyncio.run(run_load(LoadConfig(url, max_concurrency=conc, ignore_eos=True, seed=seed), reqs, tok))
    ok = [r for r in run.records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    server = [r.server.ttft_s * 1e3 for r in ok if r.server is not None]
    return {"ok": len(ok), "out_tok_s": out_tokens / run.duration_s,
            "ttft_p50_ms": statistics.median(r.ttft_s * 1e3 for r in ok),
            "tpot_p50_ms": statistics.median(r.tpot_s * 1e3 for r in ok if r.tpot_s is not None),
            "server_ttft_p50_ms": statistics.median(server) if server else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = Tokenizer(DEFAULT_TARGET_DIR)

    port = free_port()
    fake = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        one_load(f"http://127.0.0.1:{port}", tok, 999, args.num_prompts, args.concurrency)  # the client warms up
    finally:
        fake.terminate()
        fake.wait(10)

    results = []
    t0 = time.perf_counter()
    with LocalServer(["--model", args.model, "--dtype", args.dtype]) as srv:
        start_s = time.perf_counter() - t0
        for i in range(args.loads):
            results.append(one_load(srv.url, tok, i, args.num_prompts, args.concurrency))
    print(f"tailserve serve --model {args.model} --dtype {args.dtype}: up in {start_s:.1f} s (with its warm-up); "
          f"random 128/128, {args.num_prompts} prompts, {args.concurrency} concurrent, client warmed up first")
    print(f"{'load':<6}{'ok':>5}{'out tok/s':>11}{'TTFT P50':>10}{'server TTFT P50':>17}{'TPOT P50':>10}")
    for i, r in enumerate(results, 1):
        print(f"{i:<6}{r['ok']:>5}{r['out_tok_s']:>11.1f}{r['ttft_p50_ms']:>10.1f}{r['server_ttft_p50_ms']:>17.1f}"
              f"{r['tpot_p50_ms']:>10.2f}")
    if len(results) >= 2:
        print(f"first / second load: TTFT P50 {results[0]['ttft_p50_ms'] / results[1]['ttft_p50_ms']:.2f}x, "
              f"throughput {results[0]['out_tok_s'] / results[1]['out_tok_s']:.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"start_s": start_s, "loads": results}, indent=1))


if __name__ == "__main__":
    main()
