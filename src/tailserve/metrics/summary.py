"""Summaries of a list of request metrics: a JSON-ready dict and a rich table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from tailserve.metrics.quantiles import DEFAULT_PERCENTILES, percentiles
from tailserve.metrics.timeline import RequestMetrics

_FIELDS = ("ttft_s", "tpot_s", "itl_s", "e2el_s", "queue_s", "prefill_s", "decode_s")


def summarize(metrics: Sequence[RequestMetrics], qs: Iterable[float] = DEFAULT_PERCENTILES,
              duration_s: float | None = None) -> dict[str, object]:
    """{"num_requests", token totals, throughput (if duration_s), and per latency field:
    mean, and p<q> for each percentile}; ITL pools every gap of every request."""
    qs = tuple(qs)
    out: dict[str, object] = {
        "num_requests": len(metrics),
        "prompt_tokens": sum(m.num_prompt_tokens for m in metrics),
        "cached_tokens": sum(m.num_cached_tokens for m in metrics),
        "output_tokens": sum(m.num_output_tokens for m in metrics),
        "preemptions": sum(m.num_preemptions for m in metrics),
    }
    if duration_s:
        out["duration_s"] = duration_s
        out["output_throughput_tok_s"] = out["output_tokens"] / duration_s  # type: ignore[operator]
        out["request_throughput_req_s"] = len(metrics) / duration_s
    for name in _FIELDS:
        if name == "itl_s":
            values = [v for m in metrics for v in m.itl_s]
        else:
            values = [v for v in (getattr(m, name) for m in metrics) if v is not None]
        stats: dict[str, float] = {"mean": float(np.mean(values)) if values else float("nan")}
        for q, v in percentiles(values, qs).items():
            stats[_pname(q)] = v
        out[name] = stats
    return out


def _pname(q: float) -> str:
    return f"p{q:g}".replace(".", "_") if q != int(q) else f"p{int(q)}"


def render_table(summary: dict[str, object], title: str = "tailserve request metrics") -> str:
    """The summary as a fixed-width table (rich), in milliseconds."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    cols = [k for k in summary["ttft_s"]]  # type: ignore[union-attr]
    for c in cols:
        table.add_column(f"{c} (ms)", justify="right")
    for name in _FIELDS:
        row = summary[name]
        table.add_row(name.removesuffix("_s").upper(), *(f"{row[c] * 1e3:.2f}" for c in cols))  # type: ignore[index]
    console = Console(width=120, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(table)
        console.print(f"requests {summary['num_requests']}, prompt tokens {summary['prompt_tokens']} "
                      f"(cached {summary['cached_tokens']}), output tokens {summary['output_tokens']}, "
                      f"preemptions {summary['preemptions']}")
    return cap.get()
