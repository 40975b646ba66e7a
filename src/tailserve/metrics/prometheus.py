"""Prometheus metrics for one engine, named and defined like vLLM's ``vllm:*`` ones.

Each engine owns its own ``CollectorRegistry`` (so several engines can live in one process,
as in tests). Latency histograms use geometric buckets, 1.25x apart from 0.5 ms to ~10 min:
with ``histogram_quantile``'s linear interpolation inside a bucket, any quantile is within
25% of the truth at CPU-scale (seconds) and GPU-scale (milliseconds) latencies alike.
Exact and sketch percentiles are in ``tailserve.metrics.quantiles``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tailserve.metrics.timeline import RequestMetrics, StepStats


def latency_buckets(lo: float = 5e-4, hi: float = 600.0, factor: float = 1.25) -> list[float]:
    out = []
    v = lo
    while v < hi:
        out.append(round(v, 6))
        v *= factor
    return out


def token_buckets(hi: int = 1 << 17) -> list[float]:
    out, v = [], 1
    while v <= hi:
        out += [v, int(v * 1.5)] if v >= 2 else [v]
        v *= 2
    return sorted(set(float(x) for x in out))


class PrometheusMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        lat = latency_buckets()

        def hist(name: str, doc: str, buckets: list[float] = lat) -> Histogram:
            return Histogram(name, doc, lab, buckets=buckets, registry=r)

        self.ttft = hist("tailserve:time_to_first_token_seconds", "Time to first token (arrival to first token).")
        self.itl = hist("tailserve:inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.tpot = hist("tailserve:request_time_per_output_token_seconds",
                         "Decode time / (output tokens - 1), per request.")
        self.e2el = hist("tailserve:e2e_request_latency_seconds", "Arrival to last token, per request.")
        self.queue = hist("tailserve:request_queue_time_seconds", "Arrival to first scheduled.")
        self.prefill = hist("tailserve:request_prefill_time_seconds", "First scheduled to first token.")
        self.decode = hist("tailserve:request_decode_time_seconds", "First token to last token.")
        self.inference = hist("tailserve:request_inference_time_seconds", "First scheduled to last token.")
        self.prompt_len = hist("tailserve:request_prompt_tokens", "Prompt tokens per request.", token_buckets())
        self.gen_len = hist("tailserve:request_generation_tokens", "Output tokens per request.", token_buckets())
        self.step_time = hist("tailserve:engine_step_duration_seconds", "Wall time of one engine step.")

        self.prompt_tokens = Counter("tailserve:prompt_tokens", "Prompt tokens of finished requests.", lab, registry=r)
        self.generation_tokens = Counter("tailserve:generation_tokens", "Generated tokens.", lab, registry=r)
        self.preemptions = Counter("tailserve:num_preemptions", "Requests preempted (recomputed later).", lab,
                                   registry=r)
        self.prefix_queries = Counter("tailserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      lab, registry=r)
        self.prefix_hits = Counter("tailserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", lab,
                                   registry=r)
        self.success = Counter("tailserve:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.running = Gauge("tailserve:num_requests_running", "Requests in the running batch.", lab, registry=r)
        self.waiting = Gauge("tailserve:num_requests_waiting", "Requests waiting (incl. preempted).", lab, registry=r)
        self.kv_usage = Gauge("tailserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", lab,
                              registry=r)
        self.kv_token_util = Gauge("tailserve:kv_cache_token_utilization",
                                   "Live tokens / token slots of allocated KV blocks (0-1).", lab, registry=r)
        self.kv_blocks_total = Gauge("tailserve:kv_cache_blocks_total", "KV-cache blocks in the pool.", lab,
                                     registry=r)
        self.spec_drafts = Counter("tailserve:spec_decode_num_drafts", "Verification rounds with drafts.", lab,
                                   registry=r)
        self.spec_draft_tokens = Counter("tailserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", lab,
                                         registry=r)
        self.spec_accepted = Counter("tailserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lab,
                                     registry=r)
        self.spec_accepted_pos = Counter("tailserve:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft.",
                                         ["model_name", "position"], registry=r)
        self.model_name = model_name
        self._last_queries = 0
        self._last_hits = 0

    def observe_step(self, s: StepStats, prefix_queries_total: int, prefix_hits_total: int) -> None:
        m = self.model_name
        self.step_time.labels(m).observe(s.duration_s)
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        self.kv_usage.labels(m).set(s.kv_blocks_used / s.kv_blocks_total)
        self.kv_token_util.labels(m).set(s.kv_token_utilization)
        self.kv_blocks_total.labels(m).set(s.kv_blocks_total)
        if s.num_preemptions:
            self.preemptions.labels(m).inc(s.num_preemptions)
        if prefix_queries_total > self._last_queries:
            self.prefix_queries.labels(m).inc(prefix_queries_total - self._last_queries)
            self._last_queries = prefix_queries_total
        if prefix_hits_total > self._last_hits:
            self.prefix_hits.labels(m).inc(prefix_hits_total - self._last_hits)
            self._last_hits = prefix_hits_total

    def observe_spec(self, num_draft_tokens: int, num_accepted: int) -> None:
        m = self.model_name
        self.spec_drafts.labels(m).inc()
        self.spec_draft_tokens.labels(m).inc(num_draft_tokens)
        self.spec_accepted.labels(m).inc(num_accepted)
        for pos in range(num_accepted):
            self.spec_accepted_pos.labels(m, str(pos)).inc()

    def observe_tokens(self, n: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(n)

    def observe_finished(self, rm: RequestMetrics) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(rm.num_prompt_tokens)
        self.success.labels(m, rm.finish_reason or "unknown").inc()
        self.prompt_len.labels(m).observe(rm.num_prompt_tokens)
        self.gen_len.labels(m).observe(rm.num_output_tokens)
        if rm.num_output_tokens == 0:
            return  # aborted before its first token: no latency figures to record
        self.ttft.labels(m).observe(rm.ttft_s)
        self.e2el.labels(m).observe(rm.e2el_s)
        self.queue.labels(m).observe(rm.queue_s)
        self.prefill.labels(m).observe(rm.prefill_s)
        self.decode.labels(m).observe(rm.decode_s)
        self.inference.labels(m).observe(rm.prefill_s + rm.decode_s)
        if rm.tpot_s is not None:
            self.tpot.labels(m).observe(rm.tpot_s)
        for gap in rm.itl_s:
            self.itl.labels(m).observe(gap)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
