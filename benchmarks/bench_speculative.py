"""Speculative decoding on the built-in model pair: speed-ups measured in one run.

Prompts: function headers (+ docstring line) from held-out standard-library files. Batch 1,
--new-tokens new tokens (greedy, length forced). decode tok/s = (N - 1) / (t(N) - t(1)),
median over prompts and runs. Rows: speculation off; draft model with k = 2..6 and
adaptive (and adaptive with the draft's steps kept in PyTorch, where the default runs a
single sequence's steps in NumPy); n-gram lookup; hybrid (lookup, else the draft);
transformers' plain generate and its assisted generation with the same pair (its own
speed-up, same run). Also: the cost ratio of the draft to the target (each alone, and
inside the engine), and batch-16 throughput with adaptive speculation vs off.

    python benchmarks/bench_speculative.py [--runs 2] [--prompts 8] [--new-tokens 256] [--skip-hf]
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


def _time(run, p, n) -> float:
    t = time.perf_counter()
    run(p, n)
    return time.perf_counter() - t


def interleaved_decode_tps(runners: dict, prompts: list, new: int, runs: int) -> dict[str, float]:
    """decode tok/s per runner; runners take turns within every round so that drift on a
    shared machine hits them all alike. Median over prompts x rounds."""
    for run in runners.values():
        run(prompts[0], 8)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(runs):
        for p in prompts:
            for name, run in runners.items():
                t1 = _time(run, p, 1)
                tn = _time(run, p, new)
                rates[name].append((new - 1) / (tn - t1))
    return {name: statistics.median(r) for name, r in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--draft", default=None, help="draft checkpoint folder (default: the built-in draft)")
    ap.add_argument("--draft-dtype", default="auto", help="tailserve's draft dtype (auto: the target's)")
    ap.add_argument("--rows", default=None, help="only rows whose name contains this (plus 'off')")
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = held_out_prompts(args.prompts)
    new = args.new_tokens
    common = dict(dtype=args.dtype, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    draft_dir = args.draft or str(DEFAULT_DRAFT_DIR)
    d = {"speculative_model": draft_dir, "speculative_draft_dtype": args.draft_dtype}
    configs = {"tailserve off": {}}
    for k in range(2, 7):
        configs[f"tailserve draft k={k}"] = {**d, "num_speculative_tokens": k}
    configs["tailserve draft adaptive"] = dict(d)
    if args.draft_dtype in ("auto", "float32"):
        # The same with every draft step in PyTorch (on the CPU the default runs a single
        # sequence's steps in NumPy): what that step is worth, same run.
        configs["tailserve draft adaptive, PyTorch steps"] = {**d, "speculative_draft_numpy": False}
    configs["tailserve ngram k=4"] = {"speculative_method": "ngram", "num_speculative_tokens": 4}
    configs["tailserve hybrid k=4"] = {**d, "speculative_method": "hybrid", "num_speculative_tokens": 4,
                                      "ngram_min": 2}
    configs["tailserve hybrid adaptive"] = {**d, "speculative_method": "hybrid", "ngram_min": 2}
    if args.rows:
        configs = {n: c for n, c in configs.items() if n == "tailserve off" or args.rows in n
                   or (n == "tailserve draft adaptive")}
    engines = {name: LLM(**common, **spec) for name, spec in configs.items()}
    draft_dtype = args.draft_dtype if args.draft_dtype != "auto" else args.dtype
    engines["draft model alone"] = LLM(draft_dir, **{**common, "dtype": draft_dtype})

    def engine_runner(llm):
        return lambda p, n: llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    runners = {name: engine_runner(llm) for name, llm in engines.items()}
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

        runners["transformers plain"] = hf(None)
        runners["transformers assisted"] = hf(draft)
    tps = interleaved_decode_tps(runners, prompts, new, args.runs)
    results: dict[str, dict[str, float]] = {}
    for name, rate in tps.items():
        results[name] = {"decode_tok_s": rate}
        line = f"{name:<28}{rate:>10.1f} tok/s"
        if name in engines and engines[name].engine.spec_stats.num_drafts:
            s = engines[name].engine.spec_stats
            results[name].update(mean_acceptance_length=s.mean_acceptance_length, acceptance_rate=s.acceptance_rate)
            line += f"   acceptance length {s.mean_acceptance_length:5.2f}, rate {s.acceptance_rate:.2f}"
        print(line, flush=True)
    print(f"cost ratio draft/target (time per token, each alone, PyTorch): "
          f"{tps['tailserve off'] / tps['draft model alone']:.3f}")
    ctl = engines["tailserve draft adaptive"].engine.spec_controller
    inside = ctl.draft_cost.predict(1) / ctl.target_cost.predict(1)
    results["cost ratio in engine"] = {"draft_step_over_target_step": inside}
    print(f"cost ratio draft step/target step inside the engine (the adaptive controller's fits, "
          f"batch 1): {inside:.3f}")

    # Batch 16: adaptive speculation must not lose throughput. Alternating runs, medians.
    batch_prompts = held_out_prompts(16)
    p16 = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    b16 = {"batch16 off": engines["tailserve off"], "batch16 draft adaptive": engines["tailserve draft adaptive"]}
    for name in ("tailserve draft k=3", "tailserve hybrid adaptive"):
        if name in engines:
            b16["batch16 " + name.split(" ", 1)[1]] = engines[name]
    times: dict[str, list[float]] = {name: [] for name in b16}
    for llm in b16.values():
        llm.generate(batch_prompts, p16)
    for _ in range(max(3, args.runs)):
        for name, llm in b16.items():
            t0 = time.perf_counter()
            llm.generate(batch_prompts, p16)
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        results[name] = {"tok_s": 16 * 128 / statistics.median(ts)}
        print(f"{name:<28}{results[name]['tok_s']:>10.1f} tok/s (end to end)", flush=True)

    off = results["tailserve off"]["decode_tok_s"]
    print("\nspeed-ups over tailserve off:")
    for name, r in results.items():
        if "decode_tok_s" in r and name.startswith("tailserve"):
            print(f"  {name:<28}{r['decode_tok_s'] / off:6.2f}x")
    for name, llm in engines.items():
        prop = llm.engine.proposer
        if hasattr(prop, "num_lookup_drafts"):
            total = max(1, prop.num_lookup_drafts + prop.num_model_drafts)
            print(f"  {name}: {prop.num_lookup_drafts / total:.0%} of rounds drafted by n-gram lookup")
    if "transformers plain" in results:
        hf_off = results["transformers plain"]["decode_tok_s"]
        print(f"  transformers assisted vs its plain: {results['transformers assisted']['decode_tok_s'] / hf_off:.2f}x")
    for name in [n for n in b16 if n != "batch16 off"]:
        print(f"  {name} vs off: {results[name]['tok_s'] / results['batch16 off']['tok_s']:.2f}x")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
