"""The caching allocator's three fragmentation measures, defined once (docs/memory.md), for the
monitor's samples, a snapshot's analysis and the allocator model alike:

- ``inactive_split / reserved``: free bytes stranded in partly used segments; the measure
  the alert uses (releasable cache is not in it);
- ``(reserved - allocated) / reserved``: every reserved byte not allocated, releasable cache
  included (what ``nvidia-smi`` users usually look at; misleading alone);
- ``1 - peak active / peak reserved``: how much of the high-water mark was never in use.

An allocator that reserved nothing has ratios of 0.0; a peak that was never recorded (a
snapshot without device traces) gives None, not a number.
"""

from __future__ import annotations


def stranded_ratio(inactive_split_bytes: int, reserved_bytes: int) -> float:
    return inactive_split_bytes / reserved_bytes if reserved_bytes else 0.0


def unallocated_ratio(reserved_bytes: int, allocated_bytes: int) -> float:
    return (reserved_bytes - allocated_bytes) / reserved_bytes if reserved_bytes else 0.0


def peak_waste_ratio(peak_active_bytes: int | None, peak_reserved_bytes: int | None) -> float | None:
    if peak_active_bytes is None or peak_reserved_bytes is None:
        return None
    return 1.0 - peak_active_bytes / peak_reserved_bytes if peak_reserved_bytes else 0.0
