"""Block verification against token-wise verification on the built-in pair: accepted drafts.

Block verification (Sun et al., ICLR 2025; ``--speculative-verification block``) keeps the
target's distribution and accepts at least as many drafts on average. This measures how
many more: the built-in draft with a fixed k (2, 4, 8; the stop margin 0, so every round
drafts k), unseeded sampling at temperature 0.8 and 1.0, held-out stdlib prompts x 128
tokens, batch 1, both rules on the same prompts in turn, ``--runs`` rounds (default 2).
Reports the mean tokens per round (accepted drafts + 1), the acceptance rate and decode
tok/s (end to end) per rule, and the ratio block / token.

    python benchmarks/bench_block_verification.py [--runs 2] [--prompts 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_speculative import held_out_prompts

from tailserve import LLM, SamplingParams
from tailserve.assets import DEFAULT_DRAFT_DIR
from tailserve.engine.plan import detect_capabilities


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    caps = detect_capabilities(torch.device("cpu"))
    print(f"CPU: {caps.cpu_capability}; {torch.get_num_threads()} threads", flush=True)
    prompts = held_out_prompts(args.prompts)
    results = []
    for temperature in (0.8, 1.0):
        for k in (2, 4, 8):
            engines = {rule: LLM(dtype="auto", kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
                                 max_num_seqs=1, speculative_model=str(DEFAULT_DRAFT_DIR), num_speculative_tokens=k,
                                 speculative_verification=rule, seed=r)
                       for r, rule in enumerate(("token", "block"))}
            params = SamplingParams(temperature=temperature, max_tokens=args.tokens, ignore_eos=True)
            rates: dict[str, list[float]] = {rule: [] for rule in engines}
            for _ in range(args.runs):
                for p in prompts:
                    for rule, llm in engines.items():
                        t0 = time.perf_counter()
                        llm.generate([p], params)
                        rates[rule].append(args.tokens / (time.perf_counter() - t0))
            row: dict[str, object] = {"temperature": temperature, "k": k}
            for rule, llm in engines.items():
                s = llm.engine.spec_stats
                row[rule] = {"tokens_per_round": s.mean_acceptance_length, "acceptance_rate": s.acceptance_rate,
                             "rounds": s.num_drafts, "tok_s": statistics.median(rates[rule])}
            gain = row["block"]["tokens_per_round"] / row["token"]["tokens_per_round"]  # type: ignore[index]
            speed = row["block"]["tok_s"] / row["token"]["tok_s"]  # type: ignore[index]
            row["tokens_per_round_ratio"], row["tok_s_ratio"] = gain, speed
            print(f"t={temperature} k={k}: tokens/round token {row['token']['tokens_per_round']:.3f} "  # type: ignore[index]
                  f"block {row['block']['tokens_per_round']:.3f} ({gain:.3f}x; "  # type: ignore[index]
                  f"{row['token']['rounds']} / {row['block']['rounds']} rounds), "  # type: ignore[index]
                  f"tok/s block / token {speed:.2f}x", flush=True)
            results.append(row)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"cpu": caps.cpu_capability, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
