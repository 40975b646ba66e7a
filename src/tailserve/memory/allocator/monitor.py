"""Monitoring PyTorch's CUDA caching allocator: samples of ``torch.cuda.memory_stats()``
taken off the hot path, three fragmentation measures, and an alert with hysteresis.

The measures (docs/memory.md):

- ``inactive_split / reserved``: free bytes stranded in segments that are partly in use;
  no ``empty_cache`` returns them, and they are what makes "CUDA out of memory" happen with
  gigabytes free. The alert watches this one, and only while reserved is above a floor
  (an idle process with a few MiB reserved must not alarm).
- ``(reserved - allocated) / reserved``: reported, not alerted on: it includes cache that
  is free to reuse or release.
- ``1 - peak active / peak reserved``: how much of the high-water mark was never in use.

An episode starts when the alert measure stays above the threshold for
``trigger_samples`` samples in a row: one warning log line, the episode counter goes up,
``health()`` says degraded and why. It ends after ``clear_samples`` samples below the
threshold. The stats source is a callable returning ``memory_stats()``'s flat dict, so tests
feed recorded sequences (no CUDA here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailserve.memory.allocator.ratios import peak_waste_ratio, stranded_ratio, unallocated_ratio

log = logging.getLogger("tailserve.memory")

StatsSource = Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class AllocatorSample:
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    requested_bytes: int
    peak_active_bytes: int
    peak_reserved_bytes: int
    num_alloc_retries: int
    num_ooms: int

    @classmethod
    def from_memory_stats(cls, s: dict[str, Any]) -> AllocatorSample:
        g = lambda k: int(s.get(k, 0))  # noqa: E731 - a local shorthand
        return cls(g("reserved_bytes.all.current"), g("allocated_bytes.all.current"), g("active_bytes.all.current"),
                   g("inactive_split_bytes.all.current"), g("requested_bytes.all.current"),
                   g("active_bytes.all.peak"), g("reserved_bytes.all.peak"), g("num_alloc_retries"), g("num_ooms"))

    @property
    def inactive_split_over_reserved(self) -> float:
        return stranded_ratio(self.inactive_split_bytes, self.reserved_bytes)

    @property
    def unallocated_over_reserved(self) -> float:
        return unallocated_ratio(self.reserved_bytes, self.allocated_bytes)

    @property
    def one_minus_peak_ratio(self) -> float:
        # memory_stats always reports the peaks, so this is a number.
        return peak_waste_ratio(self.peak_active_bytes, self.peak_reserved_bytes) or 0.0


class AllocatorMonitor:
    def __init__(self, source: StatsSource, every_steps: int = 64, every_s: float = 5.0, threshold: float = 0.30,
                 min_reserved_bytes: int = 1 << 30, trigger_samples: int = 3, clear_samples: int = 3,
                 clock: Callable[[], float] = time.monotonic,
                 on_sample: Callable[[AllocatorMonitor], None] | None = None) -> None:
        if not 0.0 < threshold < 1.0 or trigger_samples < 1 or clear_samples < 1 or every_steps < 1:
            raise ValueError("threshold in (0, 1), sample counts and every_steps >= 1")
        self.source, self.every_steps, self.every_s = source, every_steps, every_s
        self.threshold, self.min_reserved_bytes = threshold, min_reserved_bytes
        self.trigger_samples, self.clear_samples = trigger_samples, clear_samples
        self.clock, self.on_sample = clock, on_sample
        self.last: AllocatorSample | None = None
        self.num_samples = 0
        self.num_episodes = 0
        self.alerting = False
        self.reason: str | None = None
        self._above = 0
        self._below = 0
        self._last_t: float | None = None

    def maybe_sample(self, step: int) -> AllocatorSample | None:
        """Sample every ``every_steps`` steps or ``every_s`` seconds, whichever comes first."""
        now = self.clock()
        if step % self.every_steps == 0 or self._last_t is None or now - self._last_t >= self.every_s:
            return self.sample(now)
        return None

    def sample(self, now: float | None = None) -> AllocatorSample:
        s = AllocatorSample.from_memory_stats(self.source())
        self._last_t = self.clock() if now is None else now
        self.last = s
        self.num_samples += 1
        frag = s.inactive_split_over_reserved
        if frag > self.threshold and s.reserved_bytes >= self.min_reserved_bytes:
            self._above += 1
            self._below = 0
            if not self.alerting and self._above >= self.trigger_samples:
                self.alerting = True
                self.num_episodes += 1
                self.reason = (f"allocator fragmentation: {frag:.0%} of {s.reserved_bytes / (1 << 30):.2f} GiB "
                               f"reserved is stranded in split blocks (inactive_split_bytes "
                               f"{s.inactive_split_bytes / (1 << 20):.0f} MiB) for {self._above} samples; "
                               "consider PYTORCH_CUDA_ALLOC_CONF max_split_size_mb or expandable_segments:True")
                log.warning(self.reason)
        else:
            self._below += 1
            self._above = 0
            if self.alerting and self._below >= self.clear_samples:
                self.alerting = False
                self.reason = None
        if self.on_sample is not None:
            self.on_sample(self)
        return s

    def health(self) -> dict[str, Any]:
        if self.alerting:
            return {"status": "degraded", "reason": self.reason}
        return {"status": "ok"}

    def figures(self) -> dict[str, float | int]:
        s = self.last
        if s is None:
            return {"num_samples": 0, "num_episodes": self.num_episodes}
        return {"reserved_bytes": s.reserved_bytes, "allocated_bytes": s.allocated_bytes,
                "active_bytes": s.active_bytes, "inactive_split_bytes": s.inactive_split_bytes,
                "requested_bytes": s.requested_bytes, "num_alloc_retries": s.num_alloc_retries,
                "num_ooms": s.num_ooms, "inactive_split_over_reserved": s.inactive_split_over_reserved,
                "unallocated_over_reserved": s.unallocated_over_reserved,
                "one_minus_peak_ratio": s.one_minus_peak_ratio, "num_samples": self.num_samples,
                "num_episodes": self.num_episodes, "alerting": self.alerting}
