"""``tailserve demo``: the built-in pair served three ways under the same small load, through
the real server and the real load generator, in about two minutes on a 2-core CPU.

1. baseline: the target model alone;
2. speculative decoding: the built-in draft proposes, the target verifies;
3. prefix caching: requests that share long prefixes (a few stdlib modules' heads), with
   the cache on, so most of each prompt is found rather than computed.

It prints one table (TTFT / TPOT P50 and P99, throughput, acceptance, prefix-hit rate, KV
utilisation), each run's tail verdict, two sample completions, and the HTML report's path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
from typing import Any

from tailserve.assets import DEFAULT_TARGET_DIR
from tailserve.bench.cli_args import DEFAULT_METRIC_PERCENTILES
from tailserve.bench.datasets import BenchRequest, DatasetConfig, load_dataset, python_source_files
from tailserve.bench.load import LoadConfig, run_load
from tailserve.bench.local_server import LocalServer
from tailserve.bench.report import render_table
from tailserve.bench.results import build_result, parse_percentiles
from tailserve.model.tokenizer import Tokenizer

# Sampling that keeps the small model's code readable: greedy decoding loops on it.
TEMPERATURE, TOP_P = 0.5, 0.9


def shared_prefix_requests(tok: Tokenizer, n: int, num_prefixes: int, prefix_tokens: int, output_len: int,
                           seed: int) -> list[BenchRequest]:
    """N stdlib module heads (``prefix_tokens`` each) × function openings: prefix caching's case."""
    rng = random.Random(seed)
    prefixes = []
    for path in rng.sample(python_source_files(), num_prefixes):
        ids = tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)[:prefix_tokens]
        head = tok.decode(ids)
        prefixes.append(head[: head.rfind("\n") + 1] or head)
    openings = load_dataset(DatasetConfig(name="python", num_prompts=n, input_len=48, output_len=output_len,
                                          seed=seed + 1), tok)
    out = []
    for i, o in enumerate(openings):
        prompt = prefixes[i % num_prefixes] + "\n\n" + o.prompt
        out.append(BenchRequest(prompt, len(tok.encode(prompt)), output_len))
    rng.shuffle(out)
    return out


def run_demo(args: argparse.Namespace) -> int:
    from tailserve.bench.report import html_report, plots

    tok = Tokenizer(DEFAULT_TARGET_DIR)
    n = args.num_prompts or (8 if args.quick else 24)
    rate = args.request_rate or 3.0
    out_len = 24 if args.quick else 48
    python = load_dataset(DatasetConfig(name="python", num_prompts=n, input_len=96, output_len=out_len, seed=0), tok)
    shared = shared_prefix_requests(tok, n, num_prefixes=3, prefix_tokens=320, output_len=out_len, seed=0)
    kv = ["--kv-cache-memory", "32MiB"]  # small enough that its utilisation reads as more than 0%
    configs: list[tuple[str, list[str], list[BenchRequest]]] = [
        ("baseline", [*kv, "--no-enable-prefix-caching"], python),
        ("speculative (built-in draft)", [*kv, "--no-enable-prefix-caching", "--speculative-model", "builtin"],
         python),
        ("shared prefix + prefix caching", [*kv, "--enable-prefix-caching"], shared),
    ]
    percentiles = parse_percentiles(DEFAULT_METRIC_PERCENTILES)
    results: list[dict[str, Any]] = []
    samples: list[tuple[str, str]] = []
    report_dir = pathlib.Path(args.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    print(f"tailserve demo: {n} requests per configuration at {rate:g} req/s (Poisson), {out_len} new tokens each, "
          f"temperature {TEMPERATURE}, top-p {TOP_P}; the built-in target has 11M parameters (a toy trained on "
          "the standard library), so expect Python-shaped text, not correct programs.", flush=True)
    for label, flags, requests in configs:
        print(f"  {label}: starting tailserve serve {' '.join(flags)} ...", flush=True)
        # --quick (tests, a first look) skips the servers' start-up warm-up: its two warm-up
        # requests per configuration still pay the first-shape costs before the measured load.
        with LocalServer([*flags, "--no-warmup"] if args.quick else flags) as srv:
            cfg = LoadConfig(base_url=srv.url, request_rate=rate, num_warmups=2, temperature=TEMPERATURE,
                             top_p=TOP_P, seed=0, extra_body={"seed": 1})
            run = asyncio.run(run_load(cfg, requests, tok))
        res = build_result(run, ["ttft", "ttst", "tpot", "itl", "e2el"], percentiles, label=label,
                           tokenizer_id=str(DEFAULT_TARGET_DIR), dataset_name="python")
        results.append(res)
        (report_dir / f"{label.split()[0]}.json").write_text(json.dumps(res, indent=1))
        if label != configs[-1][0]:
            ok = [(q, r) for q, r in zip(requests, run.records) if r.success]
            if ok:
                q, r = ok[0]
                samples.append((label, q.prompt[q.prompt.rfind("\n", 0, len(q.prompt) - 1) + 1:] + r.text))
    print()
    print(render_table(results, title="tailserve demo: the same load three ways"), end="")
    for label, text in samples:
        print(f"\n--- sample completion ({label}):\n{text}")
    pngs = plots(results)
    for name, data in pngs.items():
        (report_dir / f"{name}.png").write_bytes(data)
    (report_dir / "report.html").write_text(html_report(results, title="tailserve demo", command="tailserve demo",
                                                        pngs=pngs, samples=samples))
    print(f"\nHTML report: {report_dir / 'report.html'}")
    return 0
