"""tailserve vs Hugging Face transformers ``generate`` on the same checkpoint, in one run.

Checkpoint: random-initialised Llama of the shape in shared/PEERS.md (hidden 512, 8 layers,
8 heads, 2 KV heads, intermediate 1408, vocabulary 32000; 55.3M parameters), made on the
fly with transformers unless --model is given. Greedy, lengths forced (ignore EOS).

Workloads, for each dtype:
  (a) batch 1: 128-token prompt, 128 new tokens; decode tok/s = 127 / (t(128) - t(1))
  (b) batch 16: 16 copies of that prompt; end-to-end tok/s = 16*128 / t(128), and decode only
  (c) mixed: 32 prompts of 64-512 tokens (fixed seed), --mixed-new-tokens each; tok/s of
      generated tokens (transformers: one left-padded batch)

Each figure is the median over --runs runs; the ratio column is tailserve / transformers
measured in this same run. Timings on shared machines drift: compare ratios, not absolutes.

    python benchmarks/bench_engine.py [--runs 3] [--dtypes bfloat16 float32] [--skip-hf]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time

import torch

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)


def make_checkpoint(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(path, safe_serialization=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def workloads(vocab: int, new_tokens: int):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab, (128,), generator=g).tolist()
    lengths = torch.randint(64, 513, (32,), generator=g).tolist()
    mixed = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
    return prompt, mixed


def bench_tailserve(model: str, dtype: str, runs: int, new: int, mixed_new: int, device: str = "cpu"
                    ) -> dict[str, float]:
    from tailserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=2 << 30, max_num_batched_tokens=2048, device=device)
    prompt, mixed = workloads(SHAPE["vocab_size"], new)

    def gen(prompts, n):
        return lambda: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    return _measure(gen, prompt, mixed, runs, new, mixed_new)


def bench_hf(model: str, dtype: str, runs: int, new: int, mixed_new: int, device: str = "cpu") -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval().to(device)
    prompt, mixed = workloads(SHAPE["vocab_size"], new)

    def gen(prompts, n):
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1

        ids, mask = ids.to(device), mask.to(device)

        def run():
            with torch.inference_mode():
                m.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return run

    return _measure(gen, prompt, mixed, runs, new, mixed_new)


def _measure(gen, prompt, mixed, runs, new, mixed_new) -> dict[str, float]:
    t1 = median_time(gen([prompt], 1), runs)
    tn = median_time(gen([prompt], new), runs)
    b1 = median_time(gen([prompt] * 16, 1), runs)
    bn = median_time(gen([prompt] * 16, new), runs)
    tm = median_time(gen(mixed, mixed_new), max(1, runs - 1))
    return {
        "batch1_decode_tok_s": (new - 1) / (tn - t1),
        "batch16_tok_s": 16 * new / bn,
        "batch16_decode_tok_s": 16 * (new - 1) / (bn - b1),
        "mixed32_tok_s": len(mixed) * mixed_new / tm,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder (default: make the PEERS.md shape in a temp dir)")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mixed-new-tokens", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true", help="measure tailserve only")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        model = tmp.name
        make_checkpoint(model)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.runs} runs")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for dtype in args.dtypes:
        gc.collect()
        results[dtype] = {"tailserve": bench_tailserve(model, dtype, args.runs, args.new_tokens, args.mixed_new_tokens,
                                                       args.device)}
        if not args.skip_hf:
            results[dtype]["transformers"] = bench_hf(model, dtype, args.runs, args.new_tokens, args.mixed_new_tokens,
                                                      args.device)
        _print(dtype, results[dtype])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _print(dtype: str, res: dict[str, dict[str, float]]) -> None:
    ours, ref = res["tailserve"], res.get("transformers")
    print(f"\n{dtype}")
    print(f"{'workload':<24}{'tailserve':>12}{'transformers':>14}{'ratio':>8}")
    for key, value in ours.items():
        other = ref[key] if ref else float("nan")
        print(f"{key:<24}{value:>12.1f}{other:>14.1f}{value / other:>8.2f}")


if __name__ == "__main__":
    main()
