"""The server at the engine's speed (issue 27): `vllm bench serve` against `tailserve serve` and
llama-server, each alone on the machine, on one checkpoint.

The checkpoint is PEERS.md's 55M Llama in bf16 (benchmarks/bench_peers.py's shape and weights)
with a byte-level BPE tokenizer of 32,000 tokens trained here on the Python standard library's
sources (the shape has no tokenizer of its own, and both servers must turn the load's text into
the same tokens); llama-server gets the same weights as a bf16 GGUF carrying that tokenizer
(`gpt2` model, GPT-2 pre-tokenizer). Per server, started fresh: two loads of 64 random
128-token prompts at 16 concurrent (the first and the second load the server ever sees,
different prompts), then 16 prompts one at a time; 128 new tokens each, `--ignore-eos`, greedy.
Every load is a new `vllm bench serve` process that first sent one request to a stand-in
server, so its own first-request costs are paid elsewhere. Right before and right after
tailserve's one-stream load, while its server idles, this process measures tailserve's offline
batch-1 decode step on the same checkpoint (the engine in-process, median ``LLMEngine.step()``;
the engine core's part of it is printed beside): the served TPOT is held against the mean of the
two, round by round, since the machine drifts 10-25% from one minute to the next (a step
measured at a round's start and a load ten minutes later read 1.14x and 1.46x in one sitting).

    python benchmarks/bench_served.py --vllm-python /tmp/vllm-venv/bin/python \\
        --llama-server /path/to/llama.cpp/build/bin/llama-server [--rounds 1] [--json out.json]
        [--with-thread-loop]

--client tailserve runs every load through `tailserve bench` instead (same load and flags; no
vLLM needed). llama-server (b1-0c1e570) closes the connection after every streamed response
without a `Connection: close`; `vllm bench serve` then fails some requests on the closed
connections (1-10 of 64 a load here), which also reshapes the load, while `tailserve bench`
sends such a request again on a new connection (docs/bench.md). Each load's failures are printed.

--with-thread-loop also serves with `--engine-loop thread` (the engine loop on its own thread,
outputs handed to the event loop's thread each step), interleaved with the default.

Needs the `gguf` package (pip install gguf, or PYTHONPATH=<llama.cpp>/gguf-py) for the GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_peers import SHAPE, make_checkpoint, write_gguf

from tailserve.bench.local_server import LocalServer, free_port, wait_for_health

VLLM_CLI = pathlib.Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm_cli.py"
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the shape's bos 1 and eos 2


def train_tokenizer(out: pathlib.Path) -> None:
    """A GPT-2-style byte-level BPE of SHAPE's vocabulary size over the standard library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((f.read_text(encoding="utf-8", errors="replace") for f in files), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": False, "model_max_length": SHAPE["max_position_embeddings"]}))


def prepare(path: pathlib.Path) -> None:
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        make_checkpoint(path)
    if not (path / "tokenizer.json").exists():
        t = time.perf_counter()
        train_tokenizer(path)
        print(f"tokenizer trained in {time.perf_counter() - t:.0f} s", flush=True)


def offline_step_ms(model: pathlib.Path) -> tuple[float, float]:
    """tailserve's batch-1 decode step in-process: 128-token prompt, 128 new tokens, median.

    Two figures: the whole ``LLMEngine.step()`` as ``LLM.generate`` drives it (the model, the
    sampler, and turning the token into text: what a token costs offline), and the engine
    core's part of it alone (``step_log``: scheduling, the forward and the sampler, without
    the detokenization and stop checks that follow). The served TPOT is held against the first."""
    import random

    from tailserve import LLM, SamplingParams

    llm = LLM(str(model), enable_prefix_caching=False, enable_metrics=False)
    eng = llm.engine
    rng = random.Random(0)
    steps, core = [], []
    for r in range(3):
        ids = [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(128)]
        eng.core.step_log.clear()
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                        f"offline-{r}")
        first = True
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()
            if not first:  # the prompt's step
                steps.append(time.perf_counter() - t0)
            first = False
        core += [s.duration_s for s in eng.step_log if s.num_prefill_tokens == 0]
    llm.shutdown()
    return statistics.median(steps) * 1e3, statistics.median(core) * 1e3


class LlamaServer:
    def __init__(self, binary: str, gguf_path: pathlib.Path, slots: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [binary, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(self.port), "-t", "2",
                    "-tb", "2", "-np", str(slots), "-c", str(slots * 512), "-a", "m", "--no-webui"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        state = wait_for_health(self.proc, self.url, 120)
        if state == "ok":
            return self
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace")[-2000:]
        self.__exit__()
        raise RuntimeError(f"llama-server {'exited' if state == 'exited' else 'did not answer in 120 s'}: {tail}")

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def one_load(python: str | None, url: str, tokenizer: pathlib.Path, prompts: int, concurrency: int, seed: int,
              out: pathlib.Path, name: str) -> dict:
    """One load: `vllm bench serve` in ``python``'s venv, or `tailserve bench` where ``python`` is None."""
    load = ["--model", "m", "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", "128",
            "--random-output-len", "128", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--save-result", "--result-dir", str(out), "--result-filename", name]
    if python is None:
        cmd, env = [str(pathlib.Path(sys.executable).with_name("tailserve")), "bench", "--url", url, *load], None
    else:
        cmd = [python, str(VLLM_CLI), "bench", "serve", "--backend", "openai", "--base-url", url, *load]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:3])} failed: {proc.stderr.strip()[-1500:]}")
    r = json.loads((out / name).read_text())
    return {"out_tok_s": r["output_throughput"], "ttft_p50_ms": r["median_ttft_ms"],
            "tpot_p50_ms": r["median_tpot_ms"], "completed": r["completed"], "failed": prompts - r["completed"]}


def run_server(kind: str, start, args, model: pathlib.Path, tmp: pathlib.Path, r: int) -> dict:
    res = {}
    offline = []
    with start() as srv:
        res["first_16"] = one_load(args.vllm_python, srv.url, model, 64, 16, 100 + r, tmp, f"{kind}-{r}-a.json")
        res["second_16"] = one_load(args.vllm_python, srv.url, model, 64, 16, 200 + r, tmp, f"{kind}-{r}-b.json")
        if kind != "llama.cpp":
            offline.append(offline_step_ms(model))  # the server idles meanwhile
        res["one"] = one_load(args.vllm_python, srv.url, model, 16, 1, 300 + r, tmp, f"{kind}-{r}-c.json")
        if kind != "llama.cpp":
            offline.append(offline_step_ms(model))
    for load, v in res.items():
        print(f"round {r + 1} {kind:9s} {load:9s} {v['out_tok_s']:7.1f} tok/s  TTFT P50 {v['ttft_p50_ms']:7.1f} ms  "
              f"TPOT P50 {v['tpot_p50_ms']:6.2f} ms  failed {v['failed']}", flush=True)
    if offline:
        step = statistics.mean(w for w, _ in offline)
        res["one"]["offline_step_ms"] = step
        res["one"]["offline_core_step_ms"] = statistics.mean(c for _, c in offline)
        res["one"]["tpot_over_offline"] = res["one"]["tpot_p50_ms"] / step
        print(f"round {r + 1} {kind:9s} offline batch-1 decode step before / after the one-stream load: "
              f"{offline[0][0]:.2f} / {offline[1][0]:.2f} ms (engine core {offline[0][1]:.2f} / {offline[1][1]:.2f}); "
              f"TPOT P50 / their mean {res['one']['tpot_over_offline']:.2f}x", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=None, help="the venv with vllm-cpu (the vllm client)")
    ap.add_argument("--client", choices=("vllm", "tailserve"), default="vllm",
                    help="the load generator: vllm bench serve (default) or tailserve bench")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (omit: tailserve only)")
    ap.add_argument("--model-dir", default=str(pathlib.Path(tempfile.gettempdir()) / "tailserve-served-55m"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--with-thread-loop", action="store_true",
                    help="also serve with --engine-loop thread (the hand-off between threads), interleaved")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.client == "vllm" and not args.vllm_python:
        ap.error("--vllm-python is needed with --client vllm")
    if args.client == "tailserve":
        args.vllm_python = None  # one_load then runs tailserve bench
    print(f"client: {args.client} bench", flush=True)
    model = pathlib.Path(args.model_dir)
    prepare(model)
    gguf_path = write_gguf(str(model), "bf16", with_tokenizer=True) if args.llama_server else None
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="served-"))
    # Each client process first sends one request to a stand-in so its own first-request costs
    # are paid there: here, a tailserve server of the built-in model started once.
    with LocalServer(["--no-warmup", "--served-model-name", "m"]) as standin:
        one_load(args.vllm_python, standin.url, _builtin(), 1, 1, 0, tmp, "standin.json")
    servers = {"tailserve": lambda: LocalServer(["--model", str(model), "--served-model-name", "m"])}
    if args.with_thread_loop:
        servers["ts-thread"] = lambda: LocalServer(["--model", str(model), "--served-model-name", "m",
                                                    "--engine-loop", "thread"])
    if args.llama_server:
        servers["llama.cpp"] = lambda: LlamaServer(args.llama_server, gguf_path, 16)
    rows: dict[str, list[dict]] = {k: [] for k in servers}
    for r in range(args.rounds):
        for kind in (list(servers) if r % 2 == 0 else list(reversed(servers))):
            rows[kind].append(run_server(kind, servers[kind], args, model, tmp, r))
    med = {k: {load: {m: statistics.median(x[load][m] for x in rs) for m in rs[0][load]} for load in rs[0]}
           for k, rs in rows.items()}
    t = med["tailserve"]
    ratios = ", ".join(f"{x['one']['tpot_over_offline']:.2f}" for x in rows["tailserve"])
    print(f"\nmedians over {args.rounds} round(s); tailserve offline batch-1 step {t['one']['offline_step_ms']:.2f} ms "
          f"(engine core {t['one']['offline_core_step_ms']:.2f} ms), measured beside each one-stream load")
    print(f"  1 concurrent: TPOT P50 {t['one']['tpot_p50_ms']:.2f} ms = {t['one']['tpot_over_offline']:.2f}x "
          f"the offline step beside it (rounds {ratios}; goal <= 1.15)")
    if "llama.cpp" in med:
        ll = med["llama.cpp"]
        print(f"  1 concurrent out tok/s: tailserve {t['one']['out_tok_s']:.1f}, llama-server "
              f"{ll['one']['out_tok_s']:.1f} ({t['one']['out_tok_s'] / ll['one']['out_tok_s']:.2f}x, goal >= 1)")
        for load in ("first_16", "second_16"):
            a, b = t[load]["out_tok_s"], ll[load]["out_tok_s"]
            print(f"  16 concurrent, {load.split('_')[0]} load: tailserve {a:.1f}, llama-server {b:.1f} tok/s "
                  f"({a / b:.2f}x, goal >= 1.5)")
    if "ts-thread" in med:
        th = med["ts-thread"]
        print(f"  --engine-loop thread: 1 concurrent TPOT P50 {th['one']['tpot_p50_ms']:.2f} ms = "
              f"{th['one']['tpot_over_offline']:.2f}x the offline step; 16 concurrent "
              f"{th['first_16']['out_tok_s']:.1f} / {th['second_16']['out_tok_s']:.1f} tok/s, TTFT P50 "
              f"{th['first_16']['ttft_p50_ms']:.1f} / {th['second_16']['ttft_p50_ms']:.1f} ms (first / second load)")
    first, second = t["first_16"]["ttft_p50_ms"], t["second_16"]["ttft_p50_ms"]
    print(f"  tailserve first / second load TTFT P50: {first:.1f} / {second:.1f} ms ({first / second:.2f}x, "
          "goal within 1.2x)")
    if args.json:
        out = {"rounds": rows, "medians": med}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


def _builtin() -> pathlib.Path:
    from tailserve.assets import DEFAULT_TARGET_DIR

    return pathlib.Path(DEFAULT_TARGET_DIR)


if __name__ == "__main__":
    main()
