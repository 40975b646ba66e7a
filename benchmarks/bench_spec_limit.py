"""Speculative decoding's speed-up against its analytical limit, with synthetic acceptance.

For acceptance rate a (each draft accepted with probability a, independently), draft length
k and cost ratio c (a draft step over a target step), the expected speed-up is
(1 - a^(k+1)) / ((1 - a)(k c + 1)) (Leviathan et al. 2023). Synthetic acceptance
(``speculative_synthetic_acceptance``, LOSSY, benchmarks only) fixes a for any pair, so the
system's own overhead shows as the gap between measured and expected.

Pair: the 55M Llama of shared/PEERS.md (hidden 512, 8 layers, vocabulary 32000) and a 2-layer
draft of the same width, random weights stored in bf16 (made on the fly). c is measured per
batch size as the draft's plain decode step over the target's. Greedy, 128 new tokens per
request, batch 1 and 16; the baseline is the target without speculation, measured beside each
speculative run (--runs pairs a cell, alternating which goes first), medians over the pairs.

Where measured falls short of expected, the table says where: the formula charges a round
1 + k c target steps and credits it (1 - a^(k+1)) / (1 - a) tokens. The engine's step log
(its worker's own stamps) gives the tokens a decode step emitted and a speculative step in off
steps, split into the formula's 1 + k c and three excesses: the verification forward over the
plain one (k + 1 rows a request are not free), the drafts over k c (c includes the draft
engine's own step overhead, which a draft inside speculation does not pay), and the rest
(bookkeeping of drafts, output processing of more tokens a step).

    TAILSERVE_BENCHMARK=1 python benchmarks/bench_spec_limit.py [--runs 3] [--batches 1] [--json out.json]
        [--draft-quantization int8|w8a8_int8|none]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)


def make(path: str, layers: int, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**SHAPE, "num_hidden_layers": layers})).to(torch.bfloat16).save_pretrained(
        path, safe_serialization=True)
    return path


def run_once(llm, batch: int, new_tokens: int = 128) -> dict:
    """One timed generate of ``batch`` requests: tokens/s, and from the engine's step log the
    mean decode step split into the target's forward, the proposal and the rest (output
    processing outside the core's step spread over every step), plus the tokens a decode step
    emitted and the drafts verified."""
    from tailserve import SamplingParams

    prompts = [[(7 * i + j) % 31000 + 100 for j in range(32)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    log = llm.engine.step_log
    before = log[-1].step if log else -1
    spec0 = llm.stats()["speculative"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    spec1 = llm.stats()["speculative"]
    steps = [s for s in log if s.step > before]
    outside = (wall - sum(s.duration_s for s in steps)) / max(len(steps), 1)  # the engine around the core
    decode = [s for s in steps if s.num_prefill_tokens == 0]
    n = max(len(decode), 1)
    return {
        "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "step_s": sum(s.duration_s for s in decode) / n + outside,
        "forward_s": sum(s.target_forward_s for s in decode) / n,
        "propose_s": sum(s.propose_s for s in decode) / n,
        # a request's tokens a step (steps near the end hold fewer requests: rounds accept apart)
        "tokens_per_step": sum(s.num_output_tokens for s in decode) / max(sum(s.num_requests for s in decode), 1),
        "drafts": spec1["num_draft_tokens"] - spec0["num_draft_tokens"],
        "rounds": spec1["num_drafts"] - spec0["num_drafts"],
        "accepted": spec1["num_accepted_tokens"] - spec0["num_accepted_tokens"],
    }


def warm(llm, batch: int) -> None:
    from tailserve import SamplingParams

    prompts = [[(7 * i + j) % 31000 + 100 for j in range(32)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm the shapes


def expected(a: float, k: int, c: float) -> float:
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3, help="interleaved (off, speculative) pairs per cell")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--acceptances", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--draft-quantization", default=None, choices=["int8", "w8a8_int8", "none"],
                    help="the draft's weights in int8 (weight-only), w8a8_int8 or its own (default: the engine's "
                         "choice, w8a8_int8 with the compiled kernels); its c is measured with the same scheme")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TAILSERVE_BENCHMARK", "1")
    from tailserve import LLM
    from tailserve.platform_info import cpu_flags

    flags = cpu_flags()
    isa = ("AVX-512" + (" with bf16" if "avx512_bf16" in flags else "")) if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    tmp = tempfile.mkdtemp()
    target = make(os.path.join(tmp, "target"), 8, 0)
    draft = make(os.path.join(tmp, "draft"), 2, 1)
    kv = dict(kv_cache_memory_bytes=512 << 20, max_num_seqs=16)
    # The draft's weights as the speculative engines will hold them (the plan's choice unless
    # --draft-quantization says), so that c is measured on the same weights.
    probe = LLM(target, speculative_model=draft, num_speculative_tokens=2,
                speculative_draft_quantization=args.draft_quantization, **kv)
    method = probe.engine.health()["plan"]["draft"]["linear"].split(" ", 1)[0]
    draft_quant = {"int8-w8a8": "w8a8_int8", "int8-weight-only": "int8"}.get(method)
    probe.shutdown()
    print(f"CPU: {isa}, {torch.get_num_threads()} threads; 55M target, 2-layer draft"
          f" ({draft_quant or 'bf16 weights'})" + ", greedy, 128 tokens; "
          f"{args.runs} interleaved pairs a cell")
    base_llm, draft_llm = LLM(target, **kv), LLM(draft, quantization=draft_quant, **kv)
    out = {"cpu": isa, "runs": args.runs, "draft_quantization": draft_quant or "none", "cells": []}
    for b in args.batches:
        warm(base_llm, b)
        warm(draft_llm, b)
        pairs = [(run_once(base_llm, b), run_once(draft_llm, b)) for _ in range(args.runs)]
        c = statistics.median(base["tok_s"] / d["tok_s"] for base, d in pairs)  # draft step / target step
        print(f"\nbatch {b}: target {med([p[0] for p in pairs], 'tok_s'):.1f} tok/s, draft alone "
              f"{med([p[1] for p in pairs], 'tok_s'):.1f} tok/s, c = {c:.3f}")
        print("  The speculative step in off steps: the formula's 1 + k c, measured, and the measured\n"
              "  excess split into the wider forward (verify - off forward), the drafts (proposal - k c\n"
              "  off steps) and the rest (bookkeeping, output processing: spec - off); e+verify: the\n"
              "  formula with the verification's measured cost in place of one target step.")
        print(f"  {'a':>4} {'k':>3} {'measured':>9} {'expected':>9} {'m/e':>5} | {'tok/step':>8} {'E[T]':>5} | "
              f"{'1+kc':>5} {'step':>5} = {'verify':>6} {'drafts':>6} {'rest':>6} | {'e+verify':>8} {'m/e':>4}")
        for a in args.acceptances:
            for k in args.ks:
                llm = LLM(target, speculative_model=draft, num_speculative_tokens=k,
                          speculative_synthetic_acceptance=a,
                          speculative_draft_quantization=args.draft_quantization, **kv)
                warm(llm, b)
                cell = []
                for i in range(args.runs):  # each pair in turn off-first and speculative-first
                    if i % 2 == 0:
                        off = run_once(base_llm, b)
                        spec = run_once(llm, b)
                    else:
                        spec = run_once(llm, b)
                        off = run_once(base_llm, b)
                    cell.append({"off": off, "spec": spec, "ratio": spec["tok_s"] / off["tok_s"],
                                 "step_ratio": spec["step_s"] / off["step_s"],
                                 "verify": (spec["forward_s"] - off["forward_s"]) / off["step_s"],
                                 "drafts": (spec["propose_s"] - k * c * off["step_s"]) / off["step_s"],
                                 "rest": ((spec["step_s"] - spec["forward_s"] - spec["propose_s"])
                                          - (off["step_s"] - off["forward_s"])) / off["step_s"],
                                 "tokens_per_step": spec["tokens_per_step"]})
                m, e = med(cell, "ratio"), expected(a, k, c)
                tokens = (1 - a ** (k + 1)) / (1 - a)
                row = {"batch": b, "a": a, "k": k, "c": c, "measured": m, "expected": e,
                       "tokens_per_step": med(cell, "tokens_per_step"), "expected_tokens": tokens,
                       "step_ratio": med(cell, "step_ratio"), "verify": med(cell, "verify"),
                       "drafts": med(cell, "drafts"), "rest": med(cell, "rest"), "runs": cell}
                # The formula with the verification's measured cost in place of one target step.
                row["expected_with_verify"] = tokens / (1 + k * c + row["verify"])
                out["cells"].append(row)
                print(f"  {a:>4} {k:>3} {m:>8.2f}x {e:>8.2f}x {m / e:>5.0%} | {row['tokens_per_step']:>8.2f} "
                      f"{tokens:>5.2f} | {1 + k * c:>5.2f} {row['step_ratio']:>5.2f} = 1+kc "
                      f"{row['verify']:>+6.2f} {row['drafts']:>+6.2f} {row['rest']:>+6.2f} | "
                      f"{row['expected_with_verify']:>7.2f}x {m / row['expected_with_verify']:>4.0%}", flush=True)
                llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
