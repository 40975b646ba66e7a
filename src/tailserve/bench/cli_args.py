"""The flags of ``tailserve bench`` and ``tailserve bench compare`` (names as in
``vllm bench serve`` where the concept is the same). Kept free of heavy imports, so that
``tailserve --help`` answers at once."""

from __future__ import annotations

import argparse
import os

DATASET_NAMES = ("random", "sharegpt", "custom", "prefix_repetition", "multi_turn", "trace", "python", "agentic")
DEFAULT_SERVER_ARGS = "--speculative-model builtin"
DEFAULT_PERCENTILE_METRICS = "ttft,ttst,tpot,itl,e2el"
DEFAULT_METRIC_PERCENTILES = "50,90,95,99,99.9"


def add_bench_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", "--base-url", dest="url", default=None,
                   help="the server, e.g. http://127.0.0.1:8000 (default: start tailserve serve on the built-in "
                        "pair, measure it, stop it)")
    t.add_argument("--host", default=None, help="with --port, instead of --url")
    t.add_argument("--port", type=int, default=None)
    t.add_argument("--backend", default=None, choices=["openai", "openai-chat", "vllm", "tailserve"],
                   help="openai(-chat): which endpoint to call (vllm/tailserve = openai)")
    t.add_argument("--endpoint", default=None, help="/v1/completions (default) or /v1/chat/completions")
    t.add_argument("--model", default=None, help="model name sent in requests (default: the server's first)")
    t.add_argument("--tokenizer", default=None,
                   help="local folder with tokenizer.json for exact prompt lengths (default: --model when it is "
                        "a folder, else the built-in model's)")
    t.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help="flags for the tailserve serve this command starts when there is no --url")
    t.add_argument("--header", action="append", default=[], help="extra request header KEY=VALUE (repeatable)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token")
    t.add_argument("--http2", action="store_true", help="HTTP/2 cleartext with prior knowledge (h2c)")
    t.add_argument("--no-keep-alive", action="store_true", help="a new connection per request")
    t.add_argument("--compare-http", action="store_true",
                   help="run the load three ways (HTTP/1.1 keep-alive, HTTP/1.1 new connections, HTTP/2) and "
                        "compare TTFT")
    t.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=list(DATASET_NAMES))
    d.add_argument("--dataset-path", default=None, help="local file for sharegpt, custom and trace")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--random-input-len", type=int, default=128)
    d.add_argument("--random-output-len", type=int, default=64)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--sharegpt-output-len", type=int, default=None)
    d.add_argument("--custom-output-len", type=int, default=None)
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=None)
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=32)
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    d.add_argument("--prefix-repetition-output-len", type=int, default=None)
    d.add_argument("--multi-turn-num-turns", type=int, default=3)
    d.add_argument("--trace-speedup", type=float, default=1.0, help="trace replay: >1 replays faster")
    d.add_argument("--trace-hash-block-size", type=int, default=512,
                   help="trace replay: prompt tokens per entry of a row's hash_ids (Mooncake's traces: 512)")
    d.add_argument("--trace-timestamp-unit", default="auto", choices=["auto", "s", "ms"],
                   help="trace replay: the unit of 'timestamp' (auto: ms for Mooncake's rows with hash_ids, else s)")
    d.add_argument("--agentic-num-turns", type=int, default=6, help="agentic: requests per session")
    d.add_argument("--agentic-num-tools", type=int, default=50, help="agentic: tools in the shared catalogue (<= 60)")
    d.add_argument("--agentic-tool-result-len", type=int, default=200,
                   help="agentic: tokens of each synthetic tool result")
    d.add_argument("--agentic-think-time", type=float, default=0.5,
                   help="agentic: seconds between an answer and the next turn (the tool running)")
    d.add_argument("--agentic-system-prompt-len", type=int, default=512,
                   help="agentic: tokens of the system prompt every session shares")
    d.add_argument("--agentic-tool-choice", default="none", choices=["none", "auto", "required"],
                   help="agentic: tool_choice sent with the tools (auto needs a server with auto tool choice; "
                        "with none the template still renders the whole catalogue)")

    a = p.add_argument_group("load")
    a.add_argument("--request-rate", default="inf",
                   help="requests/s (inf = all at once); a comma list sweeps the rates in one run")
    a.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson; <1 burstier; >1 more even")
    a.add_argument("--max-concurrency", type=int, default=None)
    a.add_argument("--num-warmups", type=int, default=0, help="requests sent first and left out of the results")
    a.add_argument("--ramp-up-strategy", default=None, choices=["linear", "exponential"])
    a.add_argument("--ramp-up-start-rps", type=float, default=None)
    a.add_argument("--ramp-up-end-rps", type=float, default=None)
    a.add_argument("--duration", type=float, default=None, help="send for this many seconds instead of a count")
    a.add_argument("--probe-request-rate", type=float, default=None, metavar="R",
                   help="also send 1-token probe requests at R/s (Poisson) beside the load, outside "
                        "--max-concurrency, reported apart: the latency a user's short request sees under it")
    a.add_argument("--stop-on-oversaturation", action="store_true",
                   help="stop sending a level once TTFT and the requests in flight both grow without bound "
                        "(the test in the result's 'saturation'; applied after the level either way)")
    a.add_argument("--ignore-eos", action="store_true")
    a.add_argument("--temperature", type=float, default=0.0)
    a.add_argument("--top-p", type=float, default=1.0)
    a.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--slo", default=None,
                   help="find the highest rate meeting every bound, e.g. p99_ttft_ms<=500,p99_tpot_ms<=50")
    a.add_argument("--slo-iterations", type=int, default=4, help="bisection steps of the --slo search")

    o = p.add_argument_group("results")
    o.add_argument("--percentile-metrics", default=DEFAULT_PERCENTILE_METRICS)
    o.add_argument("--metric-percentiles", default=DEFAULT_METRIC_PERCENTILES)
    o.add_argument("--goodput", nargs="+", default=None, help="SLOs for goodput, KEY:MS (ttft, tpot, e2el, ttst)")
    o.add_argument("--label", default=None)
    o.add_argument("--save-result", action="store_true")
    o.add_argument("--result-dir", default=".")
    o.add_argument("--result-filename", default=None)
    o.add_argument("--report-dir", default=None, help="write report.html and the PNG plots here")
    o.add_argument("--disable-tqdm", action="store_true", help="no live progress display")


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="result JSON A (the baseline)")
    p.add_argument("b", help="result JSON B")
    p.add_argument("--noise-floor", type=float, default=0.05,
                   help="relative differences below this are run-to-run noise (default 0.05)")
    p.add_argument("--json", action="store_true")
