"""Prometheus metrics for one engine, named and defined like vLLM's ``vllm:*`` ones.

Each engine owns its own ``CollectorRegistry`` (so several engines can live in one process,
as in tests). Latency histograms use geometric buckets, 1.25x apart from 0.5 ms to ~10 min:
with ``histogram_quantile``'s linear interpolation inside a bucket, any quantile is within
25% of the truth at CPU-scale (seconds) and GPU-scale (milliseconds) latencies alike.
Exact and sketch percentiles are in ``tailserve.metrics.quantiles``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from tailserve.metrics.timeline import RequestMetrics, StepStats


class KVGaugeSource(Protocol):
    """What ``observe_kv`` reads (``memory.kv_figures.KVCacheFigures`` has it; metrics sit
    below memory, so they name the fields, not the class)."""

    num_blocks: int
    num_cached_blocks: int
    num_shared_blocks: int
    prefix_queries_requests: int
    prefix_hits_requests: int
    num_evictions: int
    num_pinned_blocks: int
    pinned_hits: int
    pinned_taken: int

    @property
    def block_utilization(self) -> float: ...

    @property
    def token_utilization(self) -> float: ...

    @property
    def internal_fragmentation(self) -> float: ...

    @property
    def blocks_saved_by_sharing(self) -> int: ...


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


# The load gauges that Kubernetes inference gateways' endpoint pickers read, under the vLLM
# names they look for (the Gateway API Inference Extension's model-server protocol; llm-d's
# scheduler reads the same): vLLM name -> the tailserve gauge it mirrors. Both usage names:
# vLLM V1 says kv_cache_usage_perc, older pickers read gpu_cache_usage_perc. Like vLLM's,
# the "perc" gauges are fractions 0-1.
GATEWAY_GAUGES = {
    "vllm:num_requests_waiting": ("waiting", "Requests waiting to be scheduled (tailserve:num_requests_waiting)."),
    "vllm:num_requests_running": ("running", "Requests in the running batch (tailserve:num_requests_running)."),
    "vllm:kv_cache_usage_perc": ("kv_usage", "KV-cache blocks in use, 0-1 (tailserve:kv_cache_usage_perc)."),
    "vllm:gpu_cache_usage_perc": ("kv_usage", "Same as vllm:kv_cache_usage_perc (the name older gateways read)."),
}


# The request-phase histograms under vLLM's names (same meanings, seconds), for dashboards and
# autoscalers built on vLLM's: vLLM name -> the tailserve histogram it mirrors. They keep
# tailserve's buckets (0.5 ms up, 1.25x apart), fine enough for sub-100 ms SLOs, where vLLM's
# own request-phase buckets start at 0.3 s; histogram_quantile reads either.
GATEWAY_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:request_time_per_output_token_seconds": "tpot",
    "vllm:e2e_request_latency_seconds": "e2el",
    "vllm:request_queue_time_seconds": "queue",
    "vllm:request_prefill_time_seconds": "prefill",
    "vllm:request_decode_time_seconds": "decode",
    "vllm:request_inference_time_seconds": "inference",
}


class _GatewayCollector:
    """Mirrors tailserve's load gauges and request-phase histograms under the vLLM names, read
    from them at every scrape (no second copy to keep in step, so the counts always agree),
    plus ``vllm:cache_config_info`` whose labels give the block size and the number of blocks
    (the prefix-aware scorer's optional inputs). No LoRA info gauge: tailserve serves no LoRA
    adapters, and the pickers treat its absence as no adapters."""

    def __init__(self, metrics: PrometheusMetrics, block_size: int, num_blocks: int,
                 enable_prefix_caching: bool, cache_dtype: str) -> None:
        self.metrics = metrics
        self.cache_labels = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks),
                             "enable_prefix_caching": str(enable_prefix_caching), "cache_dtype": cache_dtype}

    def collect(self):
        for name, (key, doc) in GATEWAY_GAUGES.items():
            fam = GaugeMetricFamily(name, doc, labels=["model_name"])
            for metric in getattr(self.metrics, key).collect():
                for sample in metric.samples:
                    fam.add_metric([sample.labels["model_name"]], sample.value)
            yield fam
        for name, key in GATEWAY_HISTOGRAMS.items():
            for metric in getattr(self.metrics, key).collect():
                hfam = HistogramMetricFamily(name, f"{metric.documentation} (mirrors tailserve:{name[5:]})",
                                             labels=["model_name"])
                buckets: dict[str, list[tuple[str, float]]] = {}
                sums: dict[str, float] = {}
                for sample in metric.samples:
                    model = sample.labels["model_name"]
                    if sample.name.endswith("_bucket"):
                        buckets.setdefault(model, []).append((sample.labels["le"], sample.value))
                    elif sample.name.endswith("_sum"):
                        sums[model] = sample.value
                for model, bs in buckets.items():
                    hfam.add_metric([model], bs, sums.get(model, 0.0))
                yield hfam
        info = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration (value 1; see the labels).",
                                 labels=["model_name", *self.cache_labels])
        info.add_metric([self.metrics.model_name, *self.cache_labels.values()], 1.0)
        yield info


class PrometheusMetrics:
    def __init__(self, model_name: str,
                 custom_buckets: Sequence[tuple[str, Sequence[float]]] | None = None) -> None:
        """``custom_buckets``: (family, upper bounds) pairs (``--custom-histogram-buckets``,
        config.HISTOGRAM_FAMILIES) replacing the default buckets of every histogram of a family."""
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        lat, tok = latency_buckets(), token_buckets()
        fam = {"request_latency": lat, "time_to_first_token": lat, "inter_token_latency": lat,
               "request_tokens": tok, "engine_step": lat}
        fam.update({f: list(b) for f, b in custom_buckets or ()})
        self.histogram_buckets = fam

        def hist(name: str, doc: str, family: str) -> Histogram:
            return Histogram(name, doc, lab, buckets=fam[family], registry=r)

        self.ttft = hist("tailserve:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                         "time_to_first_token")
        self.itl = hist("tailserve:inter_token_latency_seconds", "Time between consecutive output tokens.",
                        "inter_token_latency")
        self.tpot = hist("tailserve:request_time_per_output_token_seconds",
                         "Decode time / (output tokens - 1), per request.", "inter_token_latency")
        self.e2el = hist("tailserve:e2e_request_latency_seconds", "Arrival to last token, per request.",
                         "request_latency")
        self.queue = hist("tailserve:request_queue_time_seconds", "Arrival to first scheduled.", "request_latency")
        self.prefill = hist("tailserve:request_prefill_time_seconds", "First scheduled to first token.",
                            "request_latency")
        self.decode = hist("tailserve:request_decode_time_seconds", "First token to last token.", "request_latency")
        self.inference = hist("tailserve:request_inference_time_seconds", "First scheduled to last token.",
                              "request_latency")
        self.prompt_len = hist("tailserve:request_prompt_tokens", "Prompt tokens per request.", "request_tokens")
        self.gen_len = hist("tailserve:request_generation_tokens", "Output tokens per request.", "request_tokens")
        self.step_time = hist("tailserve:engine_step_duration_seconds", "Wall time of one engine step.",
                              "engine_step")

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
        # accepted - success = requests in flight: a difference that stays above the running and
        # waiting gauges once the server is idle is a request the engine lost.
        self.accepted = Counter("tailserve:request_accepted", "Requests the engine accepted (each is counted "
                                "once more in request_success when it finishes or is aborted).", lab, registry=r)
        self.rejected = Counter("tailserve:request_rejected", "Requests turned away before the engine had them, "
                                "by reason (overloaded: HTTP 429 at the waiting bound).",
                                ["model_name", "reason"], registry=r)
        self.running = Gauge("tailserve:num_requests_running", "Requests in the running batch.", lab, registry=r)
        self.waiting = Gauge("tailserve:num_requests_waiting", "Requests waiting (incl. preempted).", lab, registry=r)
        self.kv_usage = Gauge("tailserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", lab,
                              registry=r)
        self.kv_token_util = Gauge("tailserve:kv_cache_token_utilization",
                                   "Live tokens / token slots of allocated KV blocks (0-1).", lab, registry=r)
        self.kv_blocks_total = Gauge("tailserve:kv_cache_blocks_total", "KV-cache blocks in the pool.", lab,
                                     registry=r)
        self.kv_blocks_cached = Gauge("tailserve:kv_cache_blocks_cached",
                                      "Free KV blocks that still hold a reusable prefix.", lab, registry=r)
        self.kv_blocks_shared = Gauge("tailserve:kv_cache_blocks_shared",
                                      "KV blocks held by more than one request (prefix hits, parallel samples).",
                                      lab, registry=r)
        self.kv_blocks_saved = Gauge("tailserve:kv_cache_blocks_saved_by_sharing",
                                     "KV blocks the holders of shared blocks would need beyond those allocated.",
                                     lab, registry=r)
        self.kv_internal_frag = Gauge("tailserve:kv_cache_internal_fragmentation",
                                      "Empty token slots / token slots of allocated KV blocks (0-1).", lab, registry=r)
        self.prefix_request_queries = Counter("tailserve:prefix_cache_request_queries",
                                              "Admissions that looked up the prefix cache.", lab, registry=r)
        self.prefix_request_hits = Counter("tailserve:prefix_cache_request_hits",
                                           "Admissions that found at least one cached block.", lab, registry=r)
        self.prefix_evictions = Counter("tailserve:prefix_cache_evictions",
                                        "Cached KV blocks evicted to be reused.", lab, registry=r)
        self.prefix_recomputed = Counter(
            "tailserve:prefix_cache_recomputed_tokens",
            "Prompt tokens computed rather than taken from the prefix cache, by the kind of prompt segment where "
            "the prompt left the cache (tools, system, user, assistant, tool; other: a full hit's last partial "
            "block, a completions prompt).", [*lab, "segment"], registry=r)
        self.kv_pinned = Gauge("tailserve:kv_cache_pinned_blocks",
                               "Free KV blocks pinned after a response that ended in a tool call (--tool-call-kv-ttl): "
                               "the last to be evicted until their pin ends.", lab, registry=r)
        self.kv_pinned_hits = Counter("tailserve:kv_cache_pinned_hits",
                                      "Pinned KV blocks a later request reused as prefix-cache hits.", lab, registry=r)
        self.kv_pinned_taken = Counter("tailserve:kv_cache_pinned_taken",
                                       "Pinned KV blocks handed out before their pin ended (nothing else was free).",
                                       lab, registry=r)
        self.suffix_requests = Gauge("tailserve:suffix_cache_requests",
                                     "Finished requests in suffix decoding's global cache.", lab, registry=r)
        self.suffix_bytes = Gauge("tailserve:suffix_cache_bytes",
                                  "Bytes of suffix decoding's global cache (tokens and occurrence lists).", lab,
                                  registry=r)
        self.spec_drafts = Counter("tailserve:spec_decode_num_drafts", "Verification rounds with drafts.", lab,
                                   registry=r)
        self.spec_draft_tokens = Counter("tailserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", lab,
                                         registry=r)
        self.spec_accepted = Counter("tailserve:spec_decode_num_accepted_tokens", "Draft tokens accepted.", lab,
                                     registry=r)
        self.spec_goodput_overrides = Counter(
            "tailserve:spec_decode_goodput_overrides",
            "Steps where the goodput objective chose another draft length than throughput would.", lab, registry=r)
        self._last_goodput_overrides = 0
        self.spec_accepted_pos = Counter("tailserve:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft.",
                                         ["model_name", "position"], registry=r)
        self.cuda_mem = {k: Gauge(f"tailserve:cuda_memory_{k}", doc, lab, registry=r) for k, doc in (
            ("reserved_bytes", "Bytes reserved by PyTorch's CUDA caching allocator (last sample)."),
            ("allocated_bytes", "Bytes allocated to tensors (last sample)."),
            ("active_bytes", "Bytes in active blocks (last sample)."),
            ("inactive_split_bytes", "Free bytes stranded in partly used segments (last sample)."),
            ("requested_bytes", "Bytes requested by tensors, before rounding (last sample)."),
            ("num_alloc_retries", "Allocations that freed the cache and retried (cumulative, last sample)."),
            ("num_ooms", "Out-of-memory errors of the allocator (cumulative, last sample)."),
            ("inactive_split_over_reserved", "Fragmentation alerted on: inactive split / reserved."),
            ("unallocated_over_reserved", "(reserved - allocated) / reserved, incl. releasable cache."),
            ("one_minus_peak_ratio", "1 - peak active / peak reserved."))}
        self.fragmentation_episodes = Counter("tailserve:cuda_memory_fragmentation_episodes",
                                              "Fragmentation alert episodes.", lab, registry=r)
        self._last_episodes = 0
        self.alloc_conf_info = Gauge("tailserve:cuda_alloc_conf_info",
                                     "The PYTORCH_CUDA_ALLOC_CONF in force (1 for the series whose labels say it).",
                                     ["model_name", "conf", "source"], registry=r)
        self.model_name = model_name
        # Children for the model_name label, resolved once: .labels() costs microseconds per call.
        self._c = {n: getattr(self, n).labels(model_name) for n in (
            "step_time", "running", "waiting", "kv_usage", "kv_token_util", "kv_blocks_total", "preemptions",
            "prefix_queries", "prefix_hits", "generation_tokens", "prompt_tokens", "prompt_len", "gen_len", "ttft",
            "e2el", "queue", "prefill", "decode", "inference", "tpot", "itl", "spec_drafts", "spec_draft_tokens",
            "spec_accepted", "kv_blocks_cached", "kv_internal_frag", "prefix_request_queries", "prefix_request_hits",
            "prefix_evictions", "kv_blocks_shared", "kv_blocks_saved", "accepted", "suffix_requests",
            "suffix_bytes", "kv_pinned", "kv_pinned_hits", "kv_pinned_taken", "spec_goodput_overrides")}
        self._last_queries = 0
        self._last_hits = 0
        self._last_kv_counts = (0, 0, 0, 0, 0)

    def observe_step(self, s: StepStats, prefix_queries_total: int, prefix_hits_total: int) -> None:
        self._c["step_time"].observe(s.duration_s)
        self._c["running"].set(s.num_running)
        self._c["waiting"].set(s.num_waiting)
        self._c["kv_usage"].set(s.kv_blocks_used / s.kv_blocks_total)
        self._c["kv_token_util"].set(s.kv_token_utilization)
        self._c["kv_blocks_total"].set(s.kv_blocks_total)
        if s.num_preemptions:
            self._c["preemptions"].inc(s.num_preemptions)
        if prefix_queries_total > self._last_queries:
            self._c["prefix_queries"].inc(prefix_queries_total - self._last_queries)
            self._last_queries = prefix_queries_total
        if prefix_hits_total > self._last_hits:
            self._c["prefix_hits"].inc(prefix_hits_total - self._last_hits)
            self._last_hits = prefix_hits_total

    def observe_kv(self, fig: KVGaugeSource) -> None:
        """The KV cache's figures right now (at a scrape: they cost a pass over the blocks)."""
        c = self._c
        c["kv_usage"].set(fig.block_utilization)
        c["kv_token_util"].set(fig.token_utilization)
        c["kv_internal_frag"].set(fig.internal_fragmentation)
        c["kv_blocks_total"].set(fig.num_blocks)
        c["kv_blocks_cached"].set(fig.num_cached_blocks)
        c["kv_blocks_shared"].set(fig.num_shared_blocks)
        c["kv_blocks_saved"].set(fig.blocks_saved_by_sharing)
        c["kv_pinned"].set(fig.num_pinned_blocks)
        counts = (fig.prefix_queries_requests, fig.prefix_hits_requests, fig.num_evictions, fig.pinned_hits,
                  fig.pinned_taken)
        for name, now, before in zip(("prefix_request_queries", "prefix_request_hits", "prefix_evictions",
                                      "kv_pinned_hits", "kv_pinned_taken"), counts, self._last_kv_counts):
            if now > before:
                c[name].inc(now - before)
        self._last_kv_counts = counts

    def observe_suffix_cache(self, num_requests: int, nbytes: int) -> None:
        self._c["suffix_requests"].set(num_requests)
        self._c["suffix_bytes"].set(nbytes)

    def observe_allocator(self, figures: dict[str, float | int]) -> None:
        """An allocator monitor's sample (``AllocatorMonitor.figures()``)."""
        m = self.model_name
        for k, g in self.cuda_mem.items():
            if k in figures:
                g.labels(m).set(figures[k])
        episodes = int(figures.get("num_episodes", 0))
        if episodes > self._last_episodes:
            self.fragmentation_episodes.labels(m).inc(episodes - self._last_episodes)
            self._last_episodes = episodes

    def observe_spec(self, num_draft_tokens: int, num_accepted: int) -> None:
        m = self.model_name
        self._c["spec_drafts"].inc()
        self._c["spec_draft_tokens"].inc(num_draft_tokens)
        self._c["spec_accepted"].inc(num_accepted)
        for pos in range(num_accepted):
            self.spec_accepted_pos.labels(m, str(pos)).inc()

    def observe_goodput_overrides(self, total: int) -> None:
        """The speculation controller's count of goodput overrides so far (a counter: the
        increase since the last call is added)."""
        if total > self._last_goodput_overrides:
            self._c["spec_goodput_overrides"].inc(total - self._last_goodput_overrides)
            self._last_goodput_overrides = total

    def observe_tokens(self, n: int) -> None:
        self._c["generation_tokens"].inc(n)

    def observe_accepted(self) -> None:
        self._c["accepted"].inc()

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def observe_finished(self, rm: RequestMetrics) -> None:
        m = self.model_name
        self._c["prompt_tokens"].inc(rm.num_prompt_tokens)
        if rm.prefix_break is not None and rm.prefix_break.recomputed_tokens:
            self.prefix_recomputed.labels(m, rm.prefix_break.kind).inc(rm.prefix_break.recomputed_tokens)
        self.success.labels(m, rm.finish_reason or "unknown").inc()
        self._c["prompt_len"].observe(rm.num_prompt_tokens)
        self._c["gen_len"].observe(rm.num_output_tokens)
        if rm.num_output_tokens == 0:
            return  # aborted before its first token: no latency figures to record
        self._c["ttft"].observe(rm.ttft_s)
        self._c["e2el"].observe(rm.e2el_s)
        self._c["queue"].observe(rm.queue_s)
        self._c["prefill"].observe(rm.prefill_s)
        self._c["decode"].observe(rm.decode_s)
        self._c["inference"].observe(rm.prefill_s + rm.decode_s)
        if rm.tpot_s is not None:
            self._c["tpot"].observe(rm.tpot_s)
        for gap in rm.itl_s:
            self._c["itl"].observe(gap)

    def enable_gateway_metrics(self, block_size: int, num_blocks: int, enable_prefix_caching: bool,
                               cache_dtype: str) -> None:
        """Also export the gauges inference gateways read, under vLLM's names. ``cache_dtype``:
        the KV cache's element type as resolved (vLLM's label shows the flag's value)."""
        self.registry.register(_GatewayCollector(self, block_size, num_blocks, enable_prefix_caching, cache_dtype))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
