"""The per-request server timing on the wire, written by the server and read by the load
generator from one definition (the key strings live here only).

Three forms: a ``timing`` object in the response body (non-streaming) or in the final streamed
chunk, in milliseconds; a W3C ``Server-Timing`` header (``queue;dur=1.234, ...``, also
milliseconds); and vLLM's per-request ``metrics`` object (``--enable-per-request-metrics``,
vLLM >= 0.25: in the body, or in the final usage chunk when streaming), which tailserve both
writes (under the same flag) and reads (from a vLLM server). ``to_wire`` / ``from_wire``,
``to_header`` / ``from_header`` and ``to_vllm_metrics`` / ``from_vllm_metrics`` are inverse
pairs; a reader keeps what it can parse and skips a malformed header entry, as browsers do.

vLLM's ``metrics``, from its engine's request timestamps (queued, scheduled, first token,
last token): ``queue_time_ms`` = scheduled - queued; ``time_to_first_token_ms`` = first token -
scheduled (from scheduling, not from arrival); ``generation_time_ms`` = last token - first
token; ``mean_itl_ms`` = generation / (tokens - 1); ``tokens_per_second`` = tokens / (last
token - scheduled). So the server's end-to-end is queue + TTFT + generation, and its TTFT
from arrival is queue + TTFT. It does not count what the API server does before the engine
queues the request (parsing, tokenization), so that lands in the client's share.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from tailserve.metrics.timeline import RequestMetrics

# The phases every form carries, in this order in the header.
HEADER_PHASES = ("queue", "prefill", "ttft", "decode", "e2e")
# vLLM's metrics object: queue, TTFT from scheduling, generation (milliseconds).
VLLM_PHASES = ("queue_time_ms", "time_to_first_token_ms", "generation_time_ms")


@dataclass(frozen=True)
class WireTiming:
    """One request's server-side phases (seconds) and counts, as they travel."""

    queue_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    e2e_s: float
    tpot_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    preemptions: int = 0
    spec: dict[str, float | int] | None = None  # draft/accepted tokens, rates (speculation on)
    # Where the prompt left the prefix cache: cached_tokens, break_at_token, break_segment
    # (metrics/prefix_break.py); None when the cache was not looked up.
    prefix_cache: dict[str, Any] | None = None

    @classmethod
    def from_metrics(cls, m: RequestMetrics) -> WireTiming:
        spec = None
        if m.spec_num_drafts:
            spec = {"draft_tokens": m.spec_num_draft_tokens, "accepted_tokens": m.spec_num_accepted_tokens,
                    "acceptance_rate": m.spec_acceptance_rate,
                    "mean_acceptance_length": m.spec_mean_acceptance_length}
        return cls(m.queue_s, m.prefill_s, m.ttft_s, m.decode_s, m.e2el_s, m.tpot_s, m.num_prompt_tokens,
                   m.num_cached_tokens, m.num_output_tokens, m.num_preemptions, spec,
                   m.prefix_break.to_wire() if m.prefix_break is not None else None)

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "queue_ms": self.queue_s * 1e3, "prefill_ms": self.prefill_s * 1e3, "ttft_ms": self.ttft_s * 1e3,
            "decode_ms": self.decode_s * 1e3, "e2e_ms": self.e2e_s * 1e3,
            "tpot_ms": self.tpot_s * 1e3 if self.tpot_s is not None else None,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens, "preemptions": self.preemptions,
        }
        if self.spec is not None:
            d["spec"] = dict(self.spec)
        d["prefix_cache"] = dict(self.prefix_cache) if self.prefix_cache is not None else None
        return d

    @classmethod
    def from_wire(cls, t: object) -> WireTiming | None:
        """The body's ``timing`` object, or None when it is not one (missing phases, wrong types)."""
        if not isinstance(t, dict) or not all(_is_num(t.get(k)) for k in ("queue_ms", "prefill_ms", "decode_ms",
                                                                            "e2e_ms")):
            return None
        ttft = t.get("ttft_ms")
        tpot = t.get("tpot_ms")
        spec = t.get("spec")
        pc = t.get("prefix_cache")
        return cls(t["queue_ms"] / 1e3, t["prefill_ms"] / 1e3,
                   (ttft if _is_num(ttft) else t["queue_ms"] + t["prefill_ms"]) / 1e3, t["decode_ms"] / 1e3,
                   t["e2e_ms"] / 1e3, tpot / 1e3 if _is_num(tpot) else None, _int(t.get("prompt_tokens")),
                   _int(t.get("cached_tokens")), _int(t.get("output_tokens")), _int(t.get("preemptions")) or 0,
                   spec if isinstance(spec, dict) else None, pc if isinstance(pc, dict) else None)

    def to_vllm_metrics(self) -> dict[str, float | None]:
        """vLLM's ``metrics`` object (same names, same meanings; module docstring)."""
        n = self.output_tokens or 0
        active_s = self.prefill_s + self.decode_s
        return {"time_to_first_token_ms": self.prefill_s * 1e3, "generation_time_ms": self.decode_s * 1e3,
                "queue_time_ms": self.queue_s * 1e3,
                "mean_itl_ms": self.decode_s * 1e3 / (n - 1) if n > 1 else None,
                "tokens_per_second": n / active_s if active_s > 0 else None}

    @classmethod
    def from_vllm_metrics(cls, m: object) -> WireTiming | None:
        """vLLM's ``metrics`` object, or None without its three phases (vLLM sends every field
        as null when the engine kept no timestamps)."""
        if not isinstance(m, dict) or not all(_is_num(m.get(k)) for k in VLLM_PHASES):
            return None
        q, t, g = (m[k] / 1e3 for k in VLLM_PHASES)
        tpot = m.get("mean_itl_ms")
        return cls(q, t, q + t, g, q + t + g, tpot / 1e3 if _is_num(tpot) else None)

    def to_header(self) -> str:
        secs = (self.queue_s, self.prefill_s, self.ttft_s, self.decode_s, self.e2e_s)
        return ", ".join(f"{name};dur={s * 1e3:.3f}" for name, s in zip(HEADER_PHASES, secs))

    @classmethod
    def from_header(cls, value: str | None) -> WireTiming | None:
        """``Server-Timing: queue;dur=1.2, prefill;dur=3.4, ...``; None without queue, prefill
        and decode. A missing ttft is queue + prefill, a missing e2e the sum of the three."""
        if not value:
            return None
        durs: dict[str, float] = {}
        for part in value.split(","):
            name, _, rest = part.strip().partition(";")
            for attr in rest.split(";"):
                k, _, v = attr.strip().partition("=")
                if k == "dur":
                    with contextlib.suppress(ValueError):  # a malformed entry is skipped
                        durs[name.strip()] = float(v) / 1e3
        if not {"queue", "prefill", "decode"} <= durs.keys():
            return None
        q, p, d = durs["queue"], durs["prefill"], durs["decode"]
        return cls(q, p, durs.get("ttft", q + p), d, durs.get("e2e", q + p + d))


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _int(v: object) -> int | None:
    return int(v) if _is_num(v) else None
