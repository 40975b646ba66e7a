"""A run's figures: the result dict (keys and units as ``vllm bench serve`` writes them, so
scripts written for its JSON read ours), plus the client/server join and what only
tailserve reports.

Definitions (client side, per successful request; times from when its headers were sent):
TTFT = first content event; TTST = second content event; E2EL = end of stream;
TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = gaps between content events. Output
tokens come from the server's ``usage`` (or the tokenizer, or the event count). Metric
lists in the dict (``ttfts``, ``itls``) are in seconds; ``*_ms`` keys in milliseconds.
"""

from __future__ import annotations

import datetime
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from tailserve.bench.client import ERROR_KINDS, RequestRecord
from tailserve.bench.load import LoadRun
from tailserve.bench.saturation import check_oversaturation, in_flight
from tailserve.errors import ConfigError
from tailserve.metrics.attribution import attribute_tail, phase_times
from tailserve.metrics.prefix_break import role_kind
from tailserve.metrics.timeline import RequestMetrics

METRICS = ("ttft", "ttst", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el", "ttst")
SATURATED_SEND_LAG_S = 0.010  # a client whose P99 send lag exceeds this is part of the measurement
NOT_ATTRIBUTABLE = ("not attributable: the server reports no per-request timings (tailserve and llama.cpp's "
                    "server always do; start vLLM >= 0.25 with --enable-per-request-metrics)")


def parse_percentiles(text: str) -> list[float]:
    try:
        ps = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--metric-percentiles: expected numbers like 50,99,99.9, got {text!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ConfigError("--metric-percentiles: each must be in (0, 100]")
    return ps


def parse_metric_names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise ConfigError(f"--percentile-metrics: unknown {', '.join(bad) or 'empty list'}; choose from "
                          f"{', '.join(METRICS)}")
    return names


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``--goodput ttft:500 tpot:50`` (milliseconds), as vllm bench serve."""
    out: dict[str, float] = {}
    for item in items or ():
        key, sep, val = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ConfigError(f"--goodput: expected KEY:MS with KEY in {', '.join(GOODPUT_KEYS)}, got {item!r}")
        try:
            out[key] = float(val)
        except ValueError:
            raise ConfigError(f"--goodput: {item!r}: the bound must be a number of milliseconds") from None
        if out[key] <= 0:
            raise ConfigError(f"--goodput: {item!r}: the bound must be positive")
    return out


def p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(values_s: Sequence[float], ps: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    if arr.size == 0:
        arr = np.zeros(1)  # vLLM reports zeros for an empty metric; so do we
    d = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in ps:
        d[f"p{p_word(p)}"] = float(np.percentile(arr, p))
    return d


def metric_values(records: Sequence[RequestRecord], metric: str) -> list[float]:
    ok = [r for r in records if r.success]
    if metric == "itl":
        return [x for r in ok for x in r.itl_s]
    vals = [getattr(r, f"{metric}_s") for r in ok]
    return [v for v in vals if v is not None]


def _good(r: RequestRecord, slo: dict[str, float]) -> bool:
    for key, bound_ms in slo.items():
        v = getattr(r, f"{key}_s")
        if key == "tpot" and v is None:
            continue  # a one-token answer has no TPOT; it cannot miss that bound
        if v is None or v * 1e3 > bound_ms:
            return False
    return True


def _peak_throughput(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """Highest output tokens in any one-second window, and the requests in flight then.
    A request's tokens are spread evenly over its content events."""
    ok = [r for r in records if r.success and r.chunk_s]
    if not ok:
        return 0.0, 0
    end = max(r.chunk_s[-1] for r in ok)
    buckets = np.zeros(int(end) + 1)
    for r in ok:
        per = r.output_tokens / len(r.chunk_s)
        for t in r.chunk_s:
            buckets[int(t)] += per
    peak = int(np.argmax(buckets))
    live = sum(1 for r in ok if r.start_s < peak + 1 and (r.end_s or 0) >= peak)
    return float(buckets[peak]), live


def saturation_figures(run: LoadRun) -> dict[str, Any]:
    """The over-saturation test (bench/saturation.py): the live one that stopped the level, or
    the same test over the finished level's records."""
    if run.stopped is not None:
        return {**run.stopped.to_dict(), "stopped_sending": True, "sent": len(run.records)}
    recs = [r for r in run.records if r.turn == 0]
    last_send = max((r.start_s for r in recs), default=0.0)
    t, conc = in_flight([r.start_s for r in recs], [r.end_s for r in recs], last_send)
    points = [(r.start_s + r.ttft_s, r.ttft_s) for r in recs
              if r.ttft_s is not None and r.start_s + r.ttft_s <= last_send]
    verdict = check_oversaturation(points, t, conc, last_send, run.config.oversaturation_min_window_s)
    return {**verdict.to_dict(), "stopped_sending": False}


def probe_figures(probes: Sequence[RequestRecord], rate: float, percentiles: Sequence[float]) -> dict[str, Any]:
    """--probe-request-rate's 1-token requests, apart from the load: what a short request saw."""
    ok = [p for p in probes if p.success and p.ttft_s is not None]
    out: dict[str, Any] = {"rate": rate, "sent": len(probes), "completed": len(ok), "failed": len(probes) - len(ok)}
    for name, vals in (("ttft", [p.ttft_s for p in ok]), ("e2el", [p.e2el_s for p in ok])):
        vs = np.asarray([v for v in vals if v is not None], dtype=float) * 1e3
        out[f"{name}_ms"] = {f"p{p:g}": float(np.percentile(vs, p)) for p in percentiles} if len(vs) else None
    return out


def join_server_timings(records: Sequence[RequestRecord]) -> list[RequestMetrics]:
    """One ``RequestMetrics`` per successful request that the server timed, with the
    client's TTFT and E2EL beside the server's phases (joined by the request's own record,
    which carries the server's answer for its ``X-Request-Id``)."""
    out = []
    for r in records:
        if not r.success or r.server is None or r.ttft_s is None:
            continue
        s = r.server
        out.append(RequestMetrics(
            request_id=r.request_id, num_prompt_tokens=r.server_prompt_tokens or r.prompt_len,
            num_cached_tokens=s.cached_tokens if s.cached_tokens is not None else r.cached_tokens or 0,
            num_output_tokens=r.output_tokens, queue_s=s.queue_s,
            prefill_s=s.prefill_s, ttft_s=s.ttft_s, decode_s=s.decode_s, e2el_s=s.e2e_s, tpot_s=r.tpot_s, itl_s=(),
            num_preemptions=s.preemptions, preempted_s=0.0, client_ttft_s=r.ttft_s, client_e2el_s=r.e2el_s))
    return out


def attribution(records: Sequence[RequestRecord], send_lag_p99_s: float | None,
                speculative: bool = False, joined: list[RequestMetrics] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    joined = join_server_timings(records) if joined is None else joined
    if not joined:
        return {"attributable": False, "verdict": NOT_ATTRIBUTABLE, "num_joined": 0, "num_successful": len(ok)}
    tail = attribute_tail(joined, speculative=speculative)
    sources = dict(Counter(r.server.source for r in records if r.success and r.server is not None))
    verdict = tail.verdict
    if tail.dominant == "network" and send_lag_p99_s is not None and send_lag_p99_s > SATURATED_SEND_LAG_S:
        verdict += (f" The client itself lagged (P99 send lag {send_lag_p99_s * 1e3:.1f} ms): part of this is the "
                    "load generator; run it on more cores or at a lower rate.")
    coverage = "" if len(joined) == len(ok) else f" (server timings for {len(joined)} of {len(ok)} requests)"
    phases = [phase_times(m) for m in joined]
    net_ttft = [max(0.0, m.client_ttft_s - m.ttft_s) for m in joined if m.client_ttft_s is not None]
    return {
        "attributable": True, "verdict": verdict + coverage, "num_joined": len(joined), "num_successful": len(ok),
        "source": max(sources, key=sources.__getitem__), "sources": sources,
        "p50_e2el_ms": tail.p50_s * 1e3, "p99_e2el_ms": tail.p99_s * 1e3, "p99_over_p50": tail.ratio,
        "dominant": tail.dominant, "share": tail.share, "excess_ms": {k: v * 1e3 for k, v in tail.excess_s.items()},
        "tail_count": tail.tail_count, "median_count": tail.median_count,
        "median_phase_ms": {k: float(np.median([p[k] for p in phases])) * 1e3 for k in phases[0]},
        "p99_network_ttft_ms": float(np.percentile(net_ttft, 99)) * 1e3 if net_ttft else None,
        "median_network_ttft_ms": float(np.median(net_ttft)) * 1e3 if net_ttft else None,
    }


def per_request_phases(records: Sequence[RequestRecord],
                       joined: list[RequestMetrics] | None = None) -> list[dict[str, float] | None]:
    by_id = {m.request_id: m for m in (join_server_timings(records) if joined is None else joined)}
    return [{k: v * 1e3 for k, v in phase_times(by_id[r.request_id]).items()} if r.request_id in by_id else None
            for r in records]


def _cached(r: RequestRecord) -> int | None:
    if r.cached_tokens is not None:
        return r.cached_tokens
    return r.server.cached_tokens if r.server is not None else None


def _break_kind(r: RequestRecord) -> str:
    """The kind of prompt segment where a request left the server's prefix cache."""
    pc = r.server.prefix_cache if r.server is not None else None
    seg = pc.get("break_segment") if pc else None
    if seg == "tools":
        return "tools"
    if isinstance(seg, str) and seg.startswith("messages[") and seg.endswith("]"):
        i = int(seg[9:-1]) if seg[9:-1].isdigit() else -1
        return role_kind(r.roles[i]) if 0 <= i < len(r.roles) else "other"
    return "other"


def prefix_cache_figures(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Prompt and cached tokens over the successful requests (the hit rate), and the
    recomputed tokens by the kind of segment where each left the cache, when the server says
    (tailserve's ``timing.prefix_cache``). None when no response carried cached tokens."""
    ok = [r for r in records if r.success and _cached(r) is not None]
    if not ok:
        return None
    prompt = sum(r.server_prompt_tokens or r.prompt_len for r in ok)
    cached = sum(_cached(r) or 0 for r in ok)
    by_segment: dict[str, int] | None = None
    located = [r for r in ok if r.server is not None and r.server.prefix_cache]
    if located:
        by_segment = {}
        for r in located:
            n = (r.server_prompt_tokens or r.prompt_len) - (_cached(r) or 0)
            k = _break_kind(r)
            by_segment[k] = by_segment.get(k, 0) + max(n, 0)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
            "recomputed_tokens_by_segment": by_segment}


def turn_figures(records: Sequence[RequestRecord], ps: Sequence[float] = (50, 99)) -> list[dict[str, Any]]:
    """Per turn index of multi-turn and agentic sessions: requests, TTFT and E2EL percentiles
    (ms), mean prompt and cached tokens, the hit rate."""
    out = []
    for turn in sorted({r.turn for r in records}):
        rs = [r for r in records if r.turn == turn and r.success]
        row: dict[str, Any] = {"turn": turn, "completed": len(rs),
                               "failed": sum(1 for r in records if r.turn == turn and not r.success)}
        for m in ("ttft", "e2el"):
            vals = metric_values(rs, m)
            for p in ps:
                row[f"p{p:g}_{m}_ms"] = float(np.percentile(vals, p)) * 1e3 if vals else None
        prompts = [r.server_prompt_tokens or r.prompt_len for r in rs]
        cached = [c for r in rs if (c := _cached(r)) is not None]
        row["mean_prompt_tokens"] = float(np.mean(prompts)) if prompts else None
        row["mean_cached_tokens"] = float(np.mean(cached)) if cached else None
        row["hit_rate"] = sum(cached) / sum(prompts) if cached and len(cached) == len(rs) and sum(prompts) else None
        out.append(row)
    return out


def session_figures(records: Sequence[RequestRecord], ps: Sequence[float] = (50, 99)) -> dict[str, Any] | None:
    """End to end per session (first turn's send to last turn's end, think times included),
    over the sessions whose every turn succeeded."""
    by: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.conversation is not None:
            by.setdefault(r.conversation, []).append(r)
    spans = [max(r.end_s for r in rs) - min(r.start_s for r in rs)  # type: ignore[type-var]
             for rs in by.values() if all(r.success for r in rs)]
    if not by:
        return None
    return {"sessions": len(by), "completed": len(spans),
            **{f"p{p:g}_e2e_ms": float(np.percentile(spans, p)) * 1e3 if spans else None for p in ps}}


def build_result(run: LoadRun, percentile_metrics: Sequence[str], percentiles: Sequence[float],
                 goodput: dict[str, float] | None = None, label: str | None = None,
                 tokenizer_id: str | None = None, dataset_name: str | None = None) -> dict[str, Any]:
    records = run.records
    ok = [r for r in records if r.success]
    dur = run.duration_s
    total_in = sum((r.server_prompt_tokens or r.prompt_len) for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    cfg = run.config
    endpoint_type = "openai-chat" if cfg.chat else "openai"
    peak_tps, peak_conc = _peak_throughput(records)
    errors_by_kind = {k: 0 for k in ERROR_KINDS}
    for r in records:
        if r.error_kind:
            errors_by_kind[r.error_kind] = errors_by_kind.get(r.error_kind, 0) + 1
    lags = [r.send_lag_s for r in records if r.send_lag_s is not None]
    lag_p99 = float(np.percentile(lags, 99)) if lags else None
    good = sum(1 for r in ok if _good(r, goodput)) if goodput else None
    result: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": endpoint_type, "backend": endpoint_type, "label": label or endpoint_type,
        "model_id": run.model, "tokenizer_id": tokenizer_id, "dataset_name": dataset_name,
        "num_prompts": len({(r.index, r.turn) for r in records}),
        "request_rate": cfg.request_rate if not math.isinf(cfg.request_rate) else "inf",
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
        "duration": dur, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur if dur > 0 else 0.0,
        "request_goodput": (good / dur if dur > 0 else 0.0) if good is not None else None,
        "output_throughput": total_out / dur if dur > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / dur if dur > 0 else 0.0,
        "input_lens": [(r.server_prompt_tokens or r.prompt_len) for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft_s or 0.0 for r in records],
        "itls": [r.itl_s for r in records],
        "latencies": [r.e2el_s or 0.0 for r in records],
        "start_times": [r.start_s for r in records],
        "queue_times": [r.client_queue_s for r in records],
        "generated_texts": [r.text for r in records],
        "errors": [r.error for r in records],
        "max_output_tokens_per_s": peak_tps, "max_concurrent_requests": peak_conc,
    }
    for m in percentile_metrics:
        st = _stats(metric_values(records, m), percentiles)
        for k, v in st.items():
            result[f"{k}_{m}_ms"] = v
    counters = run.counters.summary()
    for k, v in counters.items():
        if v is not None:
            result[k] = v
    result["goodput_slo_ms"] = goodput or None
    result["errors_by_kind"] = errors_by_kind
    result["client"] = {
        "clock": "time.perf_counter; tokens stamped when the socket read returns",
        "http_version": "2 (h2c prior knowledge)" if cfg.http2 else "1.1",
        "keep_alive": cfg.keep_alive, "num_warmups": run.num_warmups,
        "mean_send_lag_ms": float(np.mean(lags)) * 1e3 if lags else None,
        "p99_send_lag_ms": lag_p99 * 1e3 if lag_p99 is not None else None,
        "max_send_lag_ms": float(np.max(lags)) * 1e3 if lags else None,
        "saturated": bool(lag_p99 is not None and lag_p99 > SATURATED_SEND_LAG_S),
        # Requests sent again because the server had closed their kept-alive connection in
        # the pool without a ``Connection: close`` (bench/client.py).
        "resends": sum(r.resends for r in records),
    }
    result["server_metrics_available"] = run.counters.available
    joined = join_server_timings(records)
    result["attribution"] = attribution(records, lag_p99, speculative=bool(counters.get("spec_decode_draft_tokens")),
                                        joined=joined)
    result["prefix_cache"] = prefix_cache_figures(records)
    result["saturation"] = saturation_figures(run)
    if run.config.probe_rate:
        result["probes"] = probe_figures(run.probes, run.config.probe_rate, percentiles)
    if any(r.conversation is not None for r in records):
        result["turns"] = turn_figures(records)
        result["session_e2e"] = session_figures(records)
    phases = per_request_phases(records, joined)
    result["requests"] = [{**r.as_dict(), "phases_ms": ph} for r, ph in zip(records, phases)]
    return result
