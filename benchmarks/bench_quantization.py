"""Weight-only int8 (``--quantization int8``): what it costs in accuracy and what it buys in speed.

Accuracy, on the built-in target model: next-token cross-entropy on held-out standard-library
files (the windows ``scripts/eval_default_models.py`` scores), unquantised against int8 in the
same dtype, and the fraction of positions where their greedy (argmax) tokens agree.

Speed, in one run and interleaved: batch-1 and batch-16 decode tok/s of the unquantised and
the int8 engine, on the built-in target and on the 55M shape of shared/PEERS.md (random
weights, made on the fly), medians over --runs. decode tok/s = 127 / (t(128) - t(1)) per
sequence, as in bench_engine.py.

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


def accuracy(dtype: torch.dtype, windows: int) -> dict[str, float]:
    tok = Tokenizer(DEFAULT_TARGET_DIR)
    plain_method = build_linear_method("onednn-packed" if onednn_available() else "plain")
    plain, cfg = load_model(DEFAULT_TARGET_DIR, dtype, linear_method=plain_method)
    q8_method = build_linear_method("int8-weight-only", cpu_kernels.kernels())
    q8, _ = load_model(DEFAULT_TARGET_DIR, dtype, linear_method=q8_method)
    ids: list[int] = []
    for _, text in held_out_texts():
        ids += [*tok.encode(text), tok.eos_token_id or 1]
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - WINDOW - 1, (windows,), generator=g).tolist()
    loss_p = loss_q = agree = count = 0.0
    for s in starts:
        window = ids[s : s + WINDOW + 1]
        inp, tgt = window[:-1], torch.tensor(window[1:])
        lp, lq = window_logits(plain, cfg, inp), window_logits(q8, cfg, inp)
        loss_p += F.cross_entropy(lp, tgt, reduction="sum").item()
        loss_q += F.cross_entropy(lq, tgt, reduction="sum").item()
        agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        count += len(tgt)
    return {"tokens": count, "ce_plain": loss_p / count, "ce_int8": loss_q / count, "greedy_agreement": agree / count}


def speed(model: str, dtype: str, runs: int) -> dict[str, dict[str, float]]:
    engines = {name: LLM(model, dtype=dtype, quantization=q, kv_cache_memory_bytes=1 << 30,
                         max_num_batched_tokens=2048)
               for name, q in (("plain", None), ("int8", "int8"))}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 1000, (128,), generator=g).tolist()

    def t(llm: LLM, batch: int, n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    samples: dict[str, dict[str, list[float]]] = {k: {"batch1": [], "batch16": []} for k in engines}
    for llm in engines.values():
        t(llm, 1, 8)
        t(llm, 16, 8)
    for _ in range(runs):  # interleaved, so drift hits both alike
        for name, llm in engines.items():
            for batch, key in ((1, "batch1"), (16, "batch16")):
                samples[name][key].append(batch * 127 / (t(llm, batch, 128) - t(llm, batch, 1)))
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
    print(f"built-in target, {int(acc['tokens'])} held-out tokens: cross-entropy {acc['ce_plain']:.4f} -> "
          f"{acc['ce_int8']:.4f} nats/token (perplexity {math.exp(acc['ce_plain']):.3f} -> "
          f"{math.exp(acc['ce_int8']):.3f}); greedy agreement {acc['greedy_agreement']:.4f}")
    if args.skip_speed:
        return
    from bench_engine import make_checkpoint  # the PEERS.md 55M shape

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(tmp)
        for label, model in (("built-in target", str(DEFAULT_TARGET_DIR)), ("55M shape", tmp)):
            res = speed(model, name, args.runs)
            print(f"{label}: decode tok/s, median of {args.runs}")
            for key in ("batch1", "batch16"):
                p, q = res["plain"][key], res["int8"][key]
                print(f"  {key:<8} plain {p:8.1f}  int8 {q:8.1f}  ratio {q / p:5.2f}")


if __name__ == "__main__":
    main()
