"""Agentic sessions against tailserve: tool pruning off / prune / mask, with and without KV
kept across tool calls, under a KV budget that forces evictions.

Each configuration gets its own ``tailserve serve`` of the built-in pair (no speculation, so
prefill and the cache are what differ), loaded by ``tailserve bench --dataset-name agentic``:
a 50-tool catalogue shared by every session, 8 sessions x 6 turns, every turn one forced tool
call (``tool_choice: required``, ``parallel_tool_calls: false``: ``mask`` then has a call to
constrain, and every answer ends in a tool call, as an agent's turns do), a synthetic tool
result and a think time before the next turn. The catalogue is longer than the built-in
model's 2,048-token context, so the servers run with ``TAILSERVE_ALLOW_LONG_MAX_MODEL_LEN=1
--max-model-len 12288`` (the outputs are no better for it; the cache and the compute are what
is measured).

    python benchmarks/bench_agentic.py [--rounds 1] [--kv-cache-memory 48MiB] [--json out.json]

Prints per configuration: prompt tokens per turn (first, last), the prefix-cache hit rate,
TTFT P50/P99 per turn, session end-to-end P50/P99, and the server's evictions and pinned-block
hits; rounds run the configurations in alternating order and report medians.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile

import httpx

from tailserve.assets import DEFAULT_TARGET_DIR
from tailserve.bench.local_server import LocalServer
from tailserve.cli import main as cli_main

CONFIGS = [("off", 0.0), ("off", 5.0), ("prune", 0.0), ("prune", 5.0), ("mask", 0.0), ("mask", 5.0)]


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"tailserve:(prefix_cache_evictions_total|kv_cache_pinned_hits_total|"
                     r"kv_cache_pinned_taken_total|num_preemptions_total)\{[^}]*\} ([0-9.e+]+)", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def run_one(mode: str, ttl: float, args: argparse.Namespace, seed: int) -> dict:
    server = ["--no-warmup", "--max-model-len", "12288", "--kv-cache-memory", args.kv_cache_memory,
              "--tool-pruning", mode, "--tool-pruning-max-tools", str(args.max_tools),
              "--tool-call-kv-ttl", str(ttl), "--dtype", args.dtype]
    with LocalServer(server) as srv, tempfile.TemporaryDirectory() as tmp:
        before = counters(srv.url)
        rc = cli_main(["bench", "--url", srv.url, "--tokenizer", str(DEFAULT_TARGET_DIR), "--dataset-name", "agentic",
                       "--num-prompts", str(args.sessions),
                       "--agentic-num-turns", str(args.turns), "--agentic-num-tools", "50",
                       "--agentic-tool-choice", "required", "--agentic-think-time", str(args.think_time),
                       "--random-output-len", str(args.output_len), "--seed", str(seed), "--disable-tqdm",
                       "--extra-body", json.dumps({"parallel_tool_calls": False}),
                       "--save-result", "--result-dir", tmp, "--result-filename", "r.json"])
        if rc != 0:
            raise SystemExit(f"bench failed for {mode}, ttl {ttl}")
        after = counters(srv.url)
        res = json.loads((pathlib.Path(tmp) / "r.json").read_text())
    res["server_deltas"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    errors = {e for e in res["errors"] if e}
    if errors:
        print(f"{mode} ttl {ttl:g}: {res['failed']} failed: {'; '.join(sorted(errors))[:300]}", file=sys.stderr)
    return res


def summarize(res: dict) -> dict:
    turns = res["turns"]
    later = [t for t in turns if t["turn"] > 0]
    pc = res.get("prefix_cache") or {}
    return {
        "completed": res["completed"], "failed": res["failed"],
        "prompt_tokens_first": turns[0]["mean_prompt_tokens"], "prompt_tokens_last": turns[-1]["mean_prompt_tokens"],
        "hit_rate": pc.get("hit_rate"),
        "ttft_p50_first": turns[0]["p50_ttft_ms"], "ttft_p99_first": turns[0]["p99_ttft_ms"],
        "ttft_p50_later": statistics.median(t["p50_ttft_ms"] for t in later if t["p50_ttft_ms"] is not None),
        "ttft_p99_later": max(t["p99_ttft_ms"] for t in later if t["p99_ttft_ms"] is not None),
        "session_p50_ms": res["session_e2e"]["p50_e2e_ms"] or float("nan"),
        "session_p99_ms": res["session_e2e"]["p99_e2e_ms"] or float("nan"),
        "evictions": res["server_deltas"].get("prefix_cache_evictions_total", 0.0),
        "pinned_hits": res["server_deltas"].get("kv_cache_pinned_hits_total", 0.0),
        "preemptions": res["server_deltas"].get("num_preemptions_total", 0.0),
        "recomputed_by_segment": pc.get("recomputed_tokens_by_segment"),
        "turns": turns,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tools", type=int, default=8)
    ap.add_argument("--think-time", type=float, default=0.5)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="48MiB")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--configs", default=None, help="e.g. off:0,prune:5 (default: all six)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["TAILSERVE_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    configs = CONFIGS if not args.configs else [(c.split(":")[0], float(c.split(":")[1]))
                                                for c in args.configs.split(",")]
    rows: dict[tuple[str, float], list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for mode, ttl in order:
            s = summarize(run_one(mode, ttl, args, seed=r))
            rows[(mode, ttl)].append(s)
            print(f"round {r + 1} {mode:>5} ttl {ttl:g}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in s.items() if isinstance(v, float)), file=sys.stderr, flush=True)

    def med(c, key):
        vals = [x[key] for x in rows[c] if x[key] is not None]
        return statistics.median(vals) if vals else float("nan")

    print(f"\nagentic: {args.sessions} sessions x {args.turns} turns, 50 tools, max_tools {args.max_tools}, "
          f"KV {args.kv_cache_memory}, dtype {args.dtype}, median of {args.rounds} round(s)")
    head = ("pruning", "ttl s", "prompt tok t0/t5", "hit rate", "TTFT t0 P50/P99", "TTFT t1+ P50/P99",
            "session P50/P99 ms", "evictions", "pinned hits", "failed")
    print(" | ".join(head))
    for c in configs:
        tokens = f"{med(c, 'prompt_tokens_first'):.0f} / {med(c, 'prompt_tokens_last'):.0f}"
        print(" | ".join([c[0], f"{c[1]:g}", tokens,
                          f"{med(c, 'hit_rate'):.2f}",
                          f"{med(c, 'ttft_p50_first'):.0f} / {med(c, 'ttft_p99_first'):.0f}",
                          f"{med(c, 'ttft_p50_later'):.0f} / {med(c, 'ttft_p99_later'):.0f}",
                          f"{med(c, 'session_p50_ms'):.0f} / {med(c, 'session_p99_ms'):.0f}",
                          f"{med(c, 'evictions'):.0f}", f"{med(c, 'pinned_hits'):.0f}", f"{med(c, 'failed'):.0f}"]))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({f"{m}:{t:g}": v for (m, t), v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
