"""Goodput under Poisson load: speculation off, fixed k 2 and 4, adaptive k for throughput, and
adaptive k for goodput (``--speculative-objective goodput --slo ...``), on the built-in pair.

One ``tailserve serve`` per configuration, all started first (an idle server costs nothing);
then for each request rate, from light load to past saturation, every configuration takes the
same load in turn (the order rotates per round, so drift hits them alike). The rates are
fractions of the saturation rate of speculation off, measured first. Each run sends Poisson
arrivals of the ``python`` dataset (held-out standard-library code, 128 tokens out, EOS
ignored) and scores request goodput as ``vllm bench serve --goodput`` does: requests per
second whose TTFT and TPOT both meet the bounds. A cell's figure is the median over rounds.
Each run also reads the server's /metrics before and after: the drafts it proposed a token
emitted, and for the goodput objective the steps where it overrode throughput's k.

    python benchmarks/bench_goodput.py [--rounds 2] [--slo-tpot-ms 12] [--slo-ttft-ms 250]
        [--png docs/goodput.png] [--json out.json]
    python benchmarks/bench_goodput.py --replot out.json --png docs/goodput.png

The SLO defaults are set from this machine: --calibrate prints off's TPOT and TTFT P99 at
light load and at saturation, from which bounds between the two are chosen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import pathlib
import statistics
import time
from contextlib import ExitStack

import torch

from tailserve.assets import DEFAULT_TARGET_DIR
from tailserve.bench.datasets import DatasetConfig, load_dataset
from tailserve.bench.load import LoadConfig, run_load
from tailserve.bench.local_server import LocalServer
from tailserve.bench.results import build_result, parse_percentiles
from tailserve.model.tokenizer import Tokenizer

COMMON = ["--kv-cache-memory", "256MiB", "--no-enable-prefix-caching", "--max-num-seqs", "16"]


def configs(slo: str) -> dict[str, list[str]]:
    draft = ["--speculative-model", "builtin"]
    return {
        "off": [],
        "k=2": [*draft, "--num-speculative-tokens", "2"],
        "k=4": [*draft, "--num-speculative-tokens", "4"],
        "throughput": draft,
        "goodput": [*draft, "--speculative-objective", "goodput", "--slo", slo],
    }


def spec_counters(url: str) -> tuple[float, float]:
    """(draft tokens proposed, goodput overrides) so far, from the server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    found = {"tailserve:spec_decode_num_draft_tokens": 0.0, "tailserve:spec_decode_goodput_overrides": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name in found:
            found[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return found["tailserve:spec_decode_num_draft_tokens"], found["tailserve:spec_decode_goodput_overrides"]


def measure(url: str, requests, tok, rate: float, temperature: float, goodput: dict[str, float]) -> dict:
    """One run at ``rate``: the bench's result, its wall time, and what the server's
    speculation did meanwhile (drafts a token emitted, goodput overrides)."""
    drafts0, overrides0 = spec_counters(url)
    cfg = LoadConfig(base_url=url, request_rate=rate, num_warmups=2, temperature=temperature, seed=0,
                     ignore_eos=True)
    t0 = time.perf_counter()
    run = asyncio.run(run_load(cfg, requests, tok))
    res = build_result(run, ["ttft", "tpot", "e2el"], parse_percentiles("50,99"), goodput, label=url,
                       tokenizer_id=str(DEFAULT_TARGET_DIR), dataset_name="python")
    res["wall_s"] = time.perf_counter() - t0
    drafts, overrides = spec_counters(url)
    res["drafts_per_token"] = (drafts - drafts0) / max(res["total_output_tokens"], 1)
    res["goodput_overrides"] = overrides - overrides0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fractions", default="0.25,0.5,0.75,1.0,1.5",
                    help="request rates as fractions of speculation off's saturation rate")
    ap.add_argument("--rates", default=None, help="request rates (req/s, comma-separated) instead of --fractions")
    ap.add_argument("--seconds", type=float, default=8.0, help="about how long each run sends (sets its count)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=12.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=250.0)
    ap.add_argument("--configs", default=None, help="only these configurations, comma-separated (off is always in)")
    ap.add_argument("--calibrate", action="store_true", help="only print off's latencies at light load and saturation")
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--replot", default=None, metavar="JSON", help="only draw --png from an earlier --json")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(pathlib.Path(args.replot).read_text()), args.png or "goodput.png")
        return

    from tailserve.engine.plan import detect_capabilities

    cpu = detect_capabilities(torch.device("cpu")).cpu_capability
    tok = Tokenizer(DEFAULT_TARGET_DIR)
    slo = f"p99_tpot_ms<={args.slo_tpot_ms:g},p99_ttft_ms<={args.slo_ttft_ms:g}"
    goodput = {"tpot": args.slo_tpot_ms, "ttft": args.slo_ttft_ms}
    names = configs(slo)
    if args.calibrate:
        names = {"off": names["off"]}
    elif args.configs:
        wanted = {"off", *args.configs.split(",")}
        unknown = wanted - set(names)
        if unknown:
            raise SystemExit(f"--configs: unknown {', '.join(sorted(unknown))} (known: {', '.join(names)})")
        names = {n: f for n, f in names.items() if n in wanted}

    def dataset(n: int):
        return load_dataset(DatasetConfig(name="python", num_prompts=n, input_len=96, output_len=128, seed=0), tok)

    with ExitStack() as stack:
        servers = {name: stack.enter_context(LocalServer([*COMMON, *flags])) for name, flags in names.items()}
        print(f"CPU: {cpu}; SLO {slo}; temperature {args.temperature}", flush=True)
        sat = measure(servers["off"].url, dataset(32), tok, math.inf, args.temperature, goodput)
        capacity = sat["request_throughput"]
        print(f"off at saturation: {capacity:.2f} req/s, {sat['output_throughput']:.0f} tok/s, "
              f"TTFT P99 {sat['p99_ttft_ms']:.0f} ms, TPOT P99 {sat['p99_tpot_ms']:.1f} ms", flush=True)
        if args.calibrate:
            light = measure(servers["off"].url, dataset(12), tok, capacity * 0.2, args.temperature, goodput)
            print(f"off at 0.2x: TTFT P99 {light['p99_ttft_ms']:.0f} ms, TPOT P99 {light['p99_tpot_ms']:.1f} ms")
            return
        rates = [float(r) for r in args.rates.split(",")] if args.rates else \
            [capacity * float(f) for f in args.fractions.split(",")]
        cells: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for i, rate in enumerate(rates):
                n = max(16, round(rate * args.seconds))
                order = list(names)
                order = order[(r + i) % len(order):] + order[:(r + i) % len(order)]
                for name in order:
                    res = measure(servers[name].url, dataset(n), tok, rate, args.temperature, goodput)
                    cells.setdefault((name, i), []).append(res)
                print(f"round {r + 1}, {rate:.2f} req/s: " + "  ".join(
                    f"{name} {c['request_goodput']:.2f} ({c['drafts_per_token']:.2f} drafts a token"
                    + (f", {c['goodput_overrides']:.0f} overrides" if name == "goodput" else "") + ")"
                    for name in names for c in [cells[(name, i)][-1]]), flush=True)

    def med(name: str, i: int, key: str) -> float:
        return statistics.median(c[key] for c in cells[(name, i)])

    print(f"\nrequest goodput (req/s meeting {slo}), median of {args.rounds} rounds; {cpu}:")
    print(f"{'rate':>6} | " + " ".join(f"{name:>10}" for name in names) + " | best fixed / goodput obj")
    table = []
    for i, rate in enumerate(rates):
        row = {name: {key: med(name, i, key) for key in ("request_goodput", "output_throughput", "p99_tpot_ms",
                                                          "p99_ttft_ms", "request_throughput", "drafts_per_token",
                                                          "goodput_overrides")}
               for name in names}
        best_fixed = max(row[n]["request_goodput"] for n in ("off", "k=2", "k=4") if n in row)
        ratio = row["goodput"]["request_goodput"] / best_fixed if best_fixed and "goodput" in row else float("nan")
        print(f"{rate:>6.2f} | " + " ".join(f"{row[n]['request_goodput']:>10.2f}" for n in names)
              + f" | {ratio:.2f}x")
        table.append({"rate": rate, **row})
    print("\noutput tok/s, median:")
    for i, rate in enumerate(rates):
        print(f"{rate:>6.2f} | " + " ".join(f"{med(n, i, 'output_throughput'):>10.0f}" for n in names))
    out = {"cpu": cpu, "slo": slo, "temperature": args.temperature, "capacity_req_s": capacity,
           "rounds": args.rounds, "rows": table}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    if args.png:
        plot(out, args.png)


def plot(out: dict, png: str) -> None:
    """The goodput and throughput curves of a result (``--json``'s content) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    rates = [row["rate"] for row in rows]
    names = [n for n in rows[0] if n != "rate"]
    tpot, ttft = (float(part.split("<=")[1]) for part in out["slo"].split(","))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        ax1.plot(rates, [row[name]["request_goodput"] for row in rows], marker="o", label=name)
        ax2.plot(rates, [row[name]["output_throughput"] for row in rows], marker="o", label=name)
    ax1.set_xlabel("offered request rate (req/s, Poisson)")
    ax1.set_ylabel(f"goodput (req/s whose TPOT <= {tpot:g} ms and TTFT <= {ttft:g} ms)", fontsize=8)
    ax2.set_xlabel("offered request rate (req/s, Poisson)")
    ax2.set_ylabel("output tokens/s")
    ax1.legend(fontsize=8)
    ax1.set_title(f"built-in pair, {out['cpu']}, 2 cores, median of {out['rounds']} rounds", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
