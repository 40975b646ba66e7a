"""Speculative decoding on the built-in model pair: speed-ups measured in one run.

Prompts: function headers (+ docstring line) from held-out standard-library files. Batch 1,
--new-tokens new tokens (greedy, length forced). decode tok/s = (N - 1) / (t(N) - t(1)),
median over prompts and runs. Rows: speculation off; draft model with k = 2..6 and
adaptive; n-gram lookup; transformers' plain generate and its assisted generation with
the same pair (its own speed-up, same run). Also: the measured cost ratio of one draft
forward to one target forward, and batch-16 throughput with adaptive speculation vs off.

    python benchmarks/bench_speculative.py [--runs 3] [--prompts 4] [--new-tokens 256] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sysconfig
import time

import torch

from tailserve import LLM, SamplingParams
from tailserve.assets import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR


def held_out_prompts(n: int) -> list[str]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in (DEFAULT_TARGET_DIR / "held_out_files.txt").read_text().split():
        path = root / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"^def [a-z_][a-z0-9_]*\([^)\n]*\):\n(    \"\"\"[^\n]*\n)?", text, re.M):
            out.append(m.group(0))
    step = max(1, len(out) // n)
    return out[::step][:n]


def decode_tps(run, prompts: list, new: int, runs: int) -> float:
    rates = []
    for p in prompts:
        run(p, 1)  # warm-up, also fills nothing: prefix caching is off in these engines
        t1 = statistics.median(_time(run, p, 1) for _ in range(runs))
        tn = statistics.median(_time(run, p, new) for _ in range(runs))
        rates.append((new - 1) / (tn - t1))
    return statistics.median(rates)


def _time(run, p, n) -> float:
    t = time.perf_counter()
    run(p, n)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = held_out_prompts(args.prompts)
    new = args.new_tokens
    common = dict(dtype=args.dtype, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    results: dict[str, dict[str, float]] = {}

    def engine_row(name: str, **spec) -> None:
        llm = LLM(**common, **spec)

        def run(p, n):
            llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

        tps = decode_tps(run, prompts, new, args.runs)
        s = llm.engine.spec_stats
        results[name] = {"decode_tok_s": tps, "mean_acceptance_length": s.mean_acceptance_length,
                         "acceptance_rate": s.acceptance_rate}
        print(f"{name:<28}{tps:>10.1f} tok/s   acceptance length {s.mean_acceptance_length:5.2f}", flush=True)

    engine_row("tailserve off")
    draft_alone = LLM(str(DEFAULT_DRAFT_DIR), **common)
    draft_tps = decode_tps(lambda p, n: draft_alone.generate([p], SamplingParams(temperature=0, max_tokens=n,
                                                                                 ignore_eos=True)),
                           prompts, new, args.runs)
    results["draft model alone"] = {"decode_tok_s": draft_tps}
    print(f"{'draft model alone':<28}{draft_tps:>10.1f} tok/s   cost ratio draft/target "
          f"{results['tailserve off']['decode_tok_s'] / draft_tps:.3f}", flush=True)
    for k in range(2, 7):
        engine_row(f"tailserve draft k={k}", speculative_model="builtin", num_speculative_tokens=k)
    engine_row("tailserve draft adaptive", speculative_model="builtin")
    engine_row("tailserve ngram k=4", speculative_method="ngram", num_speculative_tokens=4)

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = getattr(torch, args.dtype)
        tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET_DIR)
        target = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET_DIR, dtype=dtype).eval()
        draft = AutoModelForCausalLM.from_pretrained(DEFAULT_DRAFT_DIR, dtype=dtype).eval()

        def hf(assistant):
            def run(p, n):
                ids = tok(p, return_tensors="pt")
                with torch.inference_mode():
                    target.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                    assistant_model=assistant, pad_token_id=tok.pad_token_id)
            return run

        for name, assistant in (("transformers plain", None), ("transformers assisted", draft)):
            tps = decode_tps(hf(assistant), prompts, new, args.runs)
            results[name] = {"decode_tok_s": tps}
            print(f"{name:<28}{tps:>10.1f} tok/s", flush=True)

    # Batch 16: adaptive speculation must not lose throughput.
    batch_prompts = held_out_prompts(16)
    for name, spec in (("batch16 off", {}), ("batch16 adaptive", {"speculative_model": "builtin"})):
        llm = LLM(**common, **spec)
        p16 = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        llm.generate(batch_prompts, p16)
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            llm.generate(batch_prompts, p16)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        results[name] = {"tok_s": 16 * 128 / t}
        print(f"{name:<28}{16 * 128 / t:>10.1f} tok/s (end to end)", flush=True)

    off = results["tailserve off"]["decode_tok_s"]
    print("\nspeed-ups over tailserve off:")
    for name, r in results.items():
        if "decode_tok_s" in r and name.startswith("tailserve"):
            print(f"  {name:<28}{r['decode_tok_s'] / off:6.2f}x")
    if "transformers plain" in results:
        hf_off = results["transformers plain"]["decode_tok_s"]
        print(f"  transformers assisted vs its plain: {results['transformers assisted']['decode_tok_s'] / hf_off:.2f}x")
    print(f"  batch 16 adaptive vs off: {results['batch16 adaptive']['tok_s'] / results['batch16 off']['tok_s']:.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
