"""What a bench run shows a person: the final table (rich), PNG plots (matplotlib, Agg),
one self-contained HTML page (the plots embedded as data URIs), and the comparison of two
result files with run-to-run noise flagged as such."""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

PLOT_SIZE_PX = (800, 480)
_DPI = 100
PHASE_COLORS = {"network": "#8c8c8c", "queue": "#d62728", "prefill": "#1f77b4", "decode": "#2ca02c"}


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def summary_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    rows = []
    for r in results:
        acc = r.get("spec_decode_acceptance_rate")
        hit = r.get("prefix_cache_hit_rate")
        kv = r.get("mean_kv_cache_usage")
        rows.append({
            "run": str(r.get("label")), "rate": _fmt(r.get("request_rate"), 2),
            "ok/failed": f"{r['completed']}/{r['failed']}", "req/s": _fmt(r["request_throughput"], 2),
            "out tok/s": _fmt(r["output_throughput"], 1),
            "TTFT P50": _fmt(r.get("median_ttft_ms")), "TTFT P99": _fmt(r.get("p99_ttft_ms")),
            "TPOT P50": _fmt(r.get("median_tpot_ms")), "TPOT P99": _fmt(r.get("p99_tpot_ms")),
            "ITL P99": _fmt(r.get("p99_itl_ms")), "E2EL P99": _fmt(r.get("p99_e2el_ms")),
            "accept": f"{acc:.0f}%" if acc is not None else "-",
            "prefix hit": f"{hit:.0%}" if hit is not None else "-",
            "KV use": f"{kv:.1%}" if kv is not None else "-",
        })
    return rows


def render_table(results: Sequence[dict[str, Any]], title: str = "tailserve bench") -> str:
    """The final table (milliseconds unless named), and each run's attribution verdict."""
    from rich.console import Console
    from rich.table import Table

    rows = summary_rows(results)
    table = Table(title=title, title_justify="left")
    for col in rows[0]:
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row.values())
    console = Console(record=True, width=200, force_terminal=False, color_system=None)
    with console.capture() as cap:
        console.print(table)
        console.print("times in ms; TTFT/TPOT/ITL/E2EL as measured by the client")
        for r in results:
            console.print(f"{r.get('label')}: {r['attribution']['verdict']}", soft_wrap=True, markup=False)
            client = r.get("client", {})
            if client.get("saturated"):
                console.print(f"{r.get('label')}: warning: the client lagged (P99 send lag "
                              f"{client['p99_send_lag_ms']:.1f} ms); its figures include its own delay",
                              soft_wrap=True, markup=False)
            sat = r.get("saturation") or {}
            if sat.get("oversaturated"):
                when = (f"stopped sending at {sat['at_s']:.1f} s after {sat['sent']} requests"
                        if sat.get("stopped_sending") else "its figures depend on how long it ran")
                console.print(f"{r.get('label')}: over-saturated: TTFT grew {sat['ttft_slope_ms_per_s']:.0f} ms/s and "
                              f"requests in flight {sat['concurrency_slope_per_s']:.1f}/s; {when}",
                              soft_wrap=True, markup=False)
            pr = r.get("probes")
            if pr and pr.get("ttft_ms"):
                q = pr["ttft_ms"]
                console.print(f"{r.get('label')}: probes ({pr['completed']} of {pr['sent']} at {pr['rate']:g}/s, "
                              "1 token each): TTFT " + ", ".join(f"{k.upper()} {v:.1f}" for k, v in q.items()) + " ms",
                              soft_wrap=True, markup=False)
            resends = (r.get("client") or {}).get("resends")
            if resends:
                console.print(f"{r.get('label')}: the server closed {resends} kept-alive connection(s) without a "
                              "'Connection: close'; the requests on them were sent again on new connections",
                              soft_wrap=True, markup=False)
            errs = {k: v for k, v in r.get("errors_by_kind", {}).items() if v}
            if errs:
                console.print(f"{r.get('label')}: errors: " + ", ".join(f"{k} {v}" for k, v in errs.items()),
                              soft_wrap=True, markup=False)
    return cap.get()


# -- plots --------------------------------------------------------------------------------

def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(PLOT_SIZE_PX[0] / _DPI, PLOT_SIZE_PX[1] / _DPI), dpi=_DPI)
    return plt, fig, ax


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=_DPI)
    plt.close(fig)
    return buf.getvalue()


def cdf_png(results: Sequence[dict[str, Any]], metric: str, title: str) -> bytes:
    plt, fig, ax = _figure()
    for r in results:
        vals = np.sort([q[f"{metric}_ms"] for q in r["requests"] if q.get(f"{metric}_ms") is not None
                        and q["error_kind"] is None])
        if vals.size:
            ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=str(r.get("label")))
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.axhline(0.99, color="k", lw=0.6, ls=":")
    ax.legend(loc="lower right", fontsize=8)
    return _png(plt, fig)


def cohort_phases(result: dict[str, Any]) -> dict[str, dict[str, float]] | None:
    """Mean time per phase for the median cohort (P40-P60 of end-to-end) and the tail
    (at or above P99), the same cohorts the attribution uses."""
    rows = [q["phases_ms"] for q in result["requests"] if q.get("phases_ms")]
    if not rows:
        return None
    totals = np.array([sum(p.values()) for p in rows])
    p40, p60, p99 = np.percentile(totals, [40, 60, 99])
    mid = [p for p, t in zip(rows, totals) if p40 <= t <= p60] or rows
    tail = [p for p, t in zip(rows, totals) if t >= p99] or [rows[int(np.argmax(totals))]]
    return {name: {ph: float(np.mean([p[ph] for p in cohort])) for ph in PHASE_COLORS}
            for name, cohort in (("median", mid), ("P99 tail", tail))}


def phases_figure(results: Sequence[dict[str, Any]]):
    """(plt, fig, ax) of the phase chart, or None: one horizontal bar per run and cohort, its
    label on the y axis, where labels stack instead of running into each other (vertical
    bars with these labels under them overlapped once there were three runs)."""
    bars = []
    for r in results:
        c = cohort_phases(r)
        if c:
            bars += [(f"{r.get('label')}: {name}", v) for name, v in c.items()]
    if not bars:
        return None
    plt, fig, ax = _figure()
    y = np.arange(len(bars))
    left = np.zeros(len(bars))
    for ph, color in PHASE_COLORS.items():
        vals = np.array([b[1][ph] for b in bars])
        ax.barh(y, vals, left=left, color=color, label=ph, height=0.6)
        left += vals
    ax.set_yticks(y, [b[0] for b in bars], fontsize=max(5, min(8, 200 // len(bars))))
    ax.invert_yaxis()
    ax.set_xlabel("mean time per request (ms)")
    ax.set_title("Where the time goes: median requests vs the P99 tail")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return plt, fig, ax


def phases_png(results: Sequence[dict[str, Any]]) -> bytes | None:
    made = phases_figure(results)
    return None if made is None else _png(made[0], made[1])


def rate_png(results: Sequence[dict[str, Any]]) -> bytes | None:
    pts = [(r["request_throughput"], r) for r in results]
    if len(pts) < 2:
        return None
    pts.sort(key=lambda p: p[0])
    plt, fig, ax = _figure()
    xs = [p[0] for p in pts]
    for key, style, name in (("median_ttft_ms", "o-", "TTFT P50"), ("p99_ttft_ms", "o--", "TTFT P99"),
                             ("median_tpot_ms", "s-", "TPOT P50"), ("p99_tpot_ms", "s--", "TPOT P99")):
        if all(key in p[1] for p in pts):
            ax.plot(xs, [p[1][key] for p in pts], style, label=name)
    ax.set_xlabel("achieved request rate (req/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Latency against load")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _png(plt, fig)


def plots(results: Sequence[dict[str, Any]]) -> dict[str, bytes]:
    out = {"ttft_cdf": cdf_png(results, "ttft", "Time to first token (client)"),
           "tpot_cdf": cdf_png(results, "tpot", "Time per output token (client)")}
    ph = phases_png(results)
    if ph:
        out["phases"] = ph
    rp = rate_png(results)
    if rp:
        out["latency_vs_rate"] = rp
    return out


# -- HTML ---------------------------------------------------------------------------------

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.verdict{background:#fff7e0;border-left:4px solid #e0a000;padding:.5em 1em;margin:.5em 0}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}code{background:#f3f3f3;padding:1px 4px}"""


def _table_html(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row.values()) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _slowest(result: dict[str, Any], n: int = 10) -> list[dict[str, Any]]:
    reqs = [q for q in result["requests"] if q.get("e2el_ms") is not None]
    reqs.sort(key=lambda q: -q["e2el_ms"])
    rows = []
    for q in reqs[:n]:
        ph = q.get("phases_ms") or {}
        rows.append({"request id": q["request_id"], "E2EL ms": _fmt(q["e2el_ms"]), "TTFT ms": _fmt(q["ttft_ms"]),
                     "network ms": _fmt(ph.get("network")), "queue ms": _fmt(ph.get("queue")),
                     "prefill ms": _fmt(ph.get("prefill")), "decode ms": _fmt(ph.get("decode")),
                     "out tokens": q["output_tokens"], "error": q.get("error_kind") or ""})
    return rows


def html_report(results: Sequence[dict[str, Any]], title: str = "tailserve bench report",
                command: str | None = None, pngs: dict[str, bytes] | None = None,
                samples: Sequence[tuple[str, str]] = ()) -> str:
    pngs = pngs if pngs is not None else plots(results)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if command:
        parts.append(f"<p>Command: <code>{html.escape(command)}</code></p>")
    parts.append("<h2>Summary</h2><p>Times in milliseconds, measured by the client.</p>")
    parts.append(_table_html(summary_rows(results)))
    parts.append("<h2>Where the tail comes from</h2>")
    for r in results:
        parts.append(f"<div class='verdict'><b>{html.escape(str(r.get('label')))}</b>: "
                     f"{html.escape(r['attribution']['verdict'])}</div>")
    captions = {"ttft_cdf": "TTFT, cumulative distribution", "tpot_cdf": "TPOT, cumulative distribution",
                "phases": "Per-phase time, median requests vs the P99 tail",
                "latency_vs_rate": "Latency against achieved request rate"}
    parts.append("<h2>Plots</h2>")
    for name, data in pngs.items():
        b64 = base64.b64encode(data).decode()
        parts.append(f"<figure><img id='plot-{name}' alt='{html.escape(captions.get(name, name))}' "
                     f"src='data:image/png;base64,{b64}'><figcaption>{html.escape(captions.get(name, name))}"
                     "</figcaption></figure>")
    for r in results:
        parts.append(f"<h2>Run: {html.escape(str(r.get('label')))}</h2>")
        client = r.get("client", {})
        parts.append(f"<p>{r['completed']} completed, {r['failed']} failed in {r['duration']:.2f} s; "
                     f"HTTP {html.escape(str(client.get('http_version')))}, keep-alive "
                     f"{client.get('keep_alive')}; client P99 send lag {_fmt(client.get('p99_send_lag_ms'), 2)} ms"
                     f"{' (saturated)' if client.get('saturated') else ''}.</p>")
        parts.append("<h3>Slowest requests</h3>")
        parts.append(_table_html(_slowest(r)))
    if samples:
        parts.append("<h2>Sample completions</h2>")
        for label, text in samples:
            parts.append(f"<h3>{html.escape(label)}</h3><pre>{html.escape(text)}</pre>")
    parts.append("</body></html>")
    return "".join(parts)


# -- compare ------------------------------------------------------------------------------

COMPARE_KEYS = (("request_throughput", "higher"), ("output_throughput", "higher"),
                ("median_ttft_ms", "lower"), ("p99_ttft_ms", "lower"), ("median_tpot_ms", "lower"),
                ("p99_tpot_ms", "lower"), ("median_itl_ms", "lower"), ("p99_itl_ms", "lower"),
                ("median_e2el_ms", "lower"), ("p99_e2el_ms", "lower"))


def _per_request(result: dict[str, Any], key: str) -> np.ndarray | None:
    metric = key.split("_")[1] if "_ms" in key else None
    if metric is None or "requests" not in result:
        return None
    if metric == "itl":
        vals = [x for q in result["requests"] if q["error_kind"] is None for x in q.get("itl_ms", [])]
    else:
        vals = [q[f"{metric}_ms"] for q in result["requests"]
                if q["error_kind"] is None and q.get(f"{metric}_ms") is not None]
    return np.asarray(vals, dtype=np.float64) if vals else None


def compare(a: dict[str, Any], b: dict[str, Any], noise_floor: float = 0.05, n_boot: int = 1000,
            seed: int = 0) -> list[dict[str, Any]]:
    """B against A, metric by metric. A difference is "within noise" when a bootstrap of the
    per-request values (95% interval of B - A) includes zero, or when it is smaller than
    ``noise_floor`` (relative), the run-to-run drift of a shared machine that resampling
    one run cannot see."""
    rng = np.random.default_rng(seed)
    rows = []
    for key, better in COMPARE_KEYS:
        if key not in a or key not in b:
            continue
        va, vb = float(a[key]), float(b[key])
        delta = vb - va
        rel = delta / va if va else float("inf")
        interval = None
        xa, xb = _per_request(a, key), _per_request(b, key)
        if xa is not None and xb is not None and xa.size > 1 and xb.size > 1:
            ia = rng.integers(0, xa.size, size=(n_boot, xa.size))
            ib = rng.integers(0, xb.size, size=(n_boot, xb.size))
            if key.startswith("median"):
                da = np.median(xa[ia], axis=1)
                db = np.median(xb[ib], axis=1)
            else:
                q = float(key[1:].split("_")[0])
                da = np.percentile(xa[ia], q, axis=1)
                db = np.percentile(xb[ib], q, axis=1)
            lo, hi = np.percentile(db - da, [2.5, 97.5])
            interval = (float(lo), float(hi))
        noise = abs(rel) < noise_floor or (interval is not None and interval[0] <= 0 <= interval[1])
        if noise:
            verdict = "within noise"
        else:
            improved = (delta > 0) == (better == "higher")
            verdict = "better" if improved else "worse"
        rows.append({"metric": key, "A": va, "B": vb, "delta": delta, "relative": rel, "interval95": interval,
                     "verdict": verdict})
    return rows


def render_compare(rows: Sequence[dict[str, Any]], name_a: str, name_b: str) -> str:
    lines = [f"B = {name_b} against A = {name_a}",
             f"{'metric':20s} {'A':>12s} {'B':>12s} {'B-A':>12s} {'rel':>8s}  {'95% interval of B-A':>24s}  verdict"]
    for r in rows:
        iv = f"[{r['interval95'][0]:.2f}, {r['interval95'][1]:.2f}]" if r["interval95"] else "-"
        lines.append(f"{r['metric']:20s} {r['A']:12.2f} {r['B']:12.2f} {r['delta']:+12.2f} {r['relative']:+8.1%}  "
                     f"{iv:>24s}  {r['verdict']}")
    return "\n".join(lines) + "\n"
