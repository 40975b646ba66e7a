"""What a PyTorch memory snapshot says: where the reserved memory is, how much of it is
stranded, and who allocated it; plus a picture of the segment map (PNG).

Definitions (as the caching allocator counts them):

- reserved: the segments' total size; allocated: blocks in state ``active_allocated``;
  active also counts ``active_pending_free`` / ``active_awaiting_free`` (freed, waiting on
  another stream).
- stranded (inactive split): free blocks of segments that still have an active block. No
  ``empty_cache`` returns them; a request larger than each of them needs a new segment.
- the three fragmentation measures of docs/memory.md; the peak-based one comes from the
  snapshot's ``device_traces`` (segment maps and allocations replayed), when it has them.
- allocation sites: active blocks grouped by their innermost frame outside PyTorch itself.

The PNG is written with zlib alone (no plotting dependency): one row per segment, at one
scale for all, blue = allocated, orange = freed but pending, red = stranded, grey = free
whole segment.
"""

from __future__ import annotations

import struct
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tailserve.memory.allocator.ratios import peak_waste_ratio, stranded_ratio, unallocated_ratio

_ACTIVE = ("active_allocated", "active_pending_free", "active_awaiting_free")


@dataclass
class PoolFigures:
    segments: int = 0
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    active_bytes: int = 0
    stranded_bytes: int = 0


@dataclass
class SnapshotAnalysis:
    num_segments: int
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int
    stranded_bytes: int  # inactive split
    largest_free_block: int
    pools: dict[str, PoolFigures]  # "large/stream 0", ...
    top_sites: list[tuple[str, int]]
    peak_active_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    allocator_settings: dict[str, Any] = field(default_factory=dict)

    @property
    def inactive_split_over_reserved(self) -> float:
        return stranded_ratio(self.stranded_bytes, self.reserved_bytes)

    @property
    def unallocated_over_reserved(self) -> float:
        return unallocated_ratio(self.reserved_bytes, self.allocated_bytes)

    @property
    def one_minus_peak_ratio(self) -> float | None:
        """None without device traces (the peaks are unknown)."""
        return peak_waste_ratio(self.peak_active_bytes, self.peak_reserved_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_segments": self.num_segments, "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes, "active_bytes": self.active_bytes,
            "stranded_bytes": self.stranded_bytes, "largest_free_block": self.largest_free_block,
            "inactive_split_over_reserved": self.inactive_split_over_reserved,
            "unallocated_over_reserved": self.unallocated_over_reserved,
            "one_minus_peak_ratio": self.one_minus_peak_ratio,
            "pools": {k: v.__dict__ for k, v in self.pools.items()},
            "top_sites": [{"site": s, "bytes": b} for s, b in self.top_sites],
            "allocator_settings": self.allocator_settings,
        }


def _site(frames: list[dict[str, Any]] | None) -> str:
    for f in frames or []:
        name = str(f.get("filename", ""))
        if "/torch/" in name or name.startswith("??") or not name:
            continue
        return f"{name}:{f.get('line', '?')} {f.get('name', '')}".strip()
    return "(no Python frame recorded)"


def _peaks(snap: dict[str, Any]) -> tuple[int | None, int | None]:
    traces = snap.get("device_traces") or []
    if not traces or not any(traces):
        return None, None
    reserved = active = peak_r = peak_a = 0
    for entries in traces:
        for e in entries:
            a, size = e.get("action"), int(e.get("size", 0))
            if a in ("segment_alloc", "segment_map"):
                reserved += size
            elif a in ("segment_free", "segment_unmap"):
                reserved -= size
            elif a == "alloc":
                active += size
            elif a == "free_completed":
                active -= size
            peak_r, peak_a = max(peak_r, reserved), max(peak_a, active)
    return peak_a, peak_r


def analyze_snapshot(snap: dict[str, Any], top: int = 10) -> SnapshotAnalysis:
    pools: dict[str, PoolFigures] = defaultdict(PoolFigures)
    sites: dict[str, int] = defaultdict(int)
    total = PoolFigures()
    largest_free = 0
    for seg in snap.get("segments", []):
        key = f"{seg.get('segment_type', 'large')}/stream {seg.get('stream', 0)}"
        p = pools[key]
        blocks = seg.get("blocks", [])
        size = int(seg.get("total_size", sum(int(b["size"]) for b in blocks)))
        in_use = any(b.get("state") in _ACTIVE for b in blocks)
        for fig in (p, total):
            fig.segments += 1
            fig.reserved_bytes += size
        for b in blocks:
            bsize, state = int(b["size"]), b.get("state")
            if state == "active_allocated":
                for fig in (p, total):
                    fig.allocated_bytes += bsize
                sites[_site(b.get("frames"))] += bsize
            if state in _ACTIVE:
                for fig in (p, total):
                    fig.active_bytes += bsize
            elif state == "inactive":
                largest_free = max(largest_free, bsize)
                if in_use:
                    for fig in (p, total):
                        fig.stranded_bytes += bsize
    peak_a, peak_r = _peaks(snap)
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    return SnapshotAnalysis(total.segments, total.reserved_bytes, total.allocated_bytes, total.active_bytes,
                            total.stranded_bytes, largest_free, dict(pools), ranked, peak_a, peak_r,
                            dict(snap.get("allocator_settings") or {}))


def format_report(a: SnapshotAnalysis) -> str:
    mib = 1 << 20
    lines = [f"{a.num_segments} segments, {a.reserved_bytes / mib:.1f} MiB reserved, "
             f"{a.allocated_bytes / mib:.1f} MiB allocated, {a.active_bytes / mib:.1f} MiB active",
             f"stranded in split segments: {a.stranded_bytes / mib:.1f} MiB "
             f"(inactive split / reserved {a.inactive_split_over_reserved:.3f}); largest free block "
             f"{a.largest_free_block / mib:.1f} MiB",
             f"(reserved - allocated) / reserved {a.unallocated_over_reserved:.3f}; 1 - peak active / peak reserved "
             + ("n/a (no device_traces)" if a.one_minus_peak_ratio is None else f"{a.one_minus_peak_ratio:.3f}"),
             "", f"{'pool':24s} {'segments':>9s} {'reserved MiB':>13s} {'allocated MiB':>14s} {'stranded MiB':>13s}"]
    for k, p in sorted(a.pools.items()):
        lines.append(f"{k:24s} {p.segments:9d} {p.reserved_bytes / mib:13.1f} {p.allocated_bytes / mib:14.1f} "
                     f"{p.stranded_bytes / mib:13.1f}")
    if a.top_sites:
        lines += ["", "top allocation sites (allocated bytes):"]
        lines += [f"  {b / mib:10.1f} MiB  {s}" for s, b in a.top_sites]
    return "\n".join(lines)


_COLORS = {"allocated": (52, 101, 164), "pending": (245, 121, 0), "stranded": (204, 0, 0), "free": (186, 189, 182),
           "gap": (255, 255, 255)}


def segment_map_png(snap: dict[str, Any], width: int = 1024, row: int = 10, gap: int = 3) -> bytes:
    """A PNG of the segment map: one row per segment (largest first), one scale for all."""
    segs = sorted(snap.get("segments", []), key=lambda s: -int(s.get("total_size", 0)))
    if not segs:
        segs = []
    biggest = max((int(s.get("total_size", 0)) for s in segs), default=1) or 1
    height = max(len(segs), 1) * (row + gap)
    pixels = [[_COLORS["gap"]] * width for _ in range(height)]
    for i, seg in enumerate(segs):
        blocks = seg.get("blocks", [])
        in_use = any(b.get("state") in _ACTIVE for b in blocks)
        x = 0.0
        for b in blocks:
            state = b.get("state")
            kind = ("allocated" if state == "active_allocated" else "pending" if state in _ACTIVE
                    else "stranded" if in_use else "free")
            w = int(b["size"]) / biggest * width
            x0, x1 = int(x), max(int(x + w), int(x) + 1)
            for y in range(i * (row + gap), i * (row + gap) + row):
                line = pixels[y]
                for px in range(x0, min(x1, width)):
                    line[px] = _COLORS[kind]
            x += w
    raw = b"".join(b"\x00" + bytes(c for rgb in line for c in rgb) for line in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def html_report(a: SnapshotAnalysis, snap: dict[str, Any], title: str = "tailserve memory analysis") -> str:
    """One self-contained page: the figures, the pools, the allocation sites and the segment
    map (embedded PNG, with its legend)."""
    import base64
    import html

    mib = 1 << 20

    def table(head: list[str], rows: list[list[str]]) -> str:
        th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"

    peak = "n/a (no device_traces)" if a.one_minus_peak_ratio is None else f"{a.one_minus_peak_ratio:.3f}"
    figures = [["segments", str(a.num_segments)], ["reserved", f"{a.reserved_bytes / mib:.1f} MiB"],
               ["allocated", f"{a.allocated_bytes / mib:.1f} MiB"], ["active", f"{a.active_bytes / mib:.1f} MiB"],
               ["stranded in split segments", f"{a.stranded_bytes / mib:.1f} MiB"],
               ["largest free block", f"{a.largest_free_block / mib:.1f} MiB"],
               ["inactive split / reserved (the alert's measure)", f"{a.inactive_split_over_reserved:.3f}"],
               ["(reserved - allocated) / reserved", f"{a.unallocated_over_reserved:.3f}"],
               ["1 - peak active / peak reserved", peak]]
    pools = [[k, str(p.segments), f"{p.reserved_bytes / mib:.1f}", f"{p.allocated_bytes / mib:.1f}",
              f"{p.stranded_bytes / mib:.1f}"] for k, p in sorted(a.pools.items())]
    sites = [[f"{b / mib:.1f}", s] for s, b in a.top_sites]
    png = base64.b64encode(segment_map_png(snap)).decode()
    legend = ", ".join(f"<span style='color:rgb{_COLORS[k]}'>&#9632;</span> {name}" for k, name in (
        ("allocated", "allocated"), ("pending", "freed, pending on a stream"), ("stranded", "stranded (free in a "
                                                                                           "split segment)"),
        ("free", "free whole segment")))
    settings = html.escape(str(a.allocator_settings)) if a.allocator_settings else "(not recorded)"
    css = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;"
           "margin:1em 0;font-size:13px}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}"
           "th{background:#f3f3f3}img{max-width:100%;border:1px solid #ddd}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{css}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<h2>Figures</h2>{table(['measure', 'value'], figures)}"
            f"<h2>Pools</h2>{table(['pool', 'segments', 'reserved MiB', 'allocated MiB', 'stranded MiB'], pools)}"
            f"<h2>Top allocation sites</h2>{table(['allocated MiB', 'site'], sites) if sites else '<p>none</p>'}"
            f"<h2>Segment map</h2><p>One row per segment, largest first, one scale for all: {legend}.</p>"
            f"<img id='segment-map' alt='segment map' src='data:image/png;base64,{png}'>"
            f"<h2>Allocator settings</h2><p>{settings}</p></body></html>")
