"""Per-request timelines recorded by the engine, and the latency figures derived from them.

All stamps are ``time.perf_counter_ns()`` of the engine process (monotonic); they are only
ever subtracted from each other. Definitions (docs/metrics.md), matching vLLM's names:

    queue    = first_scheduled - arrival
    prefill  = first_token - first_scheduled
    TTFT     = first_token - arrival              (= queue + prefill)
    decode   = last_token - first_token
    TPOT     = decode / (N_out - 1)               (N_out > 1)
    ITL_i    = token_i - token_(i-1)              (N_out - 1 gaps)
    E2EL     = last_token - arrival               (= TTFT + decode)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.metrics.prefix_break import PrefixBreak

_NS = 1e-9


@dataclass
class RequestTimeline:
    arrival_ns: int
    first_scheduled_ns: int | None = None
    first_token_ns: int | None = None
    token_ns: list[int] = field(default_factory=list)  # one stamp per output token
    finished_ns: int | None = None
    preempted_ns: list[int] = field(default_factory=list)
    readmitted_ns: list[int] = field(default_factory=list)

    def on_scheduled(self, now_ns: int) -> None:
        if self.first_scheduled_ns is None:
            self.first_scheduled_ns = now_ns
        elif len(self.readmitted_ns) < len(self.preempted_ns):
            self.readmitted_ns.append(now_ns)

    def on_tokens(self, now_ns: int, count: int) -> None:
        if count <= 0:
            return
        if self.first_token_ns is None:
            self.first_token_ns = now_ns
        self.token_ns.extend([now_ns] * count)


@dataclass(frozen=True)
class RequestMetrics:
    """One finished (or aborted) request's figures, in seconds."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    queue_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    e2el_s: float
    tpot_s: float | None
    itl_s: tuple[float, ...]
    num_preemptions: int
    preempted_s: float  # time spent preempted (from each preemption to its re-admission)
    finish_reason: str | None = None
    # Optional client-side view (set by the load generator), for network attribution.
    client_ttft_s: float | None = None
    client_e2el_s: float | None = None
    # Speculative decoding (zero when off).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Where the prompt left the prefix cache (None: the cache was not looked up).
    prefix_break: PrefixBreak | None = None
    # When each preemption happened, seconds from arrival (for trace events).
    preempted_at_s: tuple[float, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_acceptance_length(self) -> float | None:
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None

    @classmethod
    def from_timeline(cls, request_id: str, tl: RequestTimeline, num_prompt_tokens: int, num_cached_tokens: int,
                      finish_reason: str | None, spec: tuple[int, int, int] = (0, 0, 0),
                      prefix_break: PrefixBreak | None = None) -> RequestMetrics:
        arrival = tl.arrival_ns
        sched = tl.first_scheduled_ns if tl.first_scheduled_ns is not None else arrival
        first = tl.first_token_ns
        last = tl.token_ns[-1] if tl.token_ns else None
        n_out = len(tl.token_ns)
        end = last if last is not None else (tl.finished_ns or sched)
        first = first if first is not None else end
        decode_ns = (last - first) if last is not None else 0
        itl = tuple((b - a) * _NS for a, b in zip(tl.token_ns, tl.token_ns[1:]))
        preempted = sum(r - p for p, r in zip(tl.preempted_ns, tl.readmitted_ns))
        return cls(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            num_cached_tokens=max(num_cached_tokens, 0),
            num_output_tokens=n_out,
            queue_s=(sched - arrival) * _NS,
            prefill_s=(first - sched) * _NS,
            ttft_s=(first - arrival) * _NS,
            decode_s=decode_ns * _NS,
            e2el_s=(end - arrival) * _NS,
            tpot_s=decode_ns * _NS / (n_out - 1) if n_out > 1 else None,
            itl_s=itl,
            num_preemptions=len(tl.preempted_ns),
            preempted_s=preempted * _NS,
            finish_reason=finish_reason,
            spec_num_drafts=spec[0],
            spec_num_draft_tokens=spec[1],
            spec_num_accepted_tokens=spec[2],
            prefix_break=prefix_break,
            preempted_at_s=tuple((p - arrival) * _NS for p in tl.preempted_ns),
        )

    def as_dict(self) -> dict[str, object]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("itl_s", "prefix_break",
                                                                            "preempted_at_s")}
        d["itl_s"] = list(self.itl_s)
        d["prefix_cache"] = self.prefix_break.to_wire() if self.prefix_break is not None else None
        return d


@dataclass(frozen=True)
class StepStats:
    """What one engine step did (for the step log and Prometheus gauges)."""

    step: int
    duration_s: float
    num_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_token_utilization: float  # live tokens / slots in allocated blocks
    num_preemptions: int  # in this step
    # Where the step's time went (the worker's own stamps): the target's forward with its
    # sampling or verification, and the proposer's round of drafts; the rest of
    # ``duration_s`` is scheduling and bookkeeping.
    target_forward_s: float = 0.0
    propose_s: float = 0.0
    num_output_tokens: int = 0  # tokens the step emitted (accepted drafts and the bonus included)
