"""Batch-1 decode alone and beside one busy core, in one run: how much of its speed tailserve
keeps when another process takes a core (a server shares its cores with its own HTTP loop,
tokenizer and metrics, and in deployments with sidecars).

Checkpoint: bench_peers.py's (shared/PEERS.md's 55M Llama shape, bf16 weights, made on the fly);
128-token prompt, 128 greedy new tokens forced; decode tok/s = 127 / (t(128 new) - t(1 new)).
The busy core is a plain Python loop in its own process at normal priority, started before the
timed runs and stopped after them. Conditions alternate (alone, busy, alone, busy, ...) in one
engine process, median of --runs per condition. llama.cpp runs the same way when
--llamacpp-python names an interpreter with llama-cpp-python (bench_peers.py's worker).

    python benchmarks/bench_busy_core.py [--runs 5] [--threads 2] [--dtype auto]
        [--variants default fixed] [--llamacpp-python PY] [--json FILE]

``default`` is tailserve as configured (the thread governor on); ``fixed`` pins the thread
count (TAILSERVE_CPU_THREADS_ADAPT=0), the behaviour before the governor.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_peers


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


class BusyCore:
    """One other process spinning at normal priority."""

    def __enter__(self) -> BusyCore:
        self.stop = mp.Event()
        self.proc = mp.Process(target=_spin, args=(self.stop,), daemon=True)
        self.proc.start()
        time.sleep(0.3)  # let the scheduler see it
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(5)


def measure(timed, runs: int) -> dict[str, float]:
    timed(2)  # warm-up
    out: dict[str, list[float]] = {"alone": [], "busy": []}
    for _ in range(runs):
        for cond in ("alone", "busy"):
            if cond == "busy":
                with BusyCore():
                    t1, t128 = timed(1), timed(bench_peers.NEW)
            else:
                time.sleep(1.0)  # the neighbour gone: tailserve takes its thread back after 0.5 s
                t1, t128 = timed(1), timed(bench_peers.NEW)
            out[cond].append((bench_peers.NEW - 1) / (t128 - t1))
    res = {k: statistics.median(v) for k, v in out.items()}
    res["kept"] = res["busy"] / res["alone"]
    return res


def worker_tailserve(model: str, dtype: str, runs: int) -> dict[str, float]:
    from tailserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=256 << 20)
    ids = bench_peers.prompt_ids()

    def timed(n: int) -> float:
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    return measure(timed, runs)


def worker_llamacpp(model: str, variant: str, runs: int) -> dict[str, float]:
    # llama-cpp-python's high-level API at batch 1 (one sequence needs no batch API); the argmax
    # in NumPy.
    import llama_cpp
    import numpy as np

    gguf = bench_peers.write_gguf(model, variant)
    llm = llama_cpp.Llama(str(gguf), n_ctx=512, n_threads=int(os.environ["BENCH_THREADS"]), verbose=False)
    ids = bench_peers.prompt_ids()

    def timed(n: int) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        for _ in range(n - 1):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        return time.perf_counter() - t

    return measure(timed, runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--variants", nargs="+", default=["default", "fixed"])
    ap.add_argument("--llamacpp-python", default=os.environ.get("BENCH_LLAMACPP_PYTHON"))
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.worker == "tailserve":
        print(json.dumps(worker_tailserve(args.model, args.dtype, args.runs)))
        return
    if args.worker == "llamacpp":
        print(json.dumps(worker_llamacpp(args.model, "bf16", args.runs)))
        return
    import torch

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = pathlib.Path(tmp) / "peers-shape"
        bench_peers.make_checkpoint(model)
        jobs = [(f"tailserve {v}", sys.executable, "tailserve", {"TAILSERVE_CPU_THREADS_ADAPT": "0"}
                 if v == "fixed" else {}) for v in args.variants]
        if args.llamacpp_python:
            jobs.append(("llama.cpp bf16", args.llamacpp_python, "llamacpp", {}))
        else:
            print("llama.cpp: skipped (no --llamacpp-python)", file=sys.stderr)
        for name, python, worker, extra in jobs:
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), BENCH_THREADS=str(args.threads), **extra)
            out = subprocess.run([python, __file__, "--worker", worker, "--model", str(model), "--runs",
                                  str(args.runs), "--dtype", args.dtype], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    bf16 = " + avx512_bf16" if "avx512_bf16" in flags else ""
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}{bf16}, {args.threads} threads, "
          f"batch-1 decode tok/s (median of {args.runs})")
    print(f"{'engine':<22}{'alone':>10}{'busy core':>12}{'kept':>8}")
    for name, r in results.items():
        print(f"{name:<22}{r['alone']:>10.1f}{r['busy']:>12.1f}{r['kept']:>8.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
