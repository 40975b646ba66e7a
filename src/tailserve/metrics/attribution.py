"""Tail attribution: where does the P99 come from?

Requests are ranked by end-to-end latency (the client's when known). The *tail cohort* is
every request at or above the P99; the *median cohort* those between P40 and P60. For each
phase (network, queue, prefill, decode) the excess is the tail cohort's mean time in that
phase minus the median cohort's; the phase with the largest excess is the verdict's cause.
Rules and thresholds are documented in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tailserve.metrics.timeline import RequestMetrics

PHASES = ("network", "queue", "prefill", "decode")
TIGHT_TAIL_RATIO = 1.5  # P99/P50 below this: no tail problem worth naming
LONGER_INPUT_RATIO = 2.0  # tail prompts/outputs this much longer than the median's: blame length


@dataclass(frozen=True)
class TailAttribution:
    p50_s: float
    p99_s: float
    ratio: float
    tail_count: int
    median_count: int
    excess_s: dict[str, float]  # tail-cohort mean minus median-cohort mean, per phase
    share: dict[str, float]  # each phase's part of the positive excess
    dominant: str
    verdict: str

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def phase_times(m: RequestMetrics) -> dict[str, float]:
    """Split one request's end-to-end time into the four phases (they sum to its total)."""
    if m.client_e2el_s is not None:
        network = max(0.0, m.client_e2el_s - m.e2el_s)
    elif m.client_ttft_s is not None:
        network = max(0.0, m.client_ttft_s - m.ttft_s)
    else:
        network = 0.0
    # Time spent preempted is time spent waiting for capacity: count it as queueing.
    preempted = min(m.preempted_s, m.decode_s)
    return {"network": network, "queue": m.queue_s + preempted, "prefill": m.prefill_s,
            "decode": m.decode_s - preempted}


def attribute_tail(metrics: Sequence[RequestMetrics], speculative: bool = False) -> TailAttribution:
    """``speculative``: the server already decodes speculatively (the advice changes)."""
    if not metrics:
        raise ValueError("attribute_tail needs at least one request")
    phases = [phase_times(m) for m in metrics]
    totals = np.array([sum(p.values()) for p in phases])
    p50, p40, p60, p99 = np.percentile(totals, [50, 40, 60, 99])
    tail = [i for i, t in enumerate(totals) if t >= p99] or [int(np.argmax(totals))]
    mid = [i for i, t in enumerate(totals) if p40 <= t <= p60] or [int(np.argmin(np.abs(totals - p50)))]

    def mean(idx: list[int], key: str) -> float:
        return float(np.mean([phases[i][key] for i in idx]))

    excess = {ph: mean(tail, ph) - mean(mid, ph) for ph in PHASES}
    positive = sum(v for v in excess.values() if v > 0)
    share = {ph: (max(v, 0.0) / positive if positive > 0 else 0.0) for ph, v in excess.items()}
    dominant = max(PHASES, key=lambda ph: excess[ph])
    ratio = float(p99 / p50) if p50 > 0 else float("inf")

    def avg(idx: list[int], attr: str) -> float:
        return float(np.mean([getattr(metrics[i], attr) for i in idx]))

    verdict = _verdict(ratio, dominant, share[dominant],
                       prompt_ratio=avg(tail, "num_prompt_tokens") / max(avg(mid, "num_prompt_tokens"), 1.0),
                       output_ratio=avg(tail, "num_output_tokens") / max(avg(mid, "num_output_tokens"), 1.0),
                       speculative=speculative)
    return TailAttribution(float(p50), float(p99), ratio, len(tail), len(mid), excess, share, dominant, verdict)


def _verdict(ratio: float, dominant: str, share: float, prompt_ratio: float, output_ratio: float,
             speculative: bool = False) -> str:
    head = f"P99 end-to-end is {ratio:.1f}x the median"
    if ratio < TIGHT_TAIL_RATIO:
        return f"{head}: the tail is tight; the largest difference is in {dominant} ({share:.0%})."
    if dominant == "queue":
        cause = "queueing: the engine is at capacity (raise --max-num-seqs, add replicas, or shed load)"
    elif dominant == "prefill":
        if prompt_ratio >= LONGER_INPUT_RATIO:
            cause = (f"prefill of long prompts (tail prompts are {prompt_ratio:.1f}x longer): enable prefix "
                     "caching or shorten prompts")
        else:
            cause = ("prefill slowed by the batch it shares (prompts of similar length): lower "
                     "--max-num-batched-tokens so prefill chunks interfere less, or add capacity")
    elif dominant == "decode":
        if output_ratio >= LONGER_INPUT_RATIO:
            cause = (f"decode of long outputs (tail requests generate {output_ratio:.1f}x more tokens): cap "
                     + ("max_tokens" if speculative else "max_tokens, or enable speculative decoding"))
        elif speculative:
            cause = ("decode (slow per token, not longer outputs) with speculation on: tail requests accept "
                     "fewer drafts or share bigger batches; lower --max-num-seqs or --speculative-max-tokens")
        else:
            cause = ("decode (slow per token, not longer outputs): enable speculative decoding, or lower "
                     "--max-num-seqs to shrink the decode batch")
    else:
        cause = ("network and client: the time is outside the server (check proxies, connection reuse, TLS, "
                 "and the client's own load)")
    return f"{head}; {share:.0%} of the excess is {cause}."
