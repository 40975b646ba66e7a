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

``--matrix``: "never slower" instead. Adaptive speculation (the built-in draft) against
speculation off at batch 1, 4 and 16, temperature 0 and 0.8, unseeded and seeded: a short
run (fresh engines, the controller cold: 6 requests at batch 1, 2 x batch otherwise, 128
tokens each) and a long one (engines kept across every cell and round, the controller
warm), ``--runs`` rounds (default 3), each round's runs ordered off, adaptive, adaptive, off
(or the reverse) so that drift hits both alike; a cell's figure is the median over rounds of
summed off time / summed adaptive time. ``--verification block`` measures block verification instead.
``--control``: a second engine with speculation off takes its turns beside adaptive in every
run (off, adaptive, control, control, adaptive, off), and each cell also reports off / control:
what two identical engines read here, the matrix's own noise floor in the same run.

    python benchmarks/bench_speculative.py --matrix [--runs 3] [--control] [--json out.json]

``--matrix --pairs N``: the same cells, measured finely paired instead (the rounds above cannot
tell 0.98 from 1.0 on a shared 2-core machine: two identical engines read 0.91-1.08x there).
Per cell and run kind, N pairs of one batch each (off then adaptive, the order flipped every
pair: off, adaptive, adaptive, off, ...), each pair a fresh pair of engines for the short run
and the same warm engines for the long one; the cell's figure is summed off time / summed
adaptive time over the pairs (the tok/s ratio of the whole interleaved run) with a 90%
bootstrap interval over the pairs, and its verdict: "met" when the interval lies at or above
0.98, "slower" when it lies below, "undecided" when it straddles 0.98 (more pairs narrow it).
With ``--control`` a third engine with speculation off takes its turn in every pair (off,
adaptive, control, then the reverse) and each cell also reports off / control with its
interval: what two identical engines read in the same run.

    python benchmarks/bench_speculative.py --matrix --pairs 12 [--control] [--run-kinds short,long]
        [--batch-sizes 1,4,16] [--json out.json]

``--pairs`` also takes a count per batch size, ``--pairs 1:100,4:40,16:40``: a batch-1 pair is
one request (~0.1 s of decoding here), a batch-16 pair sixteen, so at one count for all a batch-1
cell measures 4-5 s per engine against 60-90 s at batch 16, and its interval is the widest.
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


def _matrix_params(temperature: float, seeded: bool, n: int, tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True,
                           seed=1000 + i if seeded else None) for i in range(n)]


def _matrix_setup(args: argparse.Namespace):
    """What both matrices share: the CPU, prompts, an engine factory (batch, "off" or
    "adaptive"/"control"), the batches and the cells."""
    from tailserve.engine.plan import detect_capabilities

    caps = detect_capabilities(torch.device("cpu"))
    print(f"CPU: {caps.cpu_capability}; {torch.get_num_threads()} threads; dtype {args.dtype or 'auto'}"
          + (f"; draft weights {args.draft_quantization}" if args.draft_quantization
             else "; draft weights as the plan chooses (w8a8_int8 with the compiled kernels)")
          + (f"; {args.pairs} pairs a cell" if args.pairs else ""), flush=True)
    common = dict(dtype=args.dtype or "auto", kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    spec = {"speculative_model": args.draft or str(DEFAULT_DRAFT_DIR),
            "speculative_verification": args.verification,
            "speculative_draft_quantization": args.draft_quantization}
    batches, temps = (1, 4, 16), (0.0, 0.8)
    cells = [(b, t, s) for b in batches for t in temps for s in ((False, True) if t > 0 else (False,))]

    def engine(b: int, name: str) -> LLM:
        return LLM(**common, max_num_seqs=b, **(spec if name == "adaptive" else {}))

    return caps, held_out_prompts(32), engine, batches, cells


def never_slower_matrix(args: argparse.Namespace) -> dict:
    """Adaptive vs off per (batch, temperature, seeded) cell, short (cold) and long (warm)."""
    caps, prompts, engine, batches, cells = _matrix_setup(args)
    names = ("off", "adaptive", "control") if args.control else ("off", "adaptive")
    warm = {(b, name): engine(b, name) for b in batches for name in names}
    for llm in warm.values():
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    tokens = 128
    rates: dict[tuple, list[float]] = {}
    ratios: dict[tuple, list[float]] = {}
    accept: dict[tuple, list[float]] = {}
    for r in range(args.runs):
        for b, t, seeded in cells:
            n = 6 if b == 1 else 2 * b
            params = _matrix_params(t, seeded, n, tokens)
            for run in ("short", "long"):
                # off, adaptive, adaptive, off (or the reverse; with the control: off, adaptive,
                # control, control, adaptive, off): a drift that is linear over the runs hits
                # every engine alike; the round's ratio is of summed times.
                order = names + names[::-1] if (r + b) % 2 == 0 else names[::-1] + names
                seconds = dict.fromkeys(names, 0.0)
                for name in order:
                    llm = warm[(b, name)] if run == "long" else engine(b, name)
                    before = llm.stats()["speculative"]
                    t0 = time.perf_counter()
                    llm.generate(prompts[:n], params)
                    dt = time.perf_counter() - t0
                    seconds[name] += dt
                    rates.setdefault((b, t, seeded, run, name), []).append(n * tokens / dt)
                    after = llm.stats()["speculative"]
                    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
                    if name == "adaptive":
                        accept.setdefault((b, t, seeded, run), []).append(
                            (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / drafted
                            if drafted else float("nan"))
                    if run == "short":
                        llm.shutdown()
                ratios.setdefault((b, t, seeded, run), []).append(seconds["off"] / seconds["adaptive"])
                if args.control:
                    ratios.setdefault((b, t, seeded, run, "control"), []).append(seconds["off"] / seconds["control"])
            last = {run: ratios[(b, t, seeded, run)][-1] for run in ("short", "long")}
            print(f"round {r + 1}: batch {b:>2} t={t} {'seeded' if seeded else 'unseeded':<8} "
                  + "  ".join(f"{run} {ratio:.2f}x" for run, ratio in last.items()), flush=True)
    out = {"cpu": caps.cpu_capability, "dtype": args.dtype or "auto", "verification": args.verification,
           "control": args.control, "cells": []}
    order = "off, adaptive, control, control, adaptive, off" if args.control else "off, adaptive, adaptive, off"
    print(f"\nadaptive / off, median of {args.runs} rounds' ratios (each round: {order}; "
          f"end-to-end tok/s; {caps.cpu_capability}):")
    print(f"{'batch':>5} {'temp':>5} {'seed':>8} | {'short':>6} {'long':>6} | off tok/s short/long "
          "| drafted share accepted")
    worst = float("inf")
    for b, t, seeded in cells:
        row = {"batch": b, "temperature": t, "seeded": seeded}
        for run in ("short", "long"):
            off = statistics.median(rates[(b, t, seeded, run, "off")])
            ad = statistics.median(rates[(b, t, seeded, run, "adaptive")])
            ratio = statistics.median(ratios[(b, t, seeded, run)])
            row[run] = {"off_tok_s": off, "adaptive_tok_s": ad, "ratio": ratio,
                        "round_ratios": ratios[(b, t, seeded, run)],
                        "acceptance_rate": statistics.median([a for a in accept[(b, t, seeded, run)] if a == a]
                                                             or [float("nan")])}
            if args.control:
                row[run]["control_ratio"] = statistics.median(ratios[(b, t, seeded, run, "control")])
                row[run]["control_round_ratios"] = ratios[(b, t, seeded, run, "control")]
            worst = min(worst, ratio)
        print(f"{b:>5} {t:>5} {'yes' if seeded else 'no':>8} | {row['short']['ratio']:>5.2f}x "
              f"{row['long']['ratio']:>5.2f}x | {row['short']['off_tok_s']:>7.0f} / {row['long']['off_tok_s']:<7.0f}"
              f" | {row['short']['acceptance_rate']:.2f} / {row['long']['acceptance_rate']:.2f}"
              + (f" | off/control {row['short']['control_ratio']:.2f}x {row['long']['control_ratio']:.2f}x"
                 if args.control else ""))
        out["cells"].append(row)
    out["worst_ratio"] = worst
    print(f"worst cell: {worst:.2f}x (goal >= 0.98x)")
    if args.control:
        spread = [row[run]["control_ratio"] for row in out["cells"] for run in ("short", "long")]
        out["control_range"] = [min(spread), max(spread)]
        print(f"off / control (two engines with speculation off): {min(spread):.2f}-{max(spread):.2f}x "
              "over the cells: what this run cannot tell from 1.0")
    return out


def bootstrap_ratio(off: list[float], adaptive: list[float], draws: int = 2000, seed: int = 0
                    ) -> tuple[float, float, float]:
    """sum(off) / sum(adaptive) over paired runs, with its 90% bootstrap interval (pairs resampled)."""
    import random

    rng = random.Random(seed)
    n = len(off)
    point = sum(off) / sum(adaptive)
    stats = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        stats.append(sum(off[i] for i in idx) / sum(adaptive[i] for i in idx))
    stats.sort()
    return point, stats[int(0.05 * draws)], stats[int(0.95 * draws) - 1]


def parse_pairs(text: str) -> dict[int, int] | int:
    """``--pairs``: one count for every batch size (``40``), or per batch size
    (``1:100,4:40,16:40``; a batch size not named is not measured)."""
    try:
        if ":" not in text:
            return int(text)
        counts = {}
        for part in text.split(","):
            b, n = part.split(":")
            counts[int(b)] = int(n)
        return counts
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pairs: a count or batch:count pairs (1:100,4:40), got {text!r}") from None


def verdict(lo: float, hi: float, goal: float = 0.98) -> str:
    return "met" if lo >= goal else "slower" if hi < goal else "undecided"


def paired_matrix(args: argparse.Namespace) -> dict:
    """Adaptive vs off per cell, --pairs finely interleaved pairs of one batch each (see the docstring)."""
    caps, prompts, engine, batches, cells = _matrix_setup(args)
    kinds = [k for k in ("short", "long") if k in args.run_kinds.split(",")]
    if not kinds:
        raise SystemExit("--run-kinds: short, long or both")
    names = ("off", "adaptive", "control") if args.control else ("off", "adaptive")
    per_batch = args.pairs if isinstance(args.pairs, dict) else None
    keep = set(per_batch) if per_batch else None
    if args.batch_sizes:
        named = {int(x) for x in args.batch_sizes.split(",")}
        keep = named if keep is None else keep & named
    if keep is not None:
        batches, cells = tuple(b for b in batches if b in keep), [c for c in cells if c[0] in keep]
    warm = {(b, name): engine(b, name) for b in batches for name in names} if "long" in kinds else {}
    for llm in warm.values():
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    tokens = 128
    out = {"cpu": caps.cpu_capability, "dtype": args.dtype or "auto", "verification": args.verification,
           "pairs": args.pairs, "control": args.control, "cells": []}
    print(f"{'batch':>5} {'temp':>5} {'seed':>5} {'run':>6} | adaptive/off [90% interval] verdict | "
          "off tok/s | drafts a token" + (" | off/control [90%]" if args.control else ""), flush=True)
    for b, t, seeded in cells:
        row = {"batch": b, "temperature": t, "seeded": seeded}
        for run in kinds:
            secs: dict[str, list[float]] = {name: [] for name in names}
            drafted = produced = 0
            for i in range(per_batch[b] if per_batch else args.pairs):
                # A different batch of prompts (and seeds) per pair, the same for every engine.
                chunk = [prompts[(i * b + j) % len(prompts)] for j in range(b)]
                params = [SamplingParams(temperature=t, max_tokens=tokens, ignore_eos=True,
                                         seed=1000 + i * b + j if seeded else None) for j in range(b)]
                for name in (names if i % 2 == 0 else names[::-1]):
                    llm = warm[(b, name)] if run == "long" else engine(b, name)
                    before = llm.stats()["speculative"]["num_draft_tokens"]
                    t0 = time.perf_counter()
                    llm.generate(chunk, params)
                    secs[name].append(time.perf_counter() - t0)
                    if name == "adaptive":
                        drafted += llm.stats()["speculative"]["num_draft_tokens"] - before
                        produced += b * tokens
                    if run == "short":
                        llm.shutdown()
            point, lo, hi = bootstrap_ratio(secs["off"], secs["adaptive"])
            off_tps = b * tokens * len(secs["off"]) / sum(secs["off"])
            row[run] = {"ratio": point, "interval": [lo, hi], "verdict": verdict(lo, hi), "off_tok_s": off_tps,
                        "drafts_per_token": drafted / produced, "off_s": secs["off"], "adaptive_s": secs["adaptive"]}
            control = ""
            if args.control:
                c_point, c_lo, c_hi = bootstrap_ratio(secs["off"], secs["control"])
                row[run].update(control_ratio=c_point, control_interval=[c_lo, c_hi], control_s=secs["control"])
                control = f" | {c_point:.3f}x [{c_lo:.3f}, {c_hi:.3f}]"
            print(f"{b:>5} {t:>5} {'yes' if seeded else 'no':>5} {run:>6} | {point:.3f}x [{lo:.3f}, {hi:.3f}] "
                  f"{verdict(lo, hi):<9} | {off_tps:7.0f} | {drafted / produced:.2f}{control}", flush=True)
        out["cells"].append(row)
    verdicts = [row[run]["verdict"] for row in out["cells"] for run in kinds]
    out["summary"] = {v: verdicts.count(v) for v in ("met", "undecided", "slower")}
    print(f"cells x runs: {out['summary']} (goal: adaptive >= 0.98x off; {caps.cpu_capability})")
    if args.control:
        spread = [row[run]["control_ratio"] for row in out["cells"] for run in kinds]
        out["control_range"] = [min(spread), max(spread)]
        print(f"off / control (two engines with speculation off): {min(spread):.3f}-{max(spread):.3f}x over the "
              "cells: what this run cannot tell from 1.0")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", action="store_true", help="the never-slower matrix (see the module docstring)")
    ap.add_argument("--verification", default="token", help="--matrix: token or block verification")
    ap.add_argument("--control", action="store_true",
                    help="--matrix: a second engine with speculation off in every run (the noise floor)")
    ap.add_argument("--pairs", type=parse_pairs, default=0,
                    help="--matrix: finely paired runs per cell instead of rounds, one count or per batch size "
                         "(1:100,4:40,16:40; see the docstring)")
    ap.add_argument("--run-kinds", default="short,long",
                    help="--matrix --pairs: which runs to measure, short (cold) and/or long (warm)")
    ap.add_argument("--batch-sizes", default=None, help="--matrix --pairs: only these batch sizes (e.g. 1,4)")
    ap.add_argument("--runs", type=int, default=None, help="rounds (default 2; 3 with --matrix)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default=None, help="default: bfloat16; auto (what users get) with --matrix")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--draft", default=None, help="draft checkpoint folder (default: the built-in draft)")
    ap.add_argument("--draft-quantization", default=None, choices=["int8", "w8a8_int8", "none"],
                    help="--matrix: the adaptive engines' draft in int8 (weight-only), w8a8_int8 or its own weights "
                         "(--speculative-draft-quantization; default: the engine's choice, w8a8_int8 with the "
                         "compiled kernels)")
    ap.add_argument("--draft-dtype", default="auto", help="tailserve's draft dtype (auto: the target's)")
    ap.add_argument("--rows", default=None, help="only rows whose name contains this (plus 'off')")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.matrix:
        args.runs = args.runs or 3
        result = paired_matrix(args) if args.pairs else never_slower_matrix(args)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
        return
    args.runs = args.runs or 2
    args.dtype = args.dtype or "bfloat16"
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
