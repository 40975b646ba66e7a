"""Speculative decoding's speed-up against its analytical limit, with synthetic acceptance.

For acceptance rate a (each draft accepted with probability a, independently), draft length
k and cost ratio c (a draft step over a target step), the expected speed-up is
(1 - a^(k+1)) / ((1 - a)(k c + 1)) (Leviathan et al. 2023). Synthetic acceptance
(``speculative_synthetic_acceptance``, LOSSY, benchmarks only) fixes a for any pair, so the
system's own overhead shows as the gap between measured and expected.

Pair: the 55M Llama of shared/PEERS.md (hidden 512, 8 layers, vocabulary 32000) and a 2-layer
draft of the same width, random weights stored in bf16 (made on the fly). c is measured per
batch size as the draft's plain decode step over the target's. Greedy, 128 new tokens per
request, batch 1 and 16; the baseline is the target without speculation, measured in the
same run. Medians over --runs runs.

    TAILSERVE_BENCHMARK=1 python benchmarks/bench_spec_limit.py [--runs 2]
"""

from __future__ import annotations

import argparse
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


def tok_s(llm, batch: int, new_tokens: int = 128) -> float:
    from tailserve import SamplingParams

    prompts = [[(7 * i + j) % 31000 + 100 for j in range(32)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm the shapes
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def expected(a: float, k: int, c: float) -> float:
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    os.environ.setdefault("TAILSERVE_BENCHMARK", "1")
    from tailserve import LLM
    from tailserve.platform_info import cpu_flags

    flags = cpu_flags()
    isa = ("AVX-512" + (" with bf16" if "avx512_bf16" in flags else "")) if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    print(f"CPU: {isa}, {torch.get_num_threads()} threads; 55M target, 2-layer draft, greedy, 128 tokens")
    tmp = tempfile.mkdtemp()
    target = make(os.path.join(tmp, "target"), 8, 0)
    draft = make(os.path.join(tmp, "draft"), 2, 1)
    kv = dict(kv_cache_memory_bytes=512 << 20, max_num_seqs=16)
    base_llm, draft_llm = LLM(target, **kv), LLM(draft, **kv)
    for b in args.batches:
        base = statistics.median(tok_s(base_llm, b) for _ in range(args.runs))
        draft_speed = statistics.median(tok_s(draft_llm, b) for _ in range(args.runs))
        c = base / draft_speed  # a draft step over a target step, at this batch size
        print(f"\nbatch {b}: target {base:.1f} tok/s, draft alone {draft_speed:.1f} tok/s, c = {c:.3f}")
        print(f"  {'a':>4} {'k':>3} {'measured':>9} {'expected':>9} {'measured/expected':>18}")
        for a in (0.5, 0.7, 0.9):
            for k in (2, 4, 8):
                llm = LLM(target, speculative_model=draft, num_speculative_tokens=k,
                          speculative_synthetic_acceptance=a, **kv)
                m = statistics.median(tok_s(llm, b) for _ in range(args.runs)) / base
                e = expected(a, k, c)
                print(f"  {a:>4} {k:>3} {m:>8.2f}x {e:>8.2f}x {m / e:>17.0%}")
                del llm


if __name__ == "__main__":
    main()
