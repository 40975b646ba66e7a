"""int8 targets (``--quantization int8``, weight-only, and ``w8a8_int8``, int8 weights and
per-row int8 activations): what they cost in accuracy and what they buy in speed.

Accuracy, on the built-in target model: next-token cross-entropy on held-out standard-library
files (the windows ``scripts/eval_default_models.py`` scores), unquantised against int8 in the
same dtype (w8a8_int8: float32, the compiled kernels'), and the fraction of positions where
their greedy (argmax) tokens agree.

Speed, in one run and interleaved: batch-1 and batch-16 decode tok/s and a 128-token prompt's
time to the first token of the unquantised and the int8 engines, on the built-in target and on
the 55M shape of shared/PEERS.md (random weights, made on the fly), medians over --runs.
decode tok/s = 127 / (t(128) - t(1)) per sequence, as in bench_engine.py.

    python benchmarks/bench_quantization.py [--dtype auto] [--runs 3] [--windows 32] [--skip-speed]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
from eval_default_models import WINDOW, held_out_texts, window_logits

from tailserve import LLM, SamplingParams
from tailserve.assets import DEFAULT_TARGET_DIR
from tailserve.kernels import cpu as cpu_kernels
from tailserve.model.linear import build_linear_method, onednn_available
from tailserve.model.loader import load_model
from tailserve.model.tokenizer import Tokenizer
from tailserve.platform_info import resolve_auto_dtype


def quantizations() -> list[str]:
    """The schemes this machine runs: w8a8_int8 needs the compiled CPU kernels."""
    return ["int8", "w8a8_int8"] if cpu_kernels.kernels() is not None else ["int8"]


def accuracy(dtype: torch.dtype, windows: int) -> dict[str, float]:
    tok = Tokenizer(DEFAULT_TARGET_DIR)
    plain_method = build_linear_method("onednn-packed" if onednn_available() else "plain")
    plain, cfg = load_model(DEFAULT_TARGET_DIR, dtype, linear_method=plain_method)
    quantized = {"int8": load_model(DEFAULT_TARGET_DIR, dtype, linear_method=build_linear_method(
        "int8-weight-only", cpu_kernels.kernels()))[0]}
    if "w8a8_int8" in quantizations():
        quantized["w8a8_int8"] = load_model(DEFAULT_TARGET_DIR, torch.float32, linear_method=build_linear_method(
            "int8-w8a8", cpu_kernels.kernels()))[0]
    ids: list[int] = []
    for _, text in held_out_texts():
        ids += [*tok.encode(text), tok.eos_token_id or 1]
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - WINDOW - 1, (windows,), generator=g).tolist()
    loss_p, count = 0.0, 0
    loss = dict.fromkeys(quantized, 0.0)
    agree = dict.fromkeys(quantized, 0.0)
    for s in starts:
        window = ids[s : s + WINDOW + 1]
        inp, tgt = window[:-1], torch.tensor(window[1:])
        lp = window_logits(plain, cfg, inp)
        loss_p += F.cross_entropy(lp, tgt, reduction="sum").item()
        for name, model in quantized.items():
            lq = window_logits(model, cfg, inp).float()
            loss[name] += F.cross_entropy(lq, tgt, reduction="sum").item()
            agree[name] += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        count += len(tgt)
    out = {"tokens": count, "ce_plain": loss_p / count}
    for name in quantized:
        out[f"ce_{name}"] = loss[name] / count
        out[f"greedy_agreement_{name}"] = agree[name] / count
    return out


def speed(model: str, dtype: str, runs: int) -> dict[str, dict[str, float]]:
    engines = {name: LLM(model, dtype=dtype, quantization=q, kv_cache_memory_bytes=1 << 30,
                         max_num_batched_tokens=2048)
               for name, q in (("plain", None), *((q, q) for q in quantizations()))}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 1000, (128,), generator=g).tolist()

    def t(llm: LLM, batch: int, n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    samples: dict[str, dict[str, list[float]]] = {k: {"batch1": [], "batch16": [], "prompt_ms": []} for k in engines}
    for llm in engines.values():
        t(llm, 1, 8)
        t(llm, 16, 8)
    for _ in range(runs):  # interleaved, so drift hits all alike
        for name, llm in engines.items():
            first = t(llm, 1, 1)
            samples[name]["prompt_ms"].append(first * 1e3)
            samples[name]["batch1"].append(127 / (t(llm, 1, 128) - first))
            samples[name]["batch16"].append(16 * 127 / (t(llm, 16, 128) - t(llm, 16, 1)))
    return {name: {k: statistics.median(v) for k, v in d.items()} for name, d in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    cpu = torch.device("cpu")
    dtype = resolve_auto_dtype(torch.bfloat16, cpu)[0] if args.dtype == "auto" else getattr(torch, args.dtype)
    name = str(dtype).removeprefix("torch.")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, dtype {name}")
    acc = accuracy(dtype, args.windows)
    for q in quantizations():
        print(f"built-in target, {int(acc['tokens'])} held-out tokens, {q}: cross-entropy {acc['ce_plain']:.4f} -> "
              f"{acc[f'ce_{q}']:.4f} nats/token (perplexity {math.exp(acc['ce_plain']):.3f} -> "
              f"{math.exp(acc[f'ce_{q}']):.3f}); greedy agreement {acc[f'greedy_agreement_{q}']:.4f}")
    if args.skip_speed:
        return
    from bench_engine import make_checkpoint  # the PEERS.md 55M shape

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(tmp)
        for label, model in (("built-in target", str(DEFAULT_TARGET_DIR)), ("55M shape", tmp)):
            # --dtype auto: what users get (on the CPU with the kernels, float32 over compact or int8 weights).
            res = speed(model, args.dtype if args.dtype == "auto" else name, args.runs)
            print(f"{label}: decode tok/s and a 128-token prompt's ms, median of {args.runs}")
            for key in ("batch1", "batch16", "prompt_ms"):
                p = res["plain"][key]
                print(f"  {key:<9} plain {p:8.1f}" + "".join(
                    f"  {q} {res[q][key]:8.1f} ({res[q][key] / p:4.2f}x)" for q in quantizations()))


if __name__ == "__main__":
    main()
