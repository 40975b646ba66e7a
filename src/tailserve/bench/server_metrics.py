"""The server's own counters over a run, read from its Prometheus ``/metrics``.

Counters are read before and after the run and differenced; gauges (KV-cache use,
running and waiting requests) are sampled while it runs. Both ``tailserve:`` and
``vllm:`` names are read (tailserve exports the same meanings under its own prefix;
SGLang's ``sglang:`` names are read for the gauges it shares), so the figures come out
the same against either engine. A server without ``/metrics`` gives ``None``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("tailserve:", "vllm:", "sglang:")
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens")
GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")


_WANTED = frozenset(f"{p}{n}{suffix}" for p in PREFIXES for n in COUNTERS + GAUGES for suffix in ("", "_total"))


def _wanted_lines(text: str) -> str:
    """Only the lines of the metrics read here. A vLLM server exposes hundreds of histogram
    buckets; parsing them all twice a second cost the client more CPU than its own requests
    (measured: 2.2 of 5.4 CPU-seconds in a 60-request run), which slows a server that shares
    the machine."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in _WANTED:
                keep.append(line)
            continue
        end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if i != -1:
                end = min(end, i)
        if line[:end] in _WANTED:
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of the known counters and gauges over their labels, by short name."""
    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(_wanted_lines(text)))
    except ValueError:
        return out
    for fam in families:
        short = next((fam.name[len(p):] for p in PREFIXES if fam.name.startswith(p)), None)
        if short is None:
            continue
        if short.endswith("_total"):
            short = short[: -len("_total")]
        if short not in COUNTERS and short not in GAUGES:
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[short] = out.get(short, 0.0) + float(s.value)
    return out


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    try:
        r = await client.get(base_url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse_metrics(r.text)


@dataclass
class ServerCounters:
    available: bool = False
    deltas: dict[str, float] = field(default_factory=dict)
    kv_usage_samples: list[float] = field(default_factory=list)
    running_samples: list[float] = field(default_factory=list)
    waiting_samples: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float | None]:
        d = self.deltas
        drafts, draft_toks = d.get("spec_decode_num_drafts", 0.0), d.get("spec_decode_num_draft_tokens", 0.0)
        acc = d.get("spec_decode_num_accepted_tokens", 0.0)
        queries, hits = d.get("prefix_cache_queries", 0.0), d.get("prefix_cache_hits", 0.0)

        def mean(xs: list[float]) -> float | None:
            return sum(xs) / len(xs) if xs else None

        return {
            "spec_decode_num_drafts": drafts if draft_toks else None,
            "spec_decode_draft_tokens": draft_toks if draft_toks else None,
            "spec_decode_accepted_tokens": acc if draft_toks else None,
            # Percent, as vllm bench serve reports it.
            "spec_decode_acceptance_rate": 100.0 * acc / draft_toks if draft_toks else None,
            "spec_decode_acceptance_length": 1.0 + acc / drafts if drafts else None,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "server_preemptions": d.get("num_preemptions") if self.available else None,
            "mean_kv_cache_usage": mean(self.kv_usage_samples),
            "max_kv_cache_usage": max(self.kv_usage_samples) if self.kv_usage_samples else None,
            "mean_running_requests": mean(self.running_samples),
            "max_waiting_requests": max(self.waiting_samples) if self.waiting_samples else None,
        }


class MetricsWatcher:
    """Scrape once at the start, every ``interval_s`` while the run lasts, and once at the end."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float = 1.0) -> None:
        self.client, self.base_url, self.interval_s = client, base_url, interval_s
        self.counters = ServerCounters()
        self._before: dict[str, float] | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._before = await scrape(self.client, self.base_url)
        self.counters.available = self._before is not None
        if self._before is not None:
            self._task = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            m = await scrape(self.client, self.base_url)
            if m is not None:
                self._record_gauges(m)

    def _record_gauges(self, m: dict[str, float]) -> None:
        if "kv_cache_usage_perc" in m:
            self.counters.kv_usage_samples.append(m["kv_cache_usage_perc"])
        if "num_requests_running" in m:
            self.counters.running_samples.append(m["num_requests_running"])
        if "num_requests_waiting" in m:
            self.counters.waiting_samples.append(m["num_requests_waiting"])

    async def stop(self) -> ServerCounters:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._before is not None:
            after = await scrape(self.client, self.base_url)
            if after is not None:
                self._record_gauges(after)  # a run shorter than the interval still has a reading
                self.counters.deltas = {k: after[k] - self._before.get(k, 0.0) for k in after if k in COUNTERS}
        return self.counters
