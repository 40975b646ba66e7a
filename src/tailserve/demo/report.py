"""The demo's text tables and its HTML report.

The report's charts are HTML bars, not images: each row a grid of label, bar and value in
columns of their own, so a label can wrap but never runs into its neighbour (the headless
browser test checks the boxes), and the page needs no script at all.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from tailserve.demo.acts import Act


def text_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    line = "  ".join(f"{c:<{w}s}" if i == 0 else f"{c:>{w}s}" for i, (c, w) in enumerate(zip(columns, widths)))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(f"{v:<{w}s}" if i == 0 else f"{v:>{w}s}" for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(out) + "\n"


def render_act(act: Act) -> str:
    parts = [f"\n{act.title}  ({act.seconds:.0f} s)", text_table(act.columns, act.rows)]
    if act.extra_table is not None:
        parts.append(text_table(*act.extra_table))
    parts.append(f"verdict: {act.verdict}")
    return "\n".join(parts) + "\n"


CSS = """
body { font-family: system-ui, sans-serif; max-width: 62rem; margin: 1.5rem auto; padding: 0 1rem; color: #1b1f24; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2.2rem; border-bottom: 1px solid #d0d7de; padding-bottom: .3rem; }
h3 { font-size: 1rem; margin: 1.2rem 0 .4rem; }
table { border-collapse: collapse; margin: .6rem 0; font-size: .9rem; }
th, td { border: 1px solid #d0d7de; padding: .25rem .55rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f6f8fa; }
.verdict { background: #eef6ee; border-left: 4px solid #2da44e; padding: .5rem .8rem; }
.note { color: #57606a; }
.chart { margin: .6rem 0 1rem; }
.bar-row { display: grid; grid-template-columns: minmax(0, 17rem) minmax(0, 1fr) 7rem; column-gap: .75rem;
           align-items: center; margin: .2rem 0; }
.bar-label { overflow-wrap: anywhere; font-size: .85rem; }
.bar-track { background: #f0f2f4; height: 1.1rem; border-radius: 2px; overflow: hidden; }
.bar { display: block; height: 100%; background: #0969da; }
.bar-value { font-variant-numeric: tabular-nums; font-size: .85rem; white-space: nowrap; }
table.meta td { text-align: left; }
pre { background: #f6f8fa; padding: .6rem; overflow-x: auto; font-size: .8rem; }
"""


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def bar_chart(title: str, unit: str, bars: Sequence[tuple[str, float]]) -> str:
    top = max((v for _, v in bars if v is not None), default=0.0) or 1.0
    rows = []
    for label, v in bars:
        width = 0.0 if v is None else max(0.0, 100.0 * v / top)
        value = "-" if v is None else (f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}")
        rows.append(f'<div class="bar-row"><span class="bar-label">{html.escape(label)}</span>'
                    f'<span class="bar-track"><span class="bar" style="width:{width:.1f}%"></span></span>'
                    f'<span class="bar-value">{html.escape(value)} {html.escape(unit)}</span></div>')
    return f'<div class="chart"><h3>{html.escape(title)}</h3>{"".join(rows)}</div>'


def html_report(acts: Sequence[Act], header: dict[str, Any]) -> str:
    sections = []
    for a in acts:
        extra = _table(*a.extra_table) if a.extra_table is not None else ""
        charts = "".join(bar_chart(*c) for c in a.charts)
        cmds = html.escape("\n".join(a.commands))
        sections.append(
            f'<section id="act-{a.key}"><h2>{html.escape(a.title)}</h2><p class="note">{html.escape(a.note)}</p>'
            f'{_table(a.columns, a.rows)}{extra}<p class="verdict">{html.escape(a.verdict)}</p>{charts}'
            f"<h3>Reproduce against your own server and model</h3><pre>{cmds}</pre></section>")
    meta = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in header.items())
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>tailserve demo</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>'
            f'<body><h1>tailserve demo</h1><table class="meta">{meta}</table>{"".join(sections)}</body></html>')
