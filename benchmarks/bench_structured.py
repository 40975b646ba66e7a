"""The cost of constrained decoding: the grammar mask per step, and a constrained request's
tokens/s against an unconstrained one on the same engine, in one run.

(1) Mask cost per step, for batch 1 and 16 and two vocabularies (the built-in model's 4,096
    tokens; a 151,936-token byte-level vocabulary like Qwen2.5's, built from the standard
    library's source since no hub is reachable): llguidance filling the bitmask (the JSON
    schema below, each matcher part-way through an object) and the bitmask applied to the
    logits (the compiled CPU kernel, and the vectorised PyTorch path), each matcher in a new
    state at every step as in a real generation.
(2) Decode tokens/s, the built-in model, batch 1 and 16, 128 new tokens per request
    (temperature 1, seeded): no constraint, the JSON schema (an array of short strings long
    enough to last 128 tokens), with the masks computed beside the forward (the default) and
    computed before it.

Medians over --runs runs, the constrained figures as ratios to the unconstrained one
measured in the same run. Run it alone: a busy core distorts it.

    python benchmarks/bench_structured.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import torch

SCHEMA = {"type": "object", "required": ["items"], "additionalProperties": False,
          "properties": {"items": {"type": "array", "minItems": 64, "maxItems": 64,
                                   "items": {"type": "string", "maxLength": 6}}}}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (what the tokenizers library's ByteLevel uses)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def big_vocab_tokenizer(n: int = 151_936) -> str:
    """tokenizer.json with n byte-level tokens: the 256 bytes, then the most frequent words
    and identifier pieces of the standard library (with and without a leading space)."""
    import collections
    import re
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_map = _bytes_to_unicode()
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:3000]:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        counts.update(re.findall(r" ?[A-Za-z_]{2,16}| ?[0-9]{1,4}| ?[^\sA-Za-z0-9]{2,3}", text))
    vocab = {byte_map[b]: b for b in range(256)}
    for word, _ in counts.most_common():
        if len(vocab) >= n:
            break
        vocab.setdefault("".join(byte_map[b] for b in word.encode()), len(vocab))
    i = 0
    while len(vocab) < n:  # pad with made-up pieces if the corpus runs out
        vocab.setdefault(f"\u0120q{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def mask_costs(tokenizer_json: str, vocab: int, batch: int, steps: int) -> dict[str, float]:
    """Per step, over a walk of ``steps`` steps: each matcher's state is new at every step
    (a random allowed token consumed between fills, not timed), as in a real generation;
    a matcher that completes the schema starts again."""
    from tailserve.kernels.cpu import kernels
    from tailserve.sample.bitmask import apply_token_bitmask
    from tailserve.sampling_params import StructuredOutputsParams
    from tailserve.structured.grammar import BitmaskBuilder, GrammarCompiler

    compiler = GrammarCompiler(lambda: tokenizer_json, vocab, [0])
    g = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    rng = np.random.default_rng(0)
    matchers = [g.start() for _ in range(batch)]
    builder = BitmaskBuilder(vocab)
    logits = torch.randn(batch, vocab)
    k = kernels()
    fill = apply_k = apply_t = 0.0
    for _ in range(steps):
        entries = [(m, []) for m in matchers]
        t0 = time.perf_counter()
        bm = builder.build(entries)
        t1 = time.perf_counter()
        if k is not None:
            apply_token_bitmask(logits, list(range(batch)), bm, k)
        t2 = time.perf_counter()
        apply_token_bitmask(logits, list(range(batch)), bm, None)
        t3 = time.perf_counter()
        fill, apply_k, apply_t = fill + t1 - t0, apply_k + t2 - t1, apply_t + t3 - t2
        for i, m in enumerate(matchers):
            allowed = np.nonzero(np.unpackbits(bm[i].view(np.uint8), bitorder="little")[:vocab])[0]
            m.consume_token(int(rng.choice(allowed)))
            if m.is_stopped():
                matchers[i] = g.start()
    out = {"fill_us": fill / steps * 1e6, "apply_torch_us": apply_t / steps * 1e6}
    if k is not None:
        out["apply_kernel_us"] = apply_k / steps * 1e6
    return out


def decode_tok_s(llm, batch: int, constrained: bool, overlap: bool) -> float:
    from tailserve.sampling_params import SamplingParams, StructuredOutputsParams

    llm.engine.core.grammar_overlap_min_rows = 1 if overlap else 1 << 30
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(max_tokens=128, temperature=1.0, seed=1, ignore_eos=True, structured_outputs=so)
    prompts = [f"def f{i}(x):\n    return" for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from tailserve import LLM
    from tailserve.platform_info import cpu_flags

    flags = cpu_flags()
    isa = "AVX-512" + (" with bf16" if "avx512_bf16" in flags else "") if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    print(f"CPU: {isa}, {torch.get_num_threads()} threads")
    builtin_dir = pathlib.Path(__file__).resolve().parents[1] / "src/tailserve/assets/default-target"
    vocabs = {"built-in (4,096)": ((builtin_dir / "tokenizer.json").read_text(), 4096),
              "Qwen-size (151,936)": (big_vocab_tokenizer(), 151_936)}
    print("\n(1) mask cost per step, microseconds (median of runs)")
    print(f"{'vocabulary':22} {'batch':>5} {'fill':>9} {'apply (kernel)':>15} {'apply (torch)':>14}")
    for name, (tj, v) in vocabs.items():
        for b in (1, 16):
            runs = [mask_costs(tj, v, b, steps=100 if v < 10_000 else 40) for _ in range(args.runs)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"{name:22} {b:>5} {med['fill_us']:>9.0f} {med.get('apply_kernel_us', float('nan')):>15.0f} "
                  f"{med['apply_torch_us']:>14.0f}")
    llm = LLM()
    print("\n(2) decode tok/s, built-in model, 128 new tokens (median of runs; ratio to unconstrained)")
    for b in (1, 16):
        decode_tok_s(llm, b, True, True)  # warm: grammar compiled and cached, shapes seen
        rows: dict[str, list[float]] = {"unconstrained": [], "json, masks beside the forward": [],
                                        "json, masks before the forward": []}
        for _ in range(args.runs):  # interleaved, so drift hits all three alike
            rows["unconstrained"].append(decode_tok_s(llm, b, False, True))
            rows["json, masks beside the forward"].append(decode_tok_s(llm, b, True, True))
            rows["json, masks before the forward"].append(decode_tok_s(llm, b, True, False))
        base = statistics.median(rows["unconstrained"])
        for name, vals in rows.items():
            m = statistics.median(vals)
            print(f"  batch {b:>2} {name:34} {m:8.1f} tok/s  {m / base:5.2f}x")
    print(json.dumps({"schema": SCHEMA}))


if __name__ == "__main__":
    main()
