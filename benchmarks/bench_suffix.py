"""Suffix decoding against plain decoding on the built-in target, batch 1, in one run.

Workloads (prompts: the first 200 characters of held-out standard-library files):
  (a) cold: 6 prompts, 128 new tokens each, nothing cached yet (the request's own text only);
  (b) repeated: the same 6 requests again, their earlier outputs now in the global cache;
  (c) multi-turn: 4 sessions of 4 turns, each turn's prompt carrying the whole conversation
      so far (earlier prompts and answers) plus a new file's opening, as an agent's context
      grows: the answers repeat what the context already holds.
Greedy (identical outputs, checked) and temperature 0.8, seeded and not. Each figure is the median
over --rounds rounds, plain and suffix interleaved (a fresh suffix engine per round, so (a)
is cold); ratios are suffix / plain in the same round.

    python benchmarks/bench_suffix.py [--rounds 3]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from tailserve import LLM, SamplingParams
    from tailserve.platform_info import cpu_flags

    flags = cpu_flags()
    isa = ("AVX-512" + (" with bf16" if "avx512_bf16" in flags else "")) if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    print(f"CPU: {isa}, {torch.get_num_threads()} threads; built-in target, batch 1")
    prompts = held_out_prompts(6)
    plain = LLM()
    configs = {"greedy": SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
               "t=0.8 seeded": SamplingParams(max_tokens=128, temperature=0.8, seed=0, ignore_eos=True),
               "t=0.8 unseeded": SamplingParams(max_tokens=128, temperature=0.8, ignore_eos=True)}
    for name, params in configs.items():
        rows: dict[str, list[tuple[float, float]]] = {"cold": [], "repeated": [], "multi-turn": []}
        accept: list[float] = []
        for _ in range(args.rounds):
            suffix = LLM(speculative_method="suffix")  # a cold global cache each round
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
            del suffix
        print(f"\n{name} (median of {args.rounds} rounds; acceptance {statistics.median(accept):.2f})")
        for w, vals in rows.items():
            p = statistics.median(v[0] for v in vals)
            s = statistics.median(v[1] for v in vals)
            r = statistics.median(v[1] / v[0] for v in vals)
            print(f"  {w:11} plain {p:7.1f} tok/s   suffix {s:7.1f} tok/s   {r:5.2f}x")


if __name__ == "__main__":
    main()
