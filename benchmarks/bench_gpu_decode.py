"""Decode tok/s on a GPU for a 0.5B- or 1.5B-shaped model, CUDA graphs on and off, and the
batch-1 figure as a fraction of the memory-bandwidth roofline.

The model: random-initialised weights of Qwen2-0.5B's or Qwen2-1.5B's shape (bf16, made on
the fly with transformers, saved as a checkpoint in a temp folder). Workload: a 128-token
prompt per sequence, --new-tokens greedy tokens with the length forced, at each batch size;
decode tok/s = batch x (n - 1) / (t(n) - t(1)), median of --runs; and the prefill of one
--prefill-len-token prompt (one token out), median of --runs. Each setup (attention
backend x graphs on/off) is its own engine, built and torn down in turn.

Roofline: batch-1 decode reads every weight once per token, so its ceiling is the device's
copy bandwidth over the weight bytes (bandwidth measured here: a device-to-device copy of 1
GiB, bytes read + written over time). The fraction printed is measured / ceiling.

    python benchmarks/bench_gpu_decode.py [--shape 0.5b|1.5b] [--batch-sizes 1 16 64]
        [--backends torch triton] [--new-tokens 128] [--prefill-len 2048] [--runs 3] [--json FILE]
    python benchmarks/bench_gpu_decode.py --device cpu --layers 1 --vocab 512 --new-tokens 4 ...  # a CPU smoke run

benchmarks/gpu_check.sh runs it; tests/test_gpu_bench.py runs its CPU parts.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import tempfile
import time

SHAPES = {
    # Qwen2-0.5B and Qwen2-1.5B (config.json of the released checkpoints): tied embeddings.
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
}


def model_config(shape: str, layers: int | None = None, vocab: int | None = None) -> dict:
    cfg = dict(SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
               rms_norm_eps=1e-6)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if vocab is not None:
        cfg["vocab_size"] = vocab
    return cfg


def num_parameters(cfg: dict) -> int:
    """Parameters of a Qwen2 model of this config (q/k/v biases, tied head), counted exactly."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    attn = h * h + 2 * h * kv + h * h + h + 2 * kv  # q, k, v, o weights; q/k/v biases
    per_layer = attn + 3 * h * i + 2 * h  # gate, up, down; two norms
    return cfg["vocab_size"] * h + n * per_layer + h


def make_checkpoint(path: pathlib.Path, cfg: dict) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def copy_bandwidth_gb_s(device: str, nbytes: int = 1 << 30) -> float:
    import torch

    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times) / 1e9


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model_dir: str, device: str, backend: str, eager: bool, batch_sizes: list[int], new: int, runs: int,
            kv_bytes: int, prefill_len: int = 0) -> dict:
    import torch

    from tailserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype="bfloat16" if device.startswith("cuda") else "float32", device=device,
              attention_backend=backend, enforce_eager=eager, kv_cache_memory_bytes=kv_bytes,
              max_num_seqs=max(batch_sizes), max_model_len=max(1024, prefill_len + 8),
              max_num_batched_tokens=max(8192, prefill_len))
    start_s = time.perf_counter() - t0
    info = llm.engine.info
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, info.arch.vocab_size, (128,), generator=g).tolist()

    def timed(batch: int, n: int) -> float:
        sync(device)
        t = time.perf_counter()
        llm.generate([prompt] * batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        sync(device)
        return time.perf_counter() - t

    rates = {}
    for b in batch_sizes:
        timed(b, 2)
        samples = []
        for _ in range(runs):
            t1, tn = timed(b, 1), timed(b, new)
            samples.append(b * (new - 1) / (tn - t1))
        rates[str(b)] = statistics.median(samples)
    prefill_ms = None
    if prefill_len:  # one prompt of prefill_len tokens, one token out: the prefill's time (TTFT in-process)
        long_prompt = torch.randint(10, info.arch.vocab_size, (prefill_len,), generator=g).tolist()
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        times = []
        for _ in range(runs + 1):
            sync(device)
            t = time.perf_counter()
            llm.generate([long_prompt], one)
            sync(device)
            times.append(time.perf_counter() - t)
        prefill_ms = 1e3 * statistics.median(times[1:])  # the first builds this shape's kernels
    res = {"backend": info.plan.model.attention_backend, "graphs": bool(info.decode_graph_sizes),
           "graph_capture_s": info.graph_capture_s, "start_s": start_s, "decode_tok_s": rates,
           "prefill_len": prefill_len or None, "prefill_ms": prefill_ms,
           "graph_replays": llm.engine.runner.graph_replays, "plan": info.plan.describe()}
    llm.shutdown()
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=["torch", "triton"])
    ap.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill-len", type=int, default=2048,
                    help="also time the prefill of one prompt this long (one token out); 0: skip")
    ap.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes (each engine in turn)")
    ap.add_argument("--layers", type=int, help="override the layer count (small smoke runs)")
    ap.add_argument("--vocab", type=int, help="override the vocabulary (small smoke runs)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (decode rate = (n - 1) tokens over t(n) - t(1))")
    if any(b < 1 for b in args.batch_sizes):
        ap.error("--batch-sizes must be positive")
    if args.prefill_len < 0:
        ap.error("--prefill-len must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    import torch

    args = parse_args(argv)
    cfg = model_config(args.shape, args.layers, args.vocab)
    params = num_parameters(cfg)
    weight_bytes = 2 * params  # bf16
    out: dict = {"shape": args.shape, "config": cfg, "parameters": params, "weight_bytes": weight_bytes,
                 "device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    probe_bytes = 1 << 30 if args.device.startswith("cuda") else 1 << 26
    out["copy_bandwidth_gb_s"] = copy_bandwidth_gb_s(args.device, probe_bytes)
    out["roofline_batch1_tok_s"] = out["copy_bandwidth_gb_s"] * 1e9 / weight_bytes
    print(f"{args.shape}: {params / 1e6:.1f}M parameters, {weight_bytes / 1e9:.2f} GB bf16; copy bandwidth "
          f"{out['copy_bandwidth_gb_s']:.0f} GB/s -> batch-1 roofline {out['roofline_batch1_tok_s']:.0f} tok/s",
          flush=True)
    out["runs"] = []
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(pathlib.Path(tmp), cfg)
        for backend in args.backends:
            for graphs in args.graphs:
                try:
                    res = measure(tmp, args.device, backend, graphs == "off", args.batch_sizes, args.new_tokens,
                                  args.runs, args.kv_cache_memory, args.prefill_len)
                except Exception as e:  # one setup failing must not lose the others' figures
                    res = {"backend": backend, "error": f"{type(e).__name__}: {e}"}
                gc.collect()  # the engine just measured is unreachable now: give its memory back
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
                res["requested"] = {"backend": backend, "graphs": graphs}
                if "decode_tok_s" in res and "1" in res["decode_tok_s"]:
                    res["batch1_roofline_fraction"] = res["decode_tok_s"]["1"] / out["roofline_batch1_tok_s"]
                out["runs"].append(res)
                print(json.dumps(res), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
