"""Suffix decoding against plain decoding on the built-in target, batch 1, in one run.

Workloads (prompts: the first 200 characters of held-out standard-library files):
  (a) cold: 6 prompts, 128 new tokens each, nothing cached yet (the request's own text only);
  (b) repeated: the same 6 requests again, their earlier outputs now in the global cache;
  (c) multi-turn: 4 sessions of 4 turns, each turn's prompt carrying the whole conversation
      so far (earlier prompts and answers) plus a new file's opening, as an agent's context
      grows: the answers repeat what the context already holds.
Greedy (identical outputs, checked) and temperature 0.8, seeded and not. Each figure is the median
over --rounds rounds, plain and suffix interleaved (fresh engines per round, both warmed up as
`tailserve serve` is, so (a) is cold for the suffix cache only); ratios are suffix / plain in
the same round.

    python benchmarks/bench_suffix.py [--rounds 3]

``--agentic``: served instead, on the bench's agentic sessions. Per round and load, a fresh
``tailserve serve`` of the built-in target with speculation off and one with
``--speculative-method suffix`` (adaptive k, a cold global cache), in alternating order, each
loaded by ``tailserve bench --dataset-name agentic`` with the same seed: --sessions sessions x
--turns turns over a 50-tool catalogue, every turn one forced tool call (greedy, ``tool_choice:
required``), a synthetic tool result and a think time before the next. Loads: one session at a
time (``--max-concurrency 1``) and all sessions at once. Reports per configuration the medians
over rounds of TPOT P50, E2EL P50, session end-to-end P50 and output tok/s, the drafts a token
and their acceptance, and suffix / off per round (TPOT: off / suffix, so above 1 is faster).
Greedy outputs are the same with and without drafts, so each request's output length must
match between the two servers: checked.

    python benchmarks/bench_suffix.py --agentic [--rounds 3] [--sessions 4] [--turns 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sysconfig
import time

import torch


def held_out_prompts(n: int, offset: int = 0) -> list[str]:
    from tailserve.assets import DEFAULT_TARGET_DIR

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    names = (DEFAULT_TARGET_DIR / "held_out_files.txt").read_text().split()
    files = [root / n for n in names if (root / n).is_file()]
    return [f.read_text(encoding="utf-8")[:200] for f in files[offset : offset + n]]


def timed(llm, prompts: list[str], params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = [llm.generate([p], params)[0] for p in prompts]  # batch 1: one request at a time
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, [o.outputs[0].token_ids for o in outs]


def multi_turn(llm, params, sessions: int = 4, turns: int = 4) -> tuple[float, list[list[int]]]:
    openings = held_out_prompts(sessions * turns, offset=6)
    tok = llm.engine.tokenizer
    n_tokens, elapsed, ids = 0, 0.0, []
    for s in range(sessions):
        context = ""
        for t in range(turns):
            prompt = context + "\n# next file\n" + openings[s * turns + t]
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0]
            elapsed += time.perf_counter() - t0
            n_tokens += len(out.token_ids)
            ids.append(out.token_ids)
            context = prompt + tok.decode(out.token_ids)
    return n_tokens / elapsed, ids


def cpu_capability() -> str:
    from tailserve.engine.plan import detect_capabilities

    return detect_capabilities(torch.device("cpu")).cpu_capability


def agentic_run(suffix: bool, concurrency: int | None, seed: int, args: argparse.Namespace) -> dict:
    """One ``tailserve bench --dataset-name agentic`` load against a fresh server."""
    import json
    import tempfile

    from tailserve.assets import DEFAULT_TARGET_DIR
    from tailserve.bench.local_server import LocalServer
    from tailserve.cli import main as cli_main

    server = ["--no-warmup", "--max-model-len", "12288", "--kv-cache-memory", "256MiB", "--dtype", args.dtype]
    if suffix:
        server += ["--speculative-method", "suffix"]
    bench = ["--tokenizer", str(DEFAULT_TARGET_DIR), "--dataset-name", "agentic", "--num-prompts", str(args.sessions),
             "--agentic-num-turns", str(args.turns), "--agentic-num-tools", "50", "--agentic-tool-choice", "required",
             "--agentic-think-time", str(args.think_time), "--random-output-len", "64", "--seed", str(seed),
             "--extra-body", json.dumps({"parallel_tool_calls": False}), "--disable-tqdm", "--save-result",
             "--result-filename", "r.json"]
    if concurrency:
        bench += ["--max-concurrency", str(concurrency)]
    with LocalServer(server) as srv, tempfile.TemporaryDirectory() as tmp:
        rc = cli_main(["bench", "--url", srv.url, *bench, "--result-dir", tmp])
        if rc != 0:
            raise SystemExit(f"bench failed against {'suffix' if suffix else 'off'}: {srv.output()[-2000:]}")
        res = json.loads((pathlib.Path(tmp) / "r.json").read_text())
    if res["failed"]:
        raise SystemExit(f"{res['failed']} requests failed: {sorted({e for e in res['errors'] if e})}")
    return {"tpot_p50_ms": res["p50_tpot_ms"], "e2el_p50_ms": res["p50_e2el_ms"],
            "session_p50_ms": res["session_e2e"]["p50_e2e_ms"], "output_tok_s": res["output_throughput"],
            "ttft_p50_ms": res["p50_ttft_ms"], "output_tokens": res["total_output_tokens"],
            # keyed by session and turn: a later turn's send time, and so the records' order, varies
            "output_lens": sorted((r["conversation"], r["turn"], r["output_tokens"]) for r in res["requests"]),
            "drafts_per_token": (res.get("spec_decode_draft_tokens") or 0)
            / max(res["total_output_tokens"], 1), "acceptance": res.get("spec_decode_acceptance_rate") or 0.0,
            "acceptance_length": res.get("spec_decode_acceptance_length")}


def agentic_row(runs: dict[str, list[dict]]) -> dict:
    """Medians over rounds per configuration, and of each round's suffix / off (times: off / suffix)."""
    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name])

    def ratio(key: str, inverse: bool = False) -> float:
        pairs = zip(runs["off"], runs["suffix"])
        return statistics.median((o[key] / s[key]) if inverse else (s[key] / o[key]) for o, s in pairs)

    row = {key: [med("off", key), med("suffix", key)]
           for key in ("tpot_p50_ms", "e2el_p50_ms", "session_p50_ms", "output_tok_s", "ttft_p50_ms")}
    return {**row, "decode_speedup": ratio("tpot_p50_ms", inverse=True), "e2el_speedup": ratio("e2el_p50_ms", True),
            "session_speedup": ratio("session_p50_ms", True), "throughput_ratio": ratio("output_tok_s"),
            "drafts_per_token": med("suffix", "drafts_per_token"), "acceptance": med("suffix", "acceptance"),
            "output_tokens": med("off", "output_tokens"), "runs": runs}


def agentic(args: argparse.Namespace) -> None:
    import json
    import os

    os.environ["TAILSERVE_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # the catalogue outgrows the built-in 2,048
    loads = {"1 session at a time": 1, f"{args.sessions} sessions at once": None}
    print(f"CPU: {cpu_capability()}; built-in target, dtype {args.dtype}; agentic: {args.sessions} sessions x "
          f"{args.turns} turns, 50 tools, one forced tool call a turn (greedy), think time {args.think_time:g} s; "
          f"{args.rounds} rounds", flush=True)
    out: dict = {"cpu": cpu_capability(), "sessions": args.sessions, "turns": args.turns, "loads": {}}
    for li, (load, conc) in enumerate(loads.items()):
        runs: dict[str, list[dict]] = {"off": [], "suffix": []}
        for r in range(args.rounds):
            order = ("off", "suffix") if r % 2 == 0 else ("suffix", "off")
            for name in order:
                runs[name].append(agentic_run(name == "suffix", conc, 1000 * r + li, args))
            off, suf = runs["off"][-1], runs["suffix"][-1]
            if off["output_lens"] != suf["output_lens"]:
                diff = [(a, b) for a, b in zip(off["output_lens"], suf["output_lens"]) if a != b]
                raise SystemExit(f"greedy outputs differ with suffix decoding ({load}, round {r + 1}): (session, "
                                 f"turn, tokens) off vs suffix {diff}")
            print(f"  {load}, round {r + 1}: TPOT P50 off {off['tpot_p50_ms']:.2f} / suffix "
                  f"{suf['tpot_p50_ms']:.2f} ms, session P50 {off['session_p50_ms']:.0f} / "
                  f"{suf['session_p50_ms']:.0f} ms, drafts a token "
                  f"{suf['drafts_per_token']:.2f}, acceptance {suf['acceptance']:.0f}%", flush=True)

        out["loads"][load] = agentic_row(runs)
    print("\nload | TPOT P50 off / suffix (ms) | decode speed-up | E2EL P50 off / suffix | session P50 off / suffix "
          "| out tok/s ratio | drafts a token | acceptance")
    for load, row in out["loads"].items():
        print(f"{load} | {row['tpot_p50_ms'][0]:.2f} / {row['tpot_p50_ms'][1]:.2f} | {row['decode_speedup']:.2f}x | "
              f"{row['e2el_p50_ms'][0]:.0f} / {row['e2el_p50_ms'][1]:.0f} ({row['e2el_speedup']:.2f}x) | "
              f"{row['session_p50_ms'][0]:.0f} / {row['session_p50_ms'][1]:.0f} ({row['session_speedup']:.2f}x) | "
              f"{row['throughput_ratio']:.2f}x | {row['drafts_per_token']:.2f} | {row['acceptance']:.0f}%")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--agentic", action="store_true", help="served, on the bench's agentic sessions (see above)")
    ap.add_argument("--sessions", type=int, default=4, help="--agentic: sessions")
    ap.add_argument("--turns", type=int, default=6, help="--agentic: turns a session")
    ap.add_argument("--think-time", type=float, default=0.2, help="--agentic: seconds between turns")
    ap.add_argument("--dtype", default="auto", help="--agentic: the servers' --dtype")
    ap.add_argument("--json", default=None, help="--agentic: write the figures here")
    args = ap.parse_args()
    if args.agentic:
        agentic(args)
        return
    from tailserve import LLM, SamplingParams

    print(f"CPU: {cpu_capability()}, {torch.get_num_threads()} threads; built-in target, batch 1")
    prompts = held_out_prompts(6)
    configs = {"greedy": SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
               "t=0.8 seeded": SamplingParams(max_tokens=128, temperature=0.8, seed=0, ignore_eos=True),
               "t=0.8 unseeded": SamplingParams(max_tokens=128, temperature=0.8, ignore_eos=True)}
    for name, params in configs.items():
        rows: dict[str, list[tuple[float, float]]] = {"cold": [], "repeated": [], "multi-turn": []}
        accept: list[float] = []
        for _ in range(args.rounds):
            # Both fresh each round (the suffix engine for a cold global cache) and warmed up as
            # `tailserve serve` is: a fresh engine's first prompt of each length otherwise paid
            # oneDNN's set-up (several ms on a 1-2 ms prefill) where the plain engine, kept
            # across rounds, had paid it already, and that read as suffix decoding's cost.
            plain = LLM(warmup=True)
            suffix = LLM(speculative_method="suffix", warmup=True)
            p_cold, ref = timed(plain, prompts, params)
            s_cold, got = timed(suffix, prompts, params)
            p_rep, _ = timed(plain, prompts, params)
            s_rep, got2 = timed(suffix, prompts, params)
            p_mt, ref_mt = multi_turn(plain, params)
            s_mt, got_mt = multi_turn(suffix, params)
            if params.temperature == 0:
                assert got == ref and got2 == ref and got_mt == ref_mt, "greedy suffix decoding diverged"
            rows["cold"].append((p_cold, s_cold))
            rows["repeated"].append((p_rep, s_rep))
            rows["multi-turn"].append((p_mt, s_mt))
            accept.append(suffix.stats()["speculative"]["acceptance_rate"] or 0.0)
            del suffix, plain
        print(f"\n{name} (median of {args.rounds} rounds; acceptance {statistics.median(accept):.2f})")
        for w, vals in rows.items():
            p = statistics.median(v[0] for v in vals)
            s = statistics.median(v[1] for v in vals)
            r = statistics.median(v[1] / v[0] for v in vals)
            print(f"  {w:11} plain {p:7.1f} tok/s   suffix {s:7.1f} tok/s   {r:5.2f}x")


if __name__ == "__main__":
    main()
