"""The demo's four acts: each the same load with and without one thing, measured.

Acts 1-3 go through the real server (``tailserve serve`` in a child process) and the real
load generator (``tailserve.bench``), with the client and the server each pinned to a core of
their own where the machine has two; act 4 runs in this process (engine and allocator model).
Each act returns an ``Act``: its table, its figures (what ``verdicts`` reads) and the
commands that reproduce it against the user's own server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tailserve.bench.cli_args import DEFAULT_METRIC_PERCENTILES
from tailserve.bench.datasets import BenchRequest, DatasetConfig, load_dataset, python_source_files
from tailserve.bench.load import LoadConfig, run_load
from tailserve.bench.local_server import LocalServer
from tailserve.bench.results import build_result, parse_percentiles
from tailserve.demo import verdicts
from tailserve.demo.proxy import DelayingProxy
from tailserve.model.tokenizer import Tokenizer

# Sampling that keeps the small model's code readable: greedy decoding loops on it.
TEMPERATURE, TOP_P = 0.5, 0.9
PERCENTILES = parse_percentiles(DEFAULT_METRIC_PERCENTILES)
METRICS = ["ttft", "tpot", "itl", "e2el"]


@dataclass
class Act:
    key: str  # tail | speculation | prefix | memory
    title: str
    columns: list[str]
    rows: list[list[str]]
    verdict: str
    figures: dict[str, Any]
    # Bar charts for the report: (title, unit, [(label, value)]).
    charts: list[tuple[str, str, list[tuple[str, float]]]] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0
    extra_table: tuple[list[str], list[list[str]]] | None = None  # a second table (act 4's allocator)


@dataclass
class DemoSetup:
    model_dir: str
    tokenizer: Tokenizer
    quick: bool
    speculative_model: str | None  # "builtin" for the built-in pair; None: suffix decoding alone
    client_cpus: set[int] | None  # where the load generator runs (None: not pinned)
    server_cpus: list[int] | None
    log: Any = print

    def server(self, flags: Sequence[str]) -> LocalServer:
        args = ["--model", self.model_dir, "--no-warmup", *flags]
        self.log(f"  starting tailserve serve {' '.join(args)}" +
                 (f" (pinned to core {','.join(map(str, self.server_cpus))})" if self.server_cpus else ""))
        return LocalServer(args, cpus=self.server_cpus)


def plan_cpus() -> tuple[set[int] | None, list[int] | None]:
    """Client on the first core this process may use, the server on the others (two or more)."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return {cores[0]}, cores[1:]


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """This process (the load generator) on ``cpus`` for the block, restored afterwards."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _measure(setup: DemoSetup, url: str, requests: list[BenchRequest], label: str, num_warmups: int = 2,
             **cfg: Any) -> dict[str, Any]:
    lc = LoadConfig(base_url=url, num_warmups=num_warmups, temperature=TEMPERATURE, top_p=TOP_P, seed=0,
                    extra_body={"seed": 1}, **cfg)
    with pinned(setup.client_cpus):
        run = asyncio.run(run_load(lc, requests, setup.tokenizer))
    res = build_result(run, METRICS, PERCENTILES, label=label, tokenizer_id=setup.model_dir, dataset_name="python")
    lag = res["client"]["p99_send_lag_ms"]
    if res["client"]["saturated"]:
        setup.log(f"  warning: {label}: the load generator lagged (P99 send lag {lag:.1f} ms); its figures include "
                  "client time")
    if res["failed"]:
        first = next(e for e in res["errors"] if e)
        raise RuntimeError(f"{label}: {res['failed']} of {len(requests)} requests failed, first: {first}")
    return res


def _python(setup: DemoSetup, n: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    return load_dataset(DatasetConfig(name="python", num_prompts=n, input_len=input_len, output_len=output_len,
                                      seed=seed), setup.tokenizer)


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _bench_cmd(extra: str, dataset: str = "python") -> str:
    return f"tailserve bench --url http://HOST:PORT --tokenizer MODEL_DIR --dataset-name {dataset} {extra}"


# -- act 1: where the tail comes from ----------------------------------------------------------

def _tail_figs(res: dict[str, Any]) -> dict[str, Any] | None:
    a = res["attribution"]
    if not a.get("attributable"):
        return None
    return {"p50_e2el_ms": a["p50_e2el_ms"], "p99_e2el_ms": a["p99_e2el_ms"], "dominant": a["dominant"],
            "share": a["share"], "excess_ms": a["excess_ms"]}


def act_tail(setup: DemoSetup, srv: LocalServer) -> Act:
    t0 = time.perf_counter()
    n, out_len = (8, 24) if setup.quick else (24, 48)
    every, delay_s = (4, 0.5) if setup.quick else (5, 0.5)
    reqs = _python(setup, n, 96, out_len, seed=10)
    direct = _measure(setup, srv.url, reqs, "direct", request_rate=4.0)
    # The hold must outlast the direct run's own tail, or the held responses land inside it: on
    # a slower day here (direct P99 847 ms) a 500 ms hold did not reach the tail at all.
    base = _tail_figs(direct)
    if base is not None:
        delay_s = max(delay_s, round(2e-3 * base["p99_e2el_ms"], 1))
    with DelayingProxy(srv.url, every=every, delay_s=delay_s) as proxy:
        proxied = _measure(setup, proxy.url, reqs, "through the proxy", request_rate=4.0)
        held = proxy.num_held
    figs = {"direct": _tail_figs(direct), "proxied": _tail_figs(proxied), "every": every, "delay_ms": delay_s * 1e3,
            "held": held}
    rows, charts = [], []
    for name, res in (("direct", direct), (f"proxy (1 in {every} held {delay_s * 1e3:.0f} ms)", proxied)):
        a = res["attribution"]
        share = a.get("share") or {}
        dom = a.get("dominant", "-")
        rows.append([name, _f(res["median_e2el_ms"], 0), _f(res["p99_e2el_ms"], 0), _f(a.get("p99_over_p50")),
                     f"{dom} {share.get(dom, 0):.0%}" if share else "-",
                     _f(a.get("p99_network_ttft_ms"), 0)])
        if share:
            charts.append((f"{name}: where the tail's extra time went", "%",
                           [(ph, 100 * share[ph]) for ph in ("network", "queue", "prefill", "decode")]))
    return Act("tail", "1. Where the tail comes from", ["load", "E2EL P50 ms", "E2EL P99 ms", "P99/P50",
                                                          "tail's extra time", "P99 network TTFT ms"],
               rows, verdicts.tail_verdict(figs), figs, charts,
               [_bench_cmd(f"--num-prompts {n} --request-rate 4 --random-input-len 96 --random-output-len {out_len}") +
                "  # its verdict line names the phase",
                "# through your gateway / load balancer: the same command with --url pointed at it"],
               note=f"Same {n} requests at 4 req/s (Poisson) twice: straight to the server, then through a local "
                    f"proxy that holds every {every}th response {delay_s * 1e3:.0f} ms after the server produced it. "
                    "The client joins its own timings with the server's per-request timing; what the server did not "
                    "see is the network.",
               seconds=time.perf_counter() - t0)


# -- act 2: speculation --------------------------------------------------------------------------

def _spec_figs(res: dict[str, Any]) -> dict[str, Any]:
    out = res["total_output_tokens"]
    drafts = res.get("spec_decode_draft_tokens") or 0.0
    return {"tpot_p50_ms": res["median_tpot_ms"], "tpot_p99_ms": res["p99_tpot_ms"], "tok_s": res["output_throughput"],
            "acceptance_pct": res.get("spec_decode_acceptance_rate"), "draft_per_token": drafts / out if out else 0.0}


def speculation_loads(setup: DemoSetup) -> dict[str, tuple[list[BenchRequest], dict[str, Any]]]:
    """The loads of act 2: name -> (requests, LoadConfig keywords)."""
    n1, nc, out_len, conc = (4, 8, 32, 4) if setup.quick else (8, 24, 64, 8)
    return {"batch 1": (_python(setup, n1, 96, out_len, seed=20), {"max_concurrency": 1, "num_warmups": 3}),
            f"concurrency {conc}": (_python(setup, nc, 96, out_len, seed=21), {"max_concurrency": conc,
                                                                                "num_warmups": conc})}


def repeated_requests(setup: DemoSetup) -> list[BenchRequest]:
    """Each prompt sent twice, the second time after the first finished (same seed, so the same
    answer): an agent's retry or a regenerated reply, where suffix decoding drafts from the
    first answer."""
    n, out_len = (3, 32) if setup.quick else (6, 64)
    base = _python(setup, n, 96, out_len, seed=22)
    return [r for r in base for _ in range(2)]


def act_speculation(setup: DemoSetup, off_srv: LocalServer) -> Act:
    t0 = time.perf_counter()
    loads = speculation_loads(setup)
    off = {name: _measure(setup, off_srv.url, reqs, f"off, {name}", **kw) for name, (reqs, kw) in loads.items()}
    rep = repeated_requests(setup)
    rep_kw = {"max_concurrency": 1, "num_warmups": 2}
    rep_off = _measure(setup, off_srv.url, rep, "off, repeated", **rep_kw)
    spec_flags = (["--speculative-model", setup.speculative_model] if setup.speculative_model
                  else ["--speculative-method", "suffix"])
    with setup.server(["--no-enable-prefix-caching", *spec_flags]) as srv:
        on = {name: _measure(setup, srv.url, reqs, f"adaptive, {name}", **kw) for name, (reqs, kw) in loads.items()}
    with setup.server(["--no-enable-prefix-caching", "--speculative-method", "suffix"]) as srv:
        rep_on = _measure(setup, srv.url, rep, "suffix, repeated", **rep_kw)
    figs: dict[str, Any] = {
        "loads": [{"load": name, "by": "latency" if kw.get("max_concurrency") == 1 else "throughput",
                   "off": _spec_figs(off[name]), "adaptive": _spec_figs(on[name])} for name, (_, kw) in loads.items()],
        "repeated": {"by": "latency", "off": _spec_figs(rep_off), "suffix": _spec_figs(rep_on)},
        "method": "draft model (built-in)" if setup.speculative_model == "builtin" else
                  (setup.speculative_model or "suffix")}
    rows, tpot, tps = [], [], []
    for entry in [*[(x["load"], x["off"], x["adaptive"], "adaptive") for x in figs["loads"]],
                  ("repeated requests, batch 1", figs["repeated"]["off"], figs["repeated"]["suffix"], "suffix")]:
        load, a, b, name = entry
        for mode, s in (("off", a), (name, b)):
            rows.append([load, mode, _f(s["tpot_p50_ms"], 2), _f(s["tpot_p99_ms"], 2), _f(s["tok_s"], 0),
                         _f(s["acceptance_pct"], 0), _f(s["draft_per_token"], 2)])
            tpot.append((f"{load}: {mode}", s["tpot_p50_ms"]))
            tps.append((f"{load}: {mode}", s["tok_s"]))
    spec_arg = " ".join(spec_flags)
    return Act("speculation", "2. Speculative decoding", ["load", "speculation", "TPOT P50 ms", "TPOT P99 ms",
                                                          "tokens/s", "accepted %", "drafts/token"],
               rows, verdicts.speculation_verdict(figs), figs,
               [("per-token latency (TPOT P50)", "ms", tpot), ("output tokens per second", "tok/s", tps)],
               [f"tailserve serve --model MODEL_DIR {spec_arg}  # adaptive k: the controller drafts only where it "
                "measures a gain",
                *(_bench_cmd(f"--num-prompts {len(reqs)} --max-concurrency {kw['max_concurrency']} "
                             f"--num-warmups {kw['num_warmups']}") for reqs, kw in loads.values())],
               note=f"Speculation by {figs['method']} with k chosen per step from measured acceptance and costs; the "
                    "same requests with it off. Suffix decoding drafts from earlier text, here each prompt's first "
                    "answer when the same request comes again. Lossless: the outputs keep the target's distribution.",
               seconds=time.perf_counter() - t0)


# -- act 3: prefix caching -------------------------------------------------------------------------

def shared_prefix_requests(tok: Tokenizer, n: int, num_prefixes: int, prefix_tokens: int, output_len: int,
                           seed: int) -> list[BenchRequest]:
    """N stdlib modules' first ``prefix_tokens`` tokens, each followed by different function
    openings: a long shared context (a document, a system prompt, a code file) with short
    questions after it."""
    rng = random.Random(seed)
    prefixes = []
    files = [p for p in python_source_files() if p.stat().st_size > 8 * prefix_tokens]
    for path in rng.sample(files, num_prefixes):
        ids = tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)[:prefix_tokens]
        head = tok.decode(ids)
        prefixes.append(head[: head.rfind("\n") + 1] or head)
    openings = load_dataset(DatasetConfig(name="python", num_prompts=n, input_len=48, output_len=output_len,
                                          seed=seed + 1), tok)
    out = []
    for i, o in enumerate(openings):
        prompt = prefixes[i % num_prefixes] + "\n\n" + o.prompt
        out.append(BenchRequest(prompt, len(tok.encode(prompt)), output_len))
    rng.shuffle(out)
    return out


def _prefix_figs(res: dict[str, Any]) -> dict[str, Any]:
    pc = res.get("prefix_cache") or {}
    prompt = res["total_input_tokens"]
    cached = pc.get("cached_tokens") or 0
    return {"ttft_p50_ms": res["median_ttft_ms"], "ttft_p99_ms": res["p99_ttft_ms"], "prompt_tokens": prompt,
            "computed_tokens": prompt - cached, "hit_rate": pc.get("hit_rate")}


def act_prefix(setup: DemoSetup, off_srv: LocalServer) -> Act:
    t0 = time.perf_counter()
    # Prefill of a 1,000-token prompt takes most of a second on one core here: the requests go
    # one after another (as a user's session would), so TTFT is the prefill, not a queue.
    n, prefix_tokens = (6, 512) if setup.quick else (10, 1024)  # --quick: the tests' time
    reqs = shared_prefix_requests(setup.tokenizer, n, num_prefixes=2, prefix_tokens=prefix_tokens, output_len=16,
                                  seed=30)
    kw = {"max_concurrency": 1, "num_warmups": 0}
    off = _measure(setup, off_srv.url, reqs, "caching off", **kw)
    with setup.server(["--enable-prefix-caching"]) as srv:
        on = _measure(setup, srv.url, reqs, "caching on", **kw)
    figs = {"off": _prefix_figs(off), "on": _prefix_figs(on), "prefix_tokens": prefix_tokens}
    rows = []
    for name, f in (("off", figs["off"]), ("on", figs["on"])):
        rows.append([name, _f(f["ttft_p50_ms"], 0), _f(f["ttft_p99_ms"], 0), str(f["computed_tokens"]),
                     str(f["prompt_tokens"]), "-" if f["hit_rate"] is None else f"{f['hit_rate']:.0%}"])
    return Act("prefix", "3. Prefix caching", ["prefix caching", "TTFT P50 ms", "TTFT P99 ms",
                                                "prompt tokens computed", "prompt tokens", "hit rate"],
               rows, verdicts.prefix_verdict(figs), figs,
               [("time to first token (P50)", "ms", [("caching off", figs["off"]["ttft_p50_ms"]),
                                                      ("caching on", figs["on"]["ttft_p50_ms"])]),
                ("prompt tokens computed", "tokens", [("caching off", figs["off"]["computed_tokens"]),
                                                       ("caching on", figs["on"]["computed_tokens"])])],
               [_bench_cmd(f"--num-prompts {n} --max-concurrency 1 --prefix-repetition-prefix-len {prefix_tokens} "
                           "--prefix-repetition-num-prefixes 2 --prefix-repetition-output-len 16",
                           dataset="prefix_repetition") + "  # against a server with and without prefix caching"],
               note=f"{n} requests, one at a time: {len(set(r.prompt[:200] for r in reqs))} source files' first "
                    f"{prefix_tokens} tokens, each followed by a different short question. The first request per "
                    "prefix computes it; with caching on, the rest find its KV blocks.",
               seconds=time.perf_counter() - t0)


# -- act 4: memory -------------------------------------------------------------------------------

ALLOC_CONFS = ("", "max_split_size_mb:128,garbage_collection_threshold:0.8", "expandable_segments:True")


def act_memory(setup: DemoSetup) -> Act:
    from tailserve.demo.capacity import bytes_per_token, mixed_workload, run_capacity
    from tailserve.engine.llm import LLM
    from tailserve.memory.allocator.record import record_generation_trace
    from tailserve.memory.allocator.simulator import ALERT_THRESHOLD, simulate_trace
    from tailserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    mib = 1 << 20
    # The allocator: the engine's own allocation trace (torch.profiler on the CPU), as
    # ``tailserve memory record`` takes it, replayed under each setting.
    llm = LLM(setup.model_dir, enable_metrics=False)
    per_token = bytes_per_token(llm)
    block = llm.engine.config.block_size
    vocab = llm.engine.arch.vocab_size
    n_trace, trace_tokens = (4, 8) if setup.quick else (8, 16)
    prompts = [r.prompt for r in _python(setup, n_trace, 128, trace_tokens, seed=40)]
    events = record_generation_trace(llm, prompts, SamplingParams(max_tokens=trace_tokens, temperature=0,
                                                                  ignore_eos=True))
    llm.shutdown()
    del llm
    default_peak = simulate_trace(events, "").peak_reserved_bytes
    # The monitor's own floor (1 GiB) is sized for a GPU; this trace peaks at a few MiB, so the
    # floor here is a quarter of the default setting's peak: ratios taken while almost nothing is
    # reserved stay out, as they do on a GPU.
    floor = max(default_peak // 4, block)
    sims = [simulate_trace(events, c, alert_min_reserved_bytes=floor) for c in ALLOC_CONFS]
    alloc_rows = [{"conf": r.conf or "default", "peak_reserved_mib": r.peak_reserved_bytes / mib,
                   "peak_allocated_mib": r.peak_allocated_bytes / mib, "stranded_at_peak": r.stranded_at_peak,
                   "max_stranded_above_floor": r.max_stranded_above_floor, "alert_fires": r.alert_fires,
                   "oom": r.oom, "retries": r.num_alloc_retries} for r in sims]
    # KV capacity: room for `fit` whole contexts of max_len tokens, the same bytes both ways.
    max_len, fit = 1024, 4
    kv_bytes = fit * max_len * per_token
    n = 16 if setup.quick else 32
    work = mixed_workload(n, seed=41, prompt_range=(32, 400), output_range=(16, 48 if setup.quick else 64),
                          vocab=vocab)
    cap = {kind: run_capacity(kind, work, kv_bytes, max_len, model=setup.model_dir) for kind in ("paged", "contiguous")}
    figs = {"capacity": {"kv_mib": kv_bytes / mib, "max_model_len": max_len, "requests": n, **cap},
            "allocator": alloc_rows, "alert_threshold": ALERT_THRESHOLD, "alert_floor_mib": floor / mib,
            "trace_events": len(events)}
    rows = [[kind, str(c["max_concurrent"]), _f(c["mean_concurrent"]), _f(c["tok_s"], 0), str(c["preemptions"]),
             _f(c["mean_wasted_mib"], 2)] for kind, c in cap.items()]
    arows = [[r["conf"], _f(r["peak_reserved_mib"]), _f(r["peak_allocated_mib"]), f"{r['stranded_at_peak']:.0%}",
              f"{r['max_stranded_above_floor']:.0%}", "fires" if r["alert_fires"] else "no",
              "yes" if r["oom"] else "no"] for r in alloc_rows]
    return Act("memory", "4. Memory", ["KV cache", "most running at once", "mean running", "tokens/s", "preemptions",
                                      "reserved but empty MiB"],
              rows, verdicts.memory_verdict(figs), figs,
              [("sequences running at once", "seqs", [(k, c["max_concurrent"]) for k, c in cap.items()]),
               ("peak reserved under each PYTORCH_CUDA_ALLOC_CONF (model)", "MiB",
                [(r["conf"], r["peak_reserved_mib"]) for r in alloc_rows])],
              ["python benchmarks/bench_kv_capacity.py --kv-cache-memory 48MiB  # paged vs contiguous, longer run",
               "tailserve memory record --model MODEL_DIR --out trace.jsonl",
               "tailserve memory simulate trace.jsonl " + " ".join(f"--conf '{c}'" for c in ALLOC_CONFS[1:]),
               "tailserve memory analyze SNAPSHOT.pickle  # a real GPU's torch.cuda.memory._dump_snapshot()"],
              note=f"KV capacity: {n} requests (prompts 32-400 tokens) queued at once into {kv_bytes / mib:.1f} MiB of "
                   f"KV cache, room for {fit} whole {max_len}-token contexts; paging allocates a {block}-token block "
                   f"when a sequence reaches it, the contiguous baseline reserves {max_len} tokens per sequence at "
                   f"admission. Allocator: {len(events)} allocation events of this engine generating on the CPU "
                   f"(torch.profiler), replayed through tailserve's model of the CUDA caching allocator; the alert "
                   f"floor is {floor / mib:.1f} MiB here (the monitor's 1 GiB is sized for a GPU). A model, not a "
                   "measurement of a GPU.",
              seconds=time.perf_counter() - t0,
              extra_table=(["PYTORCH_CUDA_ALLOC_CONF", "peak reserved MiB", "peak allocated MiB", "stranded at peak",
                            "max stranded above floor", f"alert (>{ALERT_THRESHOLD:.0%})", "out of memory"], arows))
