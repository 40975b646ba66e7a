"""Each act's verdict, one sentence computed from its figures (never a canned line).

Pure functions over plain dicts, so a test can feed synthetic figures and watch the sentence
follow them. The figures' shapes are those ``tailserve.demo.acts`` produces:

- tail: ``{"direct": T, "proxied": T, "every": n, "delay_ms": d}``, T = ``{"p50_e2el_ms",
  "p99_e2el_ms", "dominant", "share": {phase: fraction}}`` (bench's attribution);
- speculation: ``{"loads": [{"load": name, "by": "latency" or "throughput", "off": S,
  "adaptive": S}], "repeated": {"by", "off": S, "suffix": S} | None}``,
  S = ``{"tpot_p50_ms", "tok_s", "acceptance_pct", "draft_per_token"}``;
- prefix: ``{"off": P, "on": P, "prefix_tokens": n}``, P = ``{"ttft_p50_ms", "ttft_p99_ms",
  "prompt_tokens", "computed_tokens", "hit_rate"}``;
- memory: ``{"capacity": {"kv_mib", "max_model_len", "paged": C, "contiguous": C},
  "allocator": [A, ...], "alert_threshold", "alert_floor_mib"}``, C = ``{"max_concurrent"}``,
  A = ``{"conf", "peak_reserved_mib", "stranded_at_peak", "max_stranded_above_floor",
  "alert_fires", "oom"}``.
"""

from __future__ import annotations

from typing import Any

# A change smaller than this is within run-to-run noise here (timings vary 10-25% minute to
# minute; the acts measure the two sides back to back, which narrows it).
NOISE = 0.05
# Below this many draft tokens per output token the controller has, in effect, turned
# speculation off (explorations alone draft a little).
TURNED_DOWN = 0.15


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def tail_verdict(f: dict[str, Any]) -> str:
    d, p = f["direct"], f["proxied"]
    if d is None or p is None:
        return "The server's per-request timings did not reach the client, so the tail cannot be attributed."
    dr, pr = _ratio(d["p99_e2el_ms"], d["p50_e2el_ms"]), _ratio(p["p99_e2el_ms"], p["p50_e2el_ms"])
    first = (f"Sent directly, P99 end-to-end is {dr:.1f}x the median and the tail's extra time is mostly "
             f"{d['dominant']} ({d['share'][d['dominant']]:.0%})")
    hold = f"1 response in {f['every']} held {f['delay_ms']:.0f} ms"
    if p["dominant"] == "network":
        second = (f"through the proxy ({hold}) P99 grows to {p['p99_e2el_ms']:.0f} ms ({pr:.1f}x the median) "
                  f"and the extra time is the network ({p['share']['network']:.0%}): time outside the server, "
                  "which its own metrics cannot see")
    else:
        second = (f"through the proxy ({hold}) the tail's extra time is still mostly {p['dominant']} "
                  f"({p['share'][p['dominant']]:.0%}), not the network: the held responses did not reach the tail")
    return f"{first}; {second}."


def _spec_clause(where: str, off: dict[str, Any], on: dict[str, Any], name: str, by: str) -> str:
    """``by``: what decides at this load, "latency" (per-token latency, a single user's
    view: batch 1) or "throughput" (tokens/s, a busy server's)."""
    cut = 1 - on["tpot_p50_ms"] / off["tpot_p50_ms"]
    speed = on["tok_s"] / off["tok_s"] if off["tok_s"] else float("nan")
    gain = cut if by == "latency" else speed - 1
    figs = f"{off['tpot_p50_ms']:.2f} -> {on['tpot_p50_ms']:.2f} ms per token, {speed:.2f}x the tokens/s"
    acc = on.get("acceptance_pct")
    dpt = on.get("draft_per_token") or 0.0
    measure = "per-token latency" if by == "latency" else "tokens/s"
    more = "less" if by == "latency" else "more"
    if dpt < TURNED_DOWN:
        # A few drafts a token cannot buy more than a few percent: a larger gain is the runs'
        # own noise (a fresh-clone run on AVX2 once read "pays, 1.24x" at 0.04 drafts a token).
        if gain > NOISE:
            return (f"{where} the controller turned {name} down ({dpt:.2f} draft tokens per output token), so "
                    f"the {gain:.0%} {more} {measure} is run-to-run noise, not speculation: {figs}")
        cost = "and costs nothing measurable" if gain >= -NOISE else f"yet {measure} is {-gain:.0%} worse"
        return (f"{where} the controller turned {name} down ({dpt:.2f} draft tokens per output token) {cost}: "
                f"{figs}")
    if gain > NOISE:
        acc_s = f", {acc:.0f}% of drafts accepted" if acc is not None else ""
        return f"{where} {name} pays: {figs} ({gain:.0%} {more} {measure}{acc_s})"
    if gain < -NOISE:
        return f"{where} {name} costs {-gain:.0%} of {measure}: {figs}, {dpt:.2f} draft tokens per output token"
    return f"{where} {name} is even with off in {measure}: {figs}"


def speculation_verdict(f: dict[str, Any]) -> str:
    parts = [_spec_clause(f"at {x['load']}", x["off"], x["adaptive"], "adaptive speculation", x.get("by", "latency"))
             for x in f["loads"]]
    rep = f.get("repeated")
    if rep:
        parts.append(_spec_clause("on repeated requests", rep["off"], rep["suffix"], "suffix decoding",
                                  rep.get("by", "latency")))
    text = "; ".join(parts) + "."
    return text[:1].upper() + text[1:]


def prefix_verdict(f: dict[str, Any]) -> str:
    off, on = f["off"], f["on"]
    cut = 1 - on["ttft_p50_ms"] / off["ttft_p50_ms"]
    figs = (f"TTFT P50 {off['ttft_p50_ms']:.0f} -> {on['ttft_p50_ms']:.0f} ms, P99 {off['ttft_p99_ms']:.0f} -> "
            f"{on['ttft_p99_ms']:.0f} ms")
    hit = on.get("hit_rate")
    work = (f"the server computed {on['computed_tokens']} of {on['prompt_tokens']} prompt tokens instead of "
            f"{off['computed_tokens']}" + (f" (hit rate {hit:.0%})" if hit is not None else ""))
    if cut > NOISE:
        return (f"With {f['prefix_tokens']}-token shared prefixes, prefix caching cut TTFT P50 by {cut:.0%} "
                f"({figs}): {work}.")
    if not hit:
        return f"Prefix caching found nothing to reuse ({figs}): no prompt shared a cached prefix."
    return (f"Prefix caching did not cut TTFT ({figs}) although {work}: prefill is not what the first token waits "
            "for at this prompt length.")


def memory_verdict(f: dict[str, Any]) -> str:
    cap = f["capacity"]
    p, c = cap["paged"]["max_concurrent"], cap["contiguous"]["max_concurrent"]
    ratio = p / c if c else float("inf")
    first = (f"In the same {cap['kv_mib']:.0f} MiB of KV cache, paging ran {p} sequences at once against {c} "
             f"with a contiguous {cap['max_model_len']}-token reservation each ({ratio:.1f}x)")
    rows = f["allocator"]
    fires = [r["conf"] for r in rows if r["alert_fires"]]
    quiet = [r["conf"] for r in rows if not r["alert_fires"]]
    least = min(rows, key=lambda r: r["peak_reserved_mib"])
    most = max(rows, key=lambda r: r["peak_reserved_mib"])
    alert = f"the {f['alert_threshold']:.0%} fragmentation alert"
    if fires and quiet:
        second = f"{alert} would fire under {', '.join(fires)} and not under {', '.join(quiet)}"
    elif fires:
        second = f"{alert} would fire under every setting tried"
    else:
        second = f"{alert} would fire under none of them (worst stranded share above the floor " \
                 f"{max(r['max_stranded_above_floor'] for r in rows):.0%})"
    if least["peak_reserved_mib"] < most["peak_reserved_mib"]:
        second += (f"; {least['conf']} reserves the least at its peak ({least['peak_reserved_mib']:.1f} MiB against "
                   f"{most['peak_reserved_mib']:.1f} MiB under {most['conf']})")
    base = rows[0]
    same = [r["conf"] for r in rows[1:] if all(r[k] == base[k] for k in ("peak_reserved_mib", "stranded_at_peak",
                                                                          "max_stranded_above_floor"))]
    if same:
        second += f"; {', '.join(same)} changes nothing here against {base['conf']}"
    ooms = [r["conf"] for r in rows if r["oom"]]
    if ooms:
        second += f"; out of memory under {', '.join(ooms)}"
    return (f"{first}. Replayed through the caching-allocator model (this engine's own allocation trace on the CPU: "
            f"a model, not a measurement of a GPU), {second}.")
