"""Measurement layer: timelines, quantiles, Prometheus exposition, tail attribution."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tailserve import LLM, SamplingParams
from tailserve.metrics import (
    RequestMetrics,
    StreamingQuantiles,
    attribute_tail,
    percentiles,
    render_table,
    summarize,
)

NS = 1e-9


@pytest.fixture(scope="module")
def preempting_run(llama_checkpoint):
    """A workload on a KV cache small enough to force preemption; returns (llm, outputs)."""
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=12 * 2 * 2 * 16 * 2 * 16 * 4,
              max_num_batched_tokens=32, admission_reserve_tokens=0)
    prompts = [[(i * 7 + j) % 300 + 2 for j in range(10 + 9 * i)] for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    return llm, outs


def test_timelines_are_monotonic_and_consistent(preempting_run):
    llm, outs = preempting_run
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        m = out.metrics
        assert m is not None and m.num_output_tokens == out.num_output_tokens == 30
        assert min(m.queue_s, m.prefill_s, m.decode_s) >= 0
        assert m.ttft_s == pytest.approx(m.queue_s + m.prefill_s, abs=1e-9)
        assert m.e2el_s == pytest.approx(m.ttft_s + m.decode_s, abs=1e-9)
        assert len(m.itl_s) == m.num_output_tokens - 1 and all(g >= 0 for g in m.itl_s)
        assert sum(m.itl_s) == pytest.approx(m.decode_s, abs=1e-9)
        assert m.tpot_s == pytest.approx(m.decode_s / (m.num_output_tokens - 1))
        assert m.num_preemptions == out.num_preemptions
    preempted = [o.metrics for o in outs if o.num_preemptions]
    assert preempted and all(m.preempted_s > 0 for m in preempted)


def test_step_stats_are_recorded(preempting_run):
    llm, _ = preempting_run
    steps = list(llm.engine.step_log)
    assert steps and all(s.num_prefill_tokens + s.num_decode_tokens <= 32 for s in steps)
    assert sum(s.num_preemptions for s in steps) == llm.engine.scheduler.num_preemptions
    assert all(0.0 <= s.kv_token_utilization <= 1.0 for s in steps)
    assert max(s.kv_blocks_used for s in steps) <= steps[0].kv_blocks_total


def test_prometheus_exposition_parses_and_matches_engine_counts(preempting_run):
    llm, outs = preempting_run
    text = llm.engine.prometheus.exposition().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(name, suffix="_total"):
        return sum(s.value for s in fams[name].samples if s.name == name + suffix)

    assert value("tailserve:prompt_tokens") == sum(o.num_prompt_tokens for o in outs)
    assert value("tailserve:generation_tokens") == sum(o.num_output_tokens for o in outs)
    assert value("tailserve:num_preemptions") == llm.engine.scheduler.num_preemptions
    stats = llm.engine.block_pool.stats
    assert value("tailserve:prefix_cache_queries") == stats.queries_tokens
    assert value("tailserve:prefix_cache_hits") == stats.hits_tokens
    assert value("tailserve:request_success") == len(outs)
    assert value("tailserve:request_accepted") == len(outs)
    assert value("tailserve:time_to_first_token_seconds", "_count") == len(outs)
    assert value("tailserve:inter_token_latency_seconds", "_count") == sum(o.num_output_tokens - 1 for o in outs)
    assert fams["tailserve:num_requests_running"].samples[0].value == 0
    assert 0 <= fams["tailserve:kv_cache_usage_perc"].samples[0].value <= 1


def test_metrics_can_be_turned_off(llama_checkpoint):
    path, _ = llama_checkpoint
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20, enable_metrics=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]
    assert out.metrics is None and llm.engine.prometheus is None and out.num_output_tokens == 3


@pytest.mark.parametrize("dist", ["uniform", "lognormal", "pareto"])
def test_exact_percentiles_equal_numpy(dist):
    rng = np.random.default_rng(0)
    x = {"uniform": rng.random(1001), "lognormal": rng.lognormal(0, 2, 5000), "pareto": rng.pareto(1.2, 3000)}[dist]
    qs = (0, 1, 50, 90, 95, 99, 99.9, 100)
    got = percentiles(x, qs)
    assert list(got.values()) == list(np.percentile(x, qs))


@pytest.mark.parametrize("dist", ["lognormal", "pareto"])
def test_streaming_sketch_within_stated_relative_error(dist):
    rng = np.random.default_rng(1)
    x = rng.lognormal(-3, 1.5, 50_000) if dist == "lognormal" else rng.pareto(1.1, 50_000) + 1e-3
    sk = StreamingQuantiles(relative_accuracy=0.01)
    sk.extend(x)
    for q in (50, 99, 99.9):
        # DDSketch's guarantee is against the exact order statistic at rank q*(n-1).
        exact = np.percentile(x, q, method="lower")
        assert abs(sk.quantile(q / 100) - exact) <= 0.01 * exact + 1e-12


def _synthetic(n=200, slow_phase=None, factor=20.0, seed=0, **slow_fields):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ph = {"network": 0.002, "queue": 0.01, "prefill": 0.05, "decode": 0.5}
        ph = {k: v * rng.uniform(0.9, 1.1) for k, v in ph.items()}
        slow = slow_phase is not None and i % 50 == 0  # 2% of requests are slow
        if slow:
            ph[slow_phase] *= factor
        ttft = ph["queue"] + ph["prefill"]
        e2el = ttft + ph["decode"]
        out.append(RequestMetrics(
            request_id=str(i), num_prompt_tokens=slow_fields.get("prompt", 100) if slow else 100,
            num_cached_tokens=0, num_output_tokens=slow_fields.get("output", 50) if slow else 50,
            queue_s=ph["queue"], prefill_s=ph["prefill"], ttft_s=ttft, decode_s=ph["decode"], e2el_s=e2el,
            tpot_s=ph["decode"] / 49, itl_s=(), num_preemptions=0, preempted_s=0.0,
            client_ttft_s=ttft + ph["network"], client_e2el_s=e2el + ph["network"]))
    return out


@pytest.mark.parametrize("phase, words", [
    ("queue", "at capacity"), ("prefill", "prefill"), ("decode", "speculative decoding"), ("network", "network"),
])
def test_attribution_names_the_dominant_phase(phase, words):
    factor = {"network": 400.0, "queue": 80.0, "prefill": 20.0, "decode": 4.0}[phase]
    res = attribute_tail(_synthetic(slow_phase=phase, factor=factor))
    assert res.dominant == phase
    assert res.share[phase] > 0.9
    assert words in res.verdict and res.ratio > 1.5


def test_attribution_blames_long_prompts_and_outputs():
    res = attribute_tail(_synthetic(slow_phase="prefill", factor=20.0, prompt=800))
    assert "long prompts" in res.verdict and "prefix caching" in res.verdict
    res = attribute_tail(_synthetic(slow_phase="decode", factor=4.0, output=400))
    assert "long outputs" in res.verdict


def test_attribution_does_not_advise_speculation_to_a_server_that_speculates():
    res = attribute_tail(_synthetic(slow_phase="decode", factor=4.0), speculative=True)
    assert res.dominant == "decode"
    assert "enable speculative decoding" not in res.verdict and "with speculation on" in res.verdict


def test_attribution_of_a_tight_tail():
    res = attribute_tail(_synthetic(slow_phase=None))
    assert "tail is tight" in res.verdict


def test_summary_and_table(preempting_run):
    _, outs = preempting_run
    ms = [o.metrics for o in outs]
    s = summarize(ms, duration_s=2.0)
    assert s["num_requests"] == 6 and s["output_tokens"] == 180
    assert s["ttft_s"]["p50"] == np.percentile([m.ttft_s for m in ms], 50)
    assert s["itl_s"]["p99_9"] == np.percentile([g for m in ms for g in m.itl_s], 99.9)
    table = render_table(s)
    assert "TTFT" in table and "p99 (ms)" in table


def test_the_timing_wire_format_round_trips_in_both_forms():
    """What the server writes (metrics/wire.py) is what the bench reads, body and header."""
    from tailserve.metrics.wire import WireTiming

    w = WireTiming(0.0012, 0.0345, 0.0357, 0.5, 0.5357, 0.004, 100, 64, 120, 1,
                   {"draft_tokens": 30, "accepted_tokens": 21, "acceptance_rate": 0.7, "mean_acceptance_length": 2.1})
    assert WireTiming.from_wire(w.to_wire()) == w
    h = WireTiming.from_header(w.to_header())
    assert h is not None and abs(h.prefill_s - w.prefill_s) < 1e-6 and abs(h.e2e_s - w.e2e_s) < 1e-6
    assert WireTiming.from_wire({"queue_ms": 1, "prefill_ms": "x", "decode_ms": 1, "e2e_ms": 1}) is None
    assert WireTiming.from_header("queue;dur=1, prefill;dur=bad, decode;dur=2") is None  # no usable prefill
    only = WireTiming.from_header("queue;dur=1, prefill;dur=2, decode;dur=3")
    assert only is not None and abs(only.e2e_s - 0.006) < 1e-12 and abs(only.ttft_s - 0.003) < 1e-12


def test_vllms_metrics_object_has_its_meanings_and_round_trips():
    """vLLM's per-request metrics (queued 1.0, scheduled 1.5, first token 2.0, last token 3.0,
    10 tokens: vLLM's own example) written and read back by metrics/wire.py."""
    from tailserve.metrics.wire import WireTiming

    # queue 0.5 s, prefill (first token - scheduled) 0.5 s, decode 1.0 s, TTFT from arrival 1.0 s.
    w = WireTiming(0.5, 0.5, 1.0, 1.0, 2.0, output_tokens=10)
    m = w.to_vllm_metrics()
    assert m == pytest.approx({"time_to_first_token_ms": 500.0, "generation_time_ms": 1000.0,
                               "queue_time_ms": 500.0, "mean_itl_ms": 1000.0 / 9, "tokens_per_second": 10 / 1.5})
    back = WireTiming.from_vllm_metrics(m)
    assert back is not None and (back.queue_s, back.prefill_s, back.ttft_s, back.decode_s, back.e2e_s) == \
        pytest.approx((0.5, 0.5, 1.0, 1.0, 2.0))
    assert WireTiming(0.1, 0.1, 0.2, 0.0, 0.2, output_tokens=1).to_vllm_metrics()["mean_itl_ms"] is None
    # vLLM sends every field null when its engine kept no timestamps: not a timing.
    assert WireTiming.from_vllm_metrics(dict.fromkeys(m)) is None
    assert WireTiming.from_vllm_metrics({}) is None


def test_custom_histogram_buckets_replace_a_familys_buckets_and_the_vllm_mirrors_follow():
    from tailserve.config import EngineConfig
    from tailserve.metrics.prometheus import PrometheusMetrics, latency_buckets

    cfg = EngineConfig(model="m", custom_histogram_buckets='{"request_latency": [0.05, 0.1, 0.25], '
                                                           '"time_to_first_token": [0.02, 0.2]}')
    prom = PrometheusMetrics("tiny", cfg.custom_histogram_buckets)
    prom.enable_gateway_metrics(16, 64, True, "bfloat16")
    rm = RequestMetrics(request_id="r", num_prompt_tokens=10, num_cached_tokens=0, num_output_tokens=3,
                        queue_s=0.01, prefill_s=0.03, ttft_s=0.04, decode_s=0.08, e2el_s=0.12, tpot_s=0.04,
                        itl_s=(0.04, 0.04), num_preemptions=0, preempted_s=0.0)
    prom.observe_finished(rm)
    les: dict[str, list[float]] = {}
    counts: dict[tuple[str, float], float] = {}
    for fam in text_string_to_metric_families(prom.exposition().decode()):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                les.setdefault(s.name, []).append(le)
                counts[(s.name, le)] = s.value
    inf = float("inf")
    for name in ("tailserve:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "tailserve:request_queue_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket"):
        assert les[name] == [0.05, 0.1, 0.25, inf], name
    assert les["tailserve:time_to_first_token_seconds_bucket"] == [0.02, 0.2, inf]
    assert les["vllm:inter_token_latency_seconds_bucket"] == [*latency_buckets(), inf]  # not listed: default
    # the observation lands in the new buckets: e2e 0.12 s above 0.1, within 0.25
    assert counts[("vllm:e2e_request_latency_seconds_bucket", 0.1)] == 0
    assert counts[("vllm:e2e_request_latency_seconds_bucket", 0.25)] == 1


@pytest.mark.parametrize("text, message", [
    ('{"iteration_tokens": [1, 2]}', "has no iteration_tokens histogram"),
    ('{"request_latncy": [1]}', "unknown family 'request_latncy'"),
    ('{"request_latency": [0.5, 0.1]}', "increasing"),
    ('{"request_latency": []}', "non-empty"),
    ("[0.1, 1]", "a JSON object of families"),
])
def test_custom_histogram_buckets_refuse_what_they_cannot_apply(text, message):
    from tailserve.config import EngineConfig
    from tailserve.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        EngineConfig(model="m", custom_histogram_buckets=text)
